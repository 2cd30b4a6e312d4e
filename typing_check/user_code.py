"""A user's typed program over etrax's public API, checked by ``nox -s typecheck``
with ``mypy --strict --disallow-any-expr`` against the installed package alone (a
fresh virtual environment, run from outside the repository, so neither this
repository's ``typings/`` nor its mypy settings apply).

``--disallow-any-expr`` rejects every expression whose type contains ``Any``, except
one assigned to an annotated variable: so no value etrax returns is annotated here,
and ``assert_type`` pins the precise types users rely on. The file uses only etrax
and typed JAX functions, so an ``Any`` could come from nowhere else. The one
documented exception, a model's outputs (their type is the model's own), is marked
where it occurs. The file is type-checked, never run.
"""

import io
from typing import assert_type

import jax
import jax.numpy as jnp
from jaxtyping import Array

import etrax

B, T, N_IN = 4, 8, 3
Grads = etrax.PathDict[etrax.ArrayTree]


def mse(y: Array, target: Array) -> Array:
    return jnp.sum((y - target) ** 2)


def mse_and_output(y: Array, target: Array) -> tuple[Array, Array]:
    return jnp.sum((y - target) ** 2), y


def learner_api() -> None:
    cell = etrax.nn.GRUCell(N_IN, 5)
    learner = etrax.compile(cell, etrax.DRTRL(), jnp.zeros((B, N_IN)), batch_size=B)
    assert_type(learner, etrax.OnlineLearner)
    mapped = etrax.compile(cell, "pp_prop", jnp.zeros((B, N_IN)), batch_size=B, vmap=True)
    options: etrax.CompilerOptions = {"xla_cpu_use_fusion_emitters": False}
    x0 = jnp.zeros((B, N_IN))
    fast = etrax.compile(cell, "eprop", x0, batch_size=B, compiler_options=options)
    assert_type(fast.compiler_options, etrax.CompilerOptions | None)
    xs = jax.random.normal(jax.random.key(0), (T, B, N_IN))
    ys = jax.random.normal(jax.random.key(1), (T, B, 5))

    assert_type(learner.etrace_grad(xs, ys, mse), Grads)
    assert_type(learner.etrace_grad(xs, ys, mse, return_value=False), Grads)
    assert_type(learner.etrace_grad(xs, ys, mse, return_value=True), tuple[Grads, Array])
    assert_type(learner.etrace_grad(xs, ys, mse_and_output, has_aux=True), tuple[Grads, Array])
    grads, losses, outs = learner.etrace_grad(
        xs, ys, mse_and_output, mask=jnp.ones(T), reduction="mean", has_aux=True,
        return_value=True, loss_output="per_step",
    )  # fmt: skip
    assert_type(outs, Array)
    print(grads, losses + outs.sum(), mapped.etrace_grad(xs, ys, mse, return_value=True))
    for path, g in grads.items():
        assert_type(path, etrax.Path)
        assert_type(g, etrax.ArrayTree)
        if isinstance(g, dict):
            print(g["weight"])

    params = learner.params
    assert_type(params, Grads)
    learner.params = params
    learner.reset()
    assert_type(learner.etrace_evolve(xs), None)
    assert_type(learner.bptt_grad(xs, ys, mse), Grads)
    assert_type(learner.bptt_grad(xs, ys, mse, return_value=True), tuple[Grads, Array])
    # A model's outputs are the documented exception: their type is the model's own,
    # which etrax cannot know; annotate them where they are used.
    outputs: Array = learner.etrace_evolve(xs, return_outputs=True)
    one: Array = learner(xs[0])
    print(outputs, one)

    rules = learner.weight_rules()
    assert_type(rules, dict[etrax.Path, etrax.WeightStatus])
    for path, status in rules.items():
        assert_type(status.rule, etrax.WeightRule)
        print(path)
    assert_type(learner.report(), etrax.CompilationReport)
    print(str(learner.report()))

    buffer = io.BytesIO()
    learner.save(buffer)
    buffer.seek(0)
    assert_type(learner.load(buffer), None)
    buffer.seek(0)
    assert_type(learner.load(buffer, (jnp.zeros(2), jnp.ones(3))), tuple[Array, Array])


def functional_api() -> None:
    cell = etrax.nn.GRUCell(N_IN, 5)
    graph = etrax.compile(cell, "d_rtrl", jnp.zeros(N_IN)).graph
    assert_type(graph, etrax.ETraceGraph)
    state = etrax.state_of(graph)
    assert_type(state, etrax.ModelState)
    assert_type(state.hidden, etrax.PathDict[Array])
    assert_type(state.params, Grads)
    assert_type(state.other, Grads)
    x = jnp.ones(N_IN)

    # the step's output (the first element) is the model's own: see above
    y, state2, jac = etrax.step(graph, state, x)
    y_only: Array = etrax.forward(graph, state, x)[0]
    assert_type(state2, etrax.ModelState)
    assert_type(jac, etrax.StepJacobians)
    assert_type(jac.D, tuple[Array, ...])
    print(y, y_only, jac.x, jac.df)

    algo = etrax.DRTRL()
    traces = algo.init(graph, state)
    assert_type(traces, etrax.ParamTraces)
    xs = jnp.ones((T, N_IN))
    ys = jnp.zeros((T, 5))
    result = etrax.online_grad(graph, algo, state, traces, xs, ys, mse)
    assert_type(result, etrax.OnlineResult[etrax.ParamTraces])
    assert_type(result.grads, Grads)
    assert_type(result.losses, Array)
    assert_type(result.state, etrax.ModelState)
    assert_type(result.traces, etrax.ParamTraces)
    grads, aux = etrax.online_grad(graph, algo, result.state, result.traces, xs, ys, mse)
    assert_type(aux["losses"], Array)
    assert_type(aux["state"], etrax.ModelState)
    assert_type(aux["traces"], etrax.ParamTraces)
    with_aux = etrax.online_grad(graph, algo, state, traces, xs, ys, mse_and_output, has_aux=True)
    assert_type(with_aux.loss_aux, etrax.ArrayTree)
    print(grads)

    ref = etrax.bptt_grad(graph, state, xs, ys, mse)
    assert_type(ref, etrax.BPTTResult)
    assert_type(ref.grads, Grads)
    assert_type(ref.aux["losses"], Array)
    assert_type(ref.state, etrax.ModelState)

    checkpoint = etrax.Checkpoint(state, traces, jnp.zeros(3))
    buffer = io.BytesIO()
    etrax.save_checkpoint(buffer, checkpoint)
    buffer.seek(0)
    loaded = etrax.load_checkpoint(buffer, checkpoint)
    assert_type(loaded, etrax.Checkpoint[etrax.ParamTraces, Array])
    assert_type(loaded.traces, etrax.ParamTraces)
    assert_type(loaded.opt_state, Array)
    assert_type(graph.explain(), tuple[etrax.CompilationRecord, ...])
    assert_type(graph.weight_rules(), dict[etrax.Path, etrax.WeightStatus])
