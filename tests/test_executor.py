"""The pure executor: outputs, new states and Jacobians against independent oracles;
compile-once behaviour; input validation."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import brainstate
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

import etrax

from .models import CATALOGUE, LeakyLinear, ModelCase, StackedGRU, build
from .oracles import BrainstateStep, OracleJacobians, random_state_values

TOL = 1e-10


def _state_with(graph: etrax.ETraceGraph, values: dict[Any, Any]) -> etrax.ModelState:
    base = etrax.state_of(graph)
    return base.replace_hidden({p: jnp.asarray(values[p]) for p in base.hidden})


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.name)
def test_step_matches_oracles(case: ModelCase) -> None:
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    values = random_state_values(graph)
    state = _state_with(graph, values)
    y, new, jac = etrax.step(graph, state, x)
    # outputs and new states: brainstate's own step
    ref_out, ref_new = BrainstateStep(model, (x,))(values)
    for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(ref_out), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    for p in new.hidden:
        np.testing.assert_allclose(new.hidden[p], ref_new[p], rtol=0, atol=TOL)
    for p in new.other:
        for a, b in zip(jax.tree.leaves(new.other[p]), jax.tree.leaves(ref_new[p]), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    # Jacobians: jax.jacrev of brainstate's step
    oracle = OracleJacobians(graph, model, x, values, case.diagonal)
    assert len(jac.D) == len(graph.hidden_groups)
    for got, expected in zip(jac.D, oracle.D, strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
    for r, rel in enumerate(graph.hidden_param_op_relations):
        x_r = jac.x[r]
        if oracle.x[r] is None:
            assert x_r is None
        else:
            assert x_r is not None
            np.testing.assert_allclose(x_r, oracle.x[r], rtol=0, atol=TOL)
        for got, expected in zip(jac.df[r], oracle.df[r], strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
        assert len(jac.df[r]) == len(rel.tails)
    # step_vjp gives the same forward values
    y2, new2, jac2, _ = etrax.step_vjp(graph, state, x)
    for a, b in zip(jax.tree.leaves((y, new, jac)), jax.tree.leaves((y2, new2, jac2)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)  # two XLA programs
    y3, new3 = etrax.forward(graph, state, x)
    for a, b in zip(jax.tree.leaves((y, new)), jax.tree.leaves((y3, new3)), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)


def test_jacobians_carry_no_gradient() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)

    def f(params: Any) -> Any:
        _, _, jac = etrax.step(graph, state.replace_params(params), x)
        return sum(jnp.sum(d) for d in jac.D) + sum(jnp.sum(d) for t in jac.df for d in t)

    grads = jax.grad(f)(state.params)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads))


def test_pullback_matches_grad() -> None:
    model, x = build(StackedGRU)
    graph = etrax.compile_etrace_graph(model, x)
    state = _state_with(graph, random_state_values(graph))
    y, new, _, pullback = etrax.step_vjp(graph, state, x)
    cot = jax.random.normal(jax.random.PRNGKey(0), y.shape, y.dtype)
    l_h = pullback(cot)
    assert [g.shape for g in l_h] == [(4, 1), (5, 1)]
    m: Any = model
    w = state.params[("out", "weight")]
    assert isinstance(w, dict)
    np.testing.assert_allclose(l_h[1][:, 0], w["weight"] @ cot, rtol=0, atol=TOL)
    # a cotangent on the new hidden values adds directly
    extra = {p: jnp.ones_like(v) for p, v in new.hidden.items()}
    l_h2 = pullback(cot, extra)
    np.testing.assert_allclose(l_h2[1], l_h[1] + 1.0, rtol=0, atol=TOL)
    assert m is model


@contextmanager
def count_traces() -> Iterator[list[str]]:
    events: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event.endswith("jaxpr_trace_duration"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_compiled_once_per_graph() -> None:
    model, x = build(etrax.nn.LSTMCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    inputs = [x, x + 1.0, x * 2.0]
    y, state, _ = etrax.step(graph, state, inputs[0])
    y, state, _, _ = etrax.step_vjp(graph, state, inputs[0])
    again = etrax.compile_etrace_graph(model, x)  # an equal graph hits the same cache
    with count_traces() as traces:
        for xi in inputs[1:]:
            y, state, _ = etrax.step(graph, state, xi)
            y, state, _, _ = etrax.step_vjp(graph, state, xi)
        y, state, _ = etrax.step(again, state, inputs[0])
        np.asarray(y)
    assert traces == []


def test_bad_inputs_raise_before_tracing() -> None:
    model, x = build(LeakyLinear, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    other_model, x2 = build(etrax.nn.GRUCell, 3, 4)
    other = etrax.state_of(etrax.compile_etrace_graph(other_model, x2))
    wrong_dtype = jnp.ones(3, jnp.int32)  # float inputs of another width are cast
    wrong_shape = jnp.ones(5)
    missing = etrax.ModelState(etrax.PathDict(), state.hidden, state.other)
    bad_hidden = state.replace_hidden({("h",): jnp.ones((2, 4))})
    with count_traces() as traces:
        with pytest.raises(
            etrax.StepInputError, match=r"x has shape \(5,\).*expected shape \(3,\)"
        ):
            etrax.step(graph, state, wrong_shape)
        with pytest.raises(etrax.StepInputError, match=r"dtype int32.*float64.*astype"):
            etrax.step(graph, state, wrong_dtype)
        with pytest.raises(etrax.StepInputError, match="another graph"):
            etrax.step(graph, other, x)
        with pytest.raises(etrax.StepInputError, match=r"missing \[\('fc', 'weight'\)\]"):
            etrax.step(graph, missing, x)
        with pytest.raises(
            etrax.StepInputError, match=r"state.hidden\[\('h',\)\] has shape \(2, 4\)"
        ):
            etrax.step(graph, bad_hidden, x)
        with pytest.raises(etrax.StepInputError, match="structure"):
            etrax.step(graph, state, (x, x))
    assert traces == []


def test_multi_step_shapes_and_values() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(1), (5, 3))
    ys, final, jacs = etrax.multi_step(graph, state, xs)
    x0 = jacs.x[0]
    assert x0 is not None
    assert ys.shape == (5, 4) and x0.shape == (5, 7)
    assert jacs.df[0][0].shape == (5, 4, 1) and jacs.D[0].shape == (5, 4, 1, 1)
    s = state
    for t in range(5):
        y, s, jac = etrax.step(graph, s, xs[t])
        np.testing.assert_allclose(ys[t], y, rtol=0, atol=TOL)
        np.testing.assert_allclose(jacs.D[0][t], jac.D[0], rtol=0, atol=TOL)
    np.testing.assert_allclose(final.hidden[("h",)], s.hidden[("h",)], rtol=0, atol=TOL)
    with pytest.raises(etrax.StepInputError, match="leading time axis"):
        etrax.multi_step(graph, state, (xs, xs[:3]))


def test_grad_through_forward_output() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)

    def loss(params: Any) -> Any:
        y, _, _ = etrax.step(graph, state.replace_params(params), x)
        return jnp.sum(y**2)

    def ref(params: Any) -> Any:
        out, _ = BrainstateStep(model, (x,))({**dict(state.hidden), **dict(params)})
        return jnp.sum(out**2)

    g = jax.grad(loss)(state.params)
    g_ref = jax.grad(ref)(state.params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)


def test_state_of_is_strongly_typed_and_ordered() -> None:
    model, x = build(StackedGRU)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    assert list(state.params) == list(graph.module_info.weight_paths)
    assert all(not getattr(v, "weak_type", False) for v in jax.tree.leaves(state))
    assert isinstance(state.hidden, etrax.PathDict)
    leaves = jax.tree.leaves(state.params)
    rebuilt = jax.tree.unflatten(jax.tree.structure(state.params), leaves)
    assert list(rebuilt) == list(state.params)


def test_pathdict_flattens_alike_with_and_without_keys() -> None:
    """The fast flatten (every jitted call's) and the keyed one (tree paths) agree on
    the leaves, their order and the tree structure."""
    d = etrax.PathDict([(("b", 1), jnp.ones(2)), (("a",), {"w": jnp.zeros(3), "b": 1.0})])
    leaves, treedef = jax.tree.flatten(d)
    keyed, treedef_k = jax.tree_util.tree_flatten_with_path(d)
    assert str(treedef) == str(treedef_k)
    assert all(a is b for a, (_, b) in zip(leaves, keyed, strict=True))
    assert [path[0] for path, _ in keyed] == [
        jax.tree_util.DictKey(k) for k in (("b", 1),) + (("a",),) * 2
    ]
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, etrax.PathDict) and list(rebuilt) == [("b", 1), ("a",)]


def test_pathdict_prints_arrays_by_shape_and_numbers_by_value() -> None:
    d = etrax.PathDict(
        [
            (("w",), {"weight": jnp.ones((2, 3), jnp.float32), "bias": jnp.asarray(0.25)}),
            (("n",), jnp.asarray(3, jnp.int32)),
        ]
    )
    text = repr(d)
    assert "'weight': float32[2, 3]" in text
    assert "'bias': float64(0.25)" in text or "'bias': float32(0.25)" in text
    assert "('n',): int32(3)" in text

    def traced(x: Any) -> Any:
        assert repr(etrax.PathDict([(("x",), x)])) == "PathDict({('x',): float32[]})"
        return x

    jax.jit(traced)(jnp.asarray(1.0, jnp.float32))  # a tracer: no value to show


def test_paths_mixing_ints_and_strings() -> None:
    class Layers(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [LeakyLinear(3, 4), LeakyLinear(4, 4)]
            self.norm = etrax.nn.Linear(4, 2)

        def update(self, x: Any) -> Any:
            return self.norm(self.layers[1](self.layers[0](x)))

    model = Layers()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3))
    state = etrax.state_of(graph)
    assert ("layers", 0, "fc", "weight") in state.params and ("norm", "weight") in state.params
    y, state, _jac = etrax.step(graph, state, jnp.ones(3))
    assert y.shape == (2,)


def test_state_of_passes_arrays_of_the_compiled_type_through() -> None:
    """`state_of` hands a state's value on as it is when it already is a concrete,
    strongly typed array of the compiled dtype (a learner reads every state at each
    call), and converts anything else: a NumPy array, another dtype, a weak type."""
    model, x = build(etrax.nn.GRUCell, 3, 4, batch=2)
    graph = etrax.compile_etrace_graph(model, x)
    first, second = etrax.state_of(graph), etrax.state_of(graph)
    pairs = zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params), strict=True)
    assert all(a is b for a, b in pairs)
    (path,) = first.hidden
    dtype = first.hidden[path].dtype
    ref = model.h  # type: ignore[attr-defined]  # the GRU's one hidden state
    for value in (
        np.ones((2, 4), np.float32),
        jnp.ones((2, 4), jnp.float32 if dtype != jnp.float32 else jnp.float16),
        jnp.ones((2, 4), jnp.int32),
        jnp.full((2, 4), 1.0),  # weakly typed
    ):
        ref.value = value
        read = etrax.state_of(graph).hidden[path]
        assert read.dtype == dtype and not read.weak_type
        assert np.array_equal(np.asarray(read), np.ones((2, 4)))


def test_replacing_some_paths_says_which_are_missing() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    first = next(iter(state.params))
    with pytest.raises(KeyError, match="missing"):
        state.replace_params({first: state.params[first]})
    with pytest.raises(KeyError, match="unknown"):
        state.replace_hidden({**state.hidden, ("nope",): jnp.zeros(4)})
