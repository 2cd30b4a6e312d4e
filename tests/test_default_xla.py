"""etrax's programs compiled with XLA's own optimisations, not the suite's.

The suite compiles every program with fast-compiling XLA flags (`conftest.py`: LLVM
optimisation level 0 and XLA:CPU's older element-wise emitters), which users do not
set. With XLA's defaults, jax 0.10.2 on the CPU miscompiles some programs: ``jax.jit(
jax.grad(...))`` over a `lax.scan` whose float64 step cuts ``x @ W + b`` in two gave a
gradient 40 % off, where either of the suite's flags gave the right one. So here the
online rules' programs and `etrax.bptt_grad`'s are compiled with the defaults restored
(per program, through ``jax.jit``'s ``compiler_options``, which take precedence over
``XLA_FLAGS``) and checked against the oracle, which stays compiled with the suite's
flags: brainstate's own ``update`` through `jax.grad`.
"""

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax

from .models import CATALOGUE, ModelCase
from .oracles import bptt_grads, random_state_values

XLA_DEFAULTS: etrax.CompilerOptions = {
    "xla_backend_optimization_level": 3,
    "xla_cpu_use_fusion_emitters": True,
}
"""XLA's own values of the options `conftest.py` changes."""
CASES = ("two_state_b2", "alif_ff_b2", "gru_b2", "lstm", "stacked_gru")
T = 5


def mse(y: Any, t: Any) -> Array:
    return jnp.sum((y - t) ** 2)


def _close(got: Any, want: Any) -> None:
    scale = max(1.0, *(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want)))
    assert set(got) == set(want)
    for path in want:
        for g, w in zip(jax.tree.leaves(got[path]), jax.tree.leaves(want[path]), strict=True):
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=0, atol=1e-10 * scale, err_msg=str(path)
            )


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CATALOGUE if c.name in CASES], ids=lambda c: c.name)
def test_online_rules_with_xla_defaults_equal_the_oracle(case: ModelCase) -> None:
    """At T = 1 from a random hidden state every rule equals BPTT for every parameter
    leaf; on a model whose recurrence is diagonal, D-RTRL equals it over `T` steps
    (chunked, with a remainder) as well; `bptt_grad` equals it over `T` steps."""
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    values = random_state_values(graph, seed=3)
    state = etrax.state_of(graph)
    state = state.replace_hidden({p: values[p] for p in state.hidden})
    xs = jax.random.normal(jax.random.PRNGKey(4), (T, *jnp.shape(x)))
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(5), (T, *jnp.shape(y0)))
    runs: list[tuple[etrax.OnlineAlgorithm[Any], int]] = [
        (etrax.DRTRL(), 1),
        (etrax.PPProp(0.9), 1),
        (etrax.EProp(), 1),
    ]
    if case.exact_online:
        runs.append((etrax.DRTRL(chunk_steps=2), T))
    _check_programs(model, graph, state, xs, ts, runs)


class SplitGates(brainstate.nn.Module):
    """``x @ W + b`` cut in two, each part leaking into its own hidden state: the step
    whose ``jax.jit(jax.grad(scan))`` XLA's defaults miscompiled at these shapes."""

    def __init__(self) -> None:
        super().__init__()
        k1, k2 = jax.random.split(jax.random.PRNGKey(9))
        self.w = brainstate.ParamState(jax.random.normal(k1, (3, 10)))
        self.b = brainstate.ParamState(jax.random.normal(k2, (10,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4, 5)))
        self.h2 = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4, 5)))

    def update(self, x: ArrayLike) -> Array:
        a, c = jnp.split(jnp.asarray(x) @ self.w.value + self.b.value, 2, axis=-1)
        self.h.value = 0.5 * self.h.value + jnp.tanh(a)
        self.h2.value = 0.9 * self.h2.value + jax.nn.sigmoid(c)
        out: Array = self.h.value + self.h2.value
        return out


@pytest.mark.slow
def test_the_miscompiled_step_with_xla_defaults() -> None:
    """The step behind the miscompile, through every rule and `bptt_grad` over three
    steps (its recurrence is element-wise: D-RTRL is exact)."""
    model = SplitGates()
    brainstate.nn.init_all_states(model, batch_size=3)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((3, 4, 3)))
    values = random_state_values(graph, seed=6)
    state = etrax.state_of(graph)
    state = state.replace_hidden({p: values[p] for p in state.hidden})
    xs = jax.random.normal(jax.random.PRNGKey(7), (3, 3, 4, 3))
    ts = jax.random.normal(jax.random.PRNGKey(8), (3, 3, 4, 5))
    runs: list[tuple[etrax.OnlineAlgorithm[Any], int]] = [
        (etrax.DRTRL(), 3),
        (etrax.DRTRL(chunk_steps=1), 3),
        (etrax.PPProp(0.9), 1),
        (etrax.EProp(), 1),
    ]
    _check_programs(model, graph, state, xs, ts, runs)


def _check_programs(
    model: brainstate.nn.Module,
    graph: etrax.ETraceGraph,
    state: etrax.ModelState,
    xs: Array,
    ts: Array,
    runs: list[tuple[etrax.OnlineAlgorithm[Any], int]],
) -> None:
    """Each ``(rule, steps)``'s gradient over the first `steps` steps, and `bptt_grad`'s
    over all of them, compiled with `XLA_DEFAULTS`, against the oracle."""

    def bptt(st: etrax.ModelState, xs: Array, ts: Array) -> Any:
        return etrax.bptt_grad(graph, st, xs, ts, mse).grads

    got = dict(jax.jit(bptt, compiler_options=dict(XLA_DEFAULTS))(state, xs, ts))
    _close(got, bptt_grads(model, state, xs, ts, mse))
    for algo, steps in runs:

        def online(
            st: etrax.ModelState, xs: Array, ts: Array, algo: etrax.OnlineAlgorithm[Any] = algo
        ) -> Any:
            return etrax.online_grad(graph, algo, st, algo.init(graph, st), xs, ts, mse).grads

        program = jax.jit(online, compiler_options=dict(XLA_DEFAULTS))
        got = dict(program(state, xs[:steps], ts[:steps]))
        _close(got, bptt_grads(model, state, xs[:steps], ts[:steps], mse))
