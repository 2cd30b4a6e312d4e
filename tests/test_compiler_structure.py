"""Graph structure on the model catalogue (groups, relations, exclusions, report)."""

import functools
from collections.abc import Callable
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax
from etrax import DiagnosticKind as K

from .models import (
    LeakyFeedForwardStack,
    StackedGRU,
    StackedStateNeuron,
    TwoStateNeuron,
    build,
)


def _included(graph: etrax.ETraceGraph) -> list[tuple[str | int, ...]]:
    return [r.weight_path for r in graph.hidden_param_op_relations]


def test_seed_example_gru() -> None:
    gru = etrax.nn.GRUCell(3, 4)
    brainstate.nn.init_all_states(gru)
    graph = etrax.compile_etrace_graph(gru, brainstate.random.randn(3))
    assert isinstance(graph, etrax.ETraceGraph)
    assert len(graph.hidden_groups) == 1
    info = etrax.extract_module_info(gru, brainstate.random.randn(3))
    assert isinstance(info, etrax.ModuleInfo)
    d = graph.dict()
    assert set(d) == {
        "module_info",
        "hidden_groups",
        "hid_path_to_group",
        "hidden_param_op_relations",
        "hidden_perturb",
        "diagnostics",
    }
    excluded = graph.explain(kind=K.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT)
    assert [r.weight_path for r in excluded] == [("Wr", "weight")]
    assert all(r.kind is K.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT for r in excluded)
    assert graph.explain(weight_path=("Wz", "weight"))[0].kind is K.RELATION_INCLUDED
    assert [r.kind for r in graph.explain(hidden_path=("h",))] == [
        K.RELATION_INCLUDED,
        K.RELATION_INCLUDED,
        K.RECURRENT_WEIGHT_ROUTE,  # the gates read [x, h]: the diagonal approximation
    ]
    assert graph.explain(weight_path=("Wr", "weight"), kind=K.RELATION_INCLUDED) == ()
    assert len(graph.explain()) == len(graph.diagnostics)
    with pytest.raises(KeyError, match=r"Did you mean \('Wr', 'weight'\)"):
        graph.explain(weight_path=("Wrr", "weight"))  # a typo is not "no diagnostics"
    with pytest.raises(KeyError, match="names no state"):
        graph.explain(hidden_path=("hh",))
    method = etrax.ETraceGraph.explain
    explain = getattr(method, "__wrapped__", method)  # past the test run's type checker
    with pytest.raises(TypeError, match="must be a path, a tuple"):
        explain(graph, weight_path="Wr")  # type: ignore[arg-type]  # the error under test


def test_gru_structure() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    (grp,) = graph.hidden_groups
    assert grp.hidden_paths == (("h",),)
    assert grp.num_state == 1 and grp.varshape == (4,)
    assert grp.is_diagonal_recurrence and grp.has_recurrence
    assert _included(graph) == [("Wz", "weight"), ("Wh", "weight")]
    assert [r.kind for r in graph.diagnostics] == [
        K.RELATION_INCLUDED,
        K.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT,
        K.RELATION_INCLUDED,
        K.RECURRENT_WEIGHT_ROUTE,
    ]
    (route,) = graph.explain(kind=K.RECURRENT_WEIGHT_ROUTE)
    assert route.level is etrax.DiagnosticLevel.INFO
    assert route.context_dict["weight_paths"] == (("Wz", "weight"), ("Wh", "weight"))
    assert route.context_dict["hidden_group_indices"] == (0,)
    w2w = graph.explain(kind=K.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT)[0]
    assert w2w.context_dict["blocking_weight_paths"] == (("Wh", "weight"),)
    rel = graph.hidden_param_op_relations[0]
    assert rel.x_shape == (7,) and rel.y_shape == (4,)
    assert set(rel.trainable_paths) == {"weight", "bias"}
    report = graph.report()
    assert repr(report) == (
        "CompilationReport(hidden_groups=1, etrace_weights=2, excluded_weights=1, "
        "warnings=1, errors=0)"
    )
    text = str(report)
    assert "('Wr', 'weight')" in text and "relation_excluded_weight_to_weight" in text
    rules = graph.weight_rules()
    assert rules[("Wr", "weight")].rule is etrax.WeightRule.INSTANTANEOUS
    assert rules[("Wz", "weight")].rule is etrax.WeightRule.TRACED


def test_lstm_structure() -> None:
    model, x = build(etrax.nn.LSTMCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    (grp,) = graph.hidden_groups
    assert grp.hidden_paths == (("h",), ("c",))
    assert grp.num_state == 2
    assert graph.diagnostics[0].kind is K.HIDDEN_GROUP_MERGED
    assert _included(graph) == [
        ("Wi", "weight"),
        ("Wg", "weight"),
        ("Wf", "weight"),
        ("Wo", "weight"),
    ]
    relations = graph.hidden_param_op_relations
    assert len({r.x_var for r in relations}) == 1  # all gates read one [x, h]
    assert relations[3].connected_hidden_paths == (("h",),)  # the output gate feeds h only
    assert set(relations[0].connected_hidden_paths) == {("h",), ("c",)}


def test_stacked_gru_with_readout() -> None:
    model, x = build(StackedGRU)
    graph = etrax.compile_etrace_graph(model, x)
    assert [g.hidden_paths for g in graph.hidden_groups] == [(("l1", "h"),), (("l2", "h"),)]
    assert [g.varshape for g in graph.hidden_groups] == [(4,), (5,)]
    assert [(r.weight_path, r.hidden_groups) for r in graph.hidden_param_op_relations] == [
        (("l1", "Wz", "weight"), (0,)),
        (("l1", "Wh", "weight"), (0,)),
        (("l2", "Wz", "weight"), (1,)),
        (("l2", "Wh", "weight"), (1,)),
    ]
    kinds = [(r.kind, r.weight_path) for r in graph.diagnostics]
    assert kinds == [
        (K.RELATION_INCLUDED, ("l1", "Wz", "weight")),
        (K.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT, ("l1", "Wr", "weight")),
        (K.RELATION_INCLUDED, ("l1", "Wh", "weight")),
        (K.RELATION_INCLUDED, ("l2", "Wz", "weight")),
        (K.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT, ("l2", "Wr", "weight")),
        (K.RELATION_INCLUDED, ("l2", "Wh", "weight")),
        (K.RELATION_EXCLUDED_NON_TEMPORAL, ("out", "weight")),
        (K.RECURRENT_WEIGHT_ROUTE, ("l1", "Wz", "weight")),  # each cell's gates read its h
        (K.RECURRENT_WEIGHT_ROUTE, ("l2", "Wz", "weight")),
        (K.CROSS_GROUP_ROUTE, ("l1", "Wz", "weight")),  # layer 1 feeds layer 2's memory
    ]
    (cross,) = graph.explain(kind=K.CROSS_GROUP_ROUTE)
    assert cross.level is etrax.DiagnosticLevel.INFO
    assert cross.context_dict["weight_paths"] == (("l1", "Wz", "weight"), ("l1", "Wh", "weight"))
    assert cross.context_dict["hidden_group_indices"] == (0, 1)
    excluded = dict(graph.report().excluded_weights)
    assert excluded == {
        ("l1", "Wr", "weight"): "relation_excluded_weight_to_weight",
        ("l2", "Wr", "weight"): "relation_excluded_weight_to_weight",
        ("out", "weight"): "relation_excluded_non_temporal",
    }


def test_vanilla_rnn_zero_recurrence_group() -> None:
    model, x = build(etrax.nn.VanillaRNNCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    (grp,) = graph.hidden_groups
    assert not grp.has_recurrence
    assert grp.transition.num_equations == 0
    d = grp.diagonal_jacobian([jnp.ones(4)], [jnp.ones(4)])
    assert d.shape == (4, 1, 1) and float(jnp.max(jnp.abs(d))) == 0.0
    assert _included(graph) == [("W", "weight")]
    assert graph.explain(kind=K.HIDDEN_GROUP_NO_RECURRENCE)


@pytest.mark.parametrize("cls", [TwoStateNeuron, StackedStateNeuron])
def test_two_state_neuron_one_group(cls: type[brainstate.nn.Module]) -> None:
    model, x = build(cls, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    (grp,) = graph.hidden_groups
    assert grp.num_state == 2 and grp.varshape == (4,)
    assert grp.is_diagonal_recurrence
    (rel,) = graph.hidden_param_op_relations
    assert rel.hidden_groups == (0,)


@pytest.mark.parametrize(
    ("cls", "args"),
    [(etrax.nn.GRUCell, (3, 4)), (TwoStateNeuron, (3, 4)), (etrax.nn.LSTMCell, (3, 4))],
)
def test_batch_axis_inside_varshape(cls: type[brainstate.nn.Module], args: tuple[int, int]) -> None:
    model, x = build(cls, *args, batch=2)
    graph = etrax.compile_etrace_graph(model, x)
    assert all(g.varshape == (2, 4) for g in graph.hidden_groups)
    unbatched, x1 = build(cls, *args)
    g1 = etrax.compile_etrace_graph(unbatched, x1)
    assert [r.kind for r in graph.diagnostics] == [r.kind for r in g1.diagnostics]
    rel = graph.hidden_param_op_relations[0]
    rel1 = g1.hidden_param_op_relations[0]
    assert rel1.x_shape is not None
    assert rel.x_shape == (2, *rel1.x_shape) and rel.y_shape == (2, 4)


def test_other_cells() -> None:
    mgu, x = build(etrax.nn.MGUCell, 3, 4)
    g = etrax.compile_etrace_graph(mgu, x)
    assert _included(g) == [("Wf", "weight"), ("Wh", "weight")]
    partial = g.explain(kind=K.RELATION_PARTIAL_PATH)
    assert [r.weight_path for r in partial] == [("Wf", "weight")]
    mini, x = build(etrax.nn.MiniGRU, 3, 4)
    g = etrax.compile_etrace_graph(mini, x)
    assert set(_included(g)) == {("W_x", "weight"), ("W_z", "weight")}
    assert not g.explain(kind=K.RELATION_PARTIAL_PATH)


def test_inter_layer_path_is_not_partial() -> None:
    model, x = build(LeakyFeedForwardStack, 3, 4, 5)
    graph = etrax.compile_etrace_graph(model, x)
    assert not graph.explain(kind=K.RELATION_PARTIAL_PATH)
    assert [r.hidden_groups for r in graph.hidden_param_op_relations] == [(0,), (1,)]


def test_leaky_rate_readout_is_traced() -> None:
    model = etrax.nn.LeakyRateReadout(3, 2, tau=5.0)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3))
    assert [r.weight_path for r in graph.hidden_param_op_relations] == [("weight",)]
    assert graph.hidden_groups[0].is_diagonal_recurrence


class _GRULayers(brainstate.nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.cells = [etrax.nn.GRUCell(10 if i == 0 else hidden, hidden) for i in range(layers)]
        self.out = etrax.nn.Linear(hidden, 1)

    def update(self, x: Array) -> Array:
        for cell in self.cells:
            x = cell(x)
        return self.out(x)


@pytest.mark.parametrize("layers", [2, 3])
def test_stacked_layers_do_not_evaluate_the_step_twice(layers: int) -> None:
    """Where perturbation environments meet at a new hidden value (layer 2's, which
    layer 1's crossed effect also reaches), the own environment's effect is its node's
    perturbation, carried through linear equations such as layer 3's ``[x; h]``
    concatenation; so no layer's weight products are evaluated a second time, forward
    or backward. XLA's FLOP count of one step's signals and instantaneous gradients over
    the forward step's, on stacked 64-unit GRU layers: 2.11 (two layers) and 2.21
    (three); with a second evaluation it was 3.19 and 3.80, and with the node's
    perturbation alone (not carried through the concatenation) 2.55 and 3.27."""
    from etrax.algorithms._drivers import _step_grads, _with_aux
    from etrax.executor import forward_pure

    model, x = build(_GRULayers, layers, 64, batch=16, n_in=10)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    loss = _with_aux(lambda y, t: jnp.sum((y - t) ** 2), False)
    target = jnp.zeros((16, 1), x.dtype)

    def flops(fn: Callable[[etrax.ModelState, Array], Any]) -> float:
        cost = jax.jit(fn).lower(state, x).compile().cost_analysis()
        assert cost is not None
        return float(cost["flops"])

    step = flops(lambda st, x: _step_grads(graph, st, x, target, loss))
    forward = flops(lambda st, x: forward_pure(graph, st, (x,)))
    assert step / forward < 2.4, step / forward


def test_cuts_of_joins_read_the_piece_they_lie_in() -> None:
    """`fold_cuts_of_joins`: a part cut out of a ``concatenate`` or ``tile`` along its
    joining axis is read from the piece it lies in, through nested joins as deep as it
    stays in one piece, and as that piece itself when it is whole; a part spanning two
    pieces, a strided slice and a cut along another axis keep their equation; the
    values are unchanged; and a jaxpr with nothing to fold is returned as it is."""
    from etrax._compat import eval_jaxpr
    from etrax.compiler._jaxpr import drop_dead_equations, fold_cuts_of_joins

    def f(a: Array, b: Array) -> tuple[Array, ...]:
        inner = jnp.concatenate([b, a], axis=-1)
        joined = jnp.concatenate([a, inner], axis=-1)  # a | b | a: 4 | 3 | 4
        tiled = jnp.tile(b, (1, 2))  # b | b
        whole, part, in_inner = jnp.split(joined, [4, 6], axis=-1)
        across = joined[:, 2:6]  # the end of a and the start of b
        return (whole, part, in_inner, across, tiled[:, 3:6], tiled[:, 2:4], joined[:, ::2],
                joined[:1])  # fmt: skip

    a, b = jnp.arange(8.0).reshape(2, 4), -jnp.arange(6.0).reshape(2, 3)
    closed = jax.make_jaxpr(f)(a, b)
    folded = drop_dead_equations(fold_cuts_of_joins(closed))
    expected = eval_jaxpr(closed.jaxpr, closed.consts, a, b)
    got = eval_jaxpr(folded.jaxpr, folded.consts, a, b)
    for x, y in zip(got, expected, strict=True):
        assert x.shape == y.shape and bool(jnp.all(x == y))
    a_var, b_var = folded.jaxpr.invars
    producers = {v: e for e in folded.jaxpr.eqns for v in e.outvars}
    (inner_join, outer_join) = [
        e.outvars[0] for e in folded.jaxpr.eqns if e.primitive.name == "concatenate"
    ]
    (tile,) = [e.outvars[0] for e in folded.jaxpr.eqns if e.primitive.name == "tile"]
    whole, part, in_inner, across, repeat, straddle, strided, rows = folded.jaxpr.outvars
    assert whole is a_var and repeat is b_var
    for out, source in ((part, b_var), (in_inner, inner_join), (across, outer_join),
                        (straddle, tile), (strided, outer_join), (rows, outer_join)):  # fmt: skip
        assert producers[out].primitive.name == "slice" and producers[out].invars == [source]
    assert "split" not in [e.primitive.name for e in folded.jaxpr.eqns]
    plain = jax.make_jaxpr(lambda a: jnp.split(jnp.tanh(a), 2, axis=-1))(a)
    assert fold_cuts_of_joins(plain) is plain


def test_a_merge_of_heads_moves_onto_the_products_it_combines() -> None:
    """`merge_heads_first`: ``(tanh(a) * 0.5 + b + c).reshape(..., G * O)``, with ``a``
    and ``b`` per-head products (``b`` transposed after its product) and ``c`` data, is
    computed with the reshape on ``a``, ``b`` and ``c``; the values are unchanged. A
    combination with no product, a value also read elsewhere, and a reshape that does
    not merge the last two axes are left as they are."""
    from etrax._compat import Var, eval_jaxpr
    from etrax.compiler._jaxpr import drop_dead_equations, merge_heads_first
    from etrax.compiler._positions import ELEMENTWISE

    def is_product(eqn: Any) -> bool:
        return bool(eqn.primitive.name == "dot_general")

    def f(x: Array, h: Array, w: Array, u: Array, c: Array) -> tuple[Array, ...]:
        a = jnp.einsum("bi,gio->bgo", x, w)
        b = jnp.einsum("bgi,gio->bgo", h, u)  # a dot_general, then a transpose
        merged = (jnp.tanh(a) * 0.5 + b + c).reshape(2, 12)
        plain = (c * 2.0).reshape(2, 12)  # no product
        shared = a + c  # also read whole below
        return merged, plain, shared.reshape(2, 12), shared, (a + c).reshape(2, 3, 2, 2)

    shapes = [(2, 5), (2, 3, 4), (3, 5, 4), (3, 4, 4), (2, 3, 4)]
    args = [jax.random.normal(jax.random.PRNGKey(k), s) for k, s in enumerate(shapes)]
    closed = jax.make_jaxpr(f)(*args)
    moved = drop_dead_equations(merge_heads_first(closed, ELEMENTWISE, is_product))
    expected = eval_jaxpr(closed.jaxpr, closed.consts, *args)
    got = eval_jaxpr(moved.jaxpr, moved.consts, *args)
    for x, y in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12, atol=1e-12)
    producers = {v: e for e in moved.jaxpr.eqns for v in e.outvars}

    def reshaped_reads(var: Any) -> list[str]:
        """The primitives producing what each reshape under `var`'s sum reads."""
        eqn = producers[var]
        if eqn.primitive.name == "reshape":
            (src,) = eqn.invars
            return [producers[src].primitive.name if src in producers else "input"]
        reads = [a for a in eqn.invars if isinstance(a, Var) and a in producers]
        return [name for a in reads for name in reshaped_reads(a)]

    merged, plain, shared, _, split = moved.jaxpr.outvars
    assert producers[merged].primitive.name == "add"
    assert sorted(reshaped_reads(merged)) == ["dot_general", "input", "transpose"]
    for out in (plain, shared, split):
        assert producers[out].primitive.name == "reshape"
    nothing = jax.make_jaxpr(lambda c: (c * 2.0).reshape(2, 12))(args[4])
    assert merge_heads_first(nothing, ELEMENTWISE, is_product) is nothing


def test_a_custom_vjp_call_becomes_a_custom_jvp_call_of_its_transposed_rule() -> None:
    """`custom_vjp_as_jvp`: a `jax.custom_vjp` call (with a non-differentiable integer
    argument and output beside its floats) becomes a `jax.custom_jvp` call whose values
    are the call's, whose JVP is the user's backward rule transposed (``t ↦ σ'(x) t``
    here), and whose reverse-mode gradient is the one `jax.grad` gives the original;
    a backward rule that is not linear in the cotangent is left as it is, and a jaxpr
    with no custom_vjp call is returned as it is."""
    from etrax._compat import eval_jaxpr
    from etrax.compiler._jaxpr import custom_vjp_as_jvp

    def slope(x: Array) -> Array:
        return 1.0 / (1.0 + 3.0 * jnp.abs(x))

    @jax.custom_vjp
    def spike(x: Array, k: Array) -> tuple[Array, Array]:
        return (x > 0).astype(x.dtype) * k.astype(x.dtype), k + 1

    def fwd(x: Array, k: Array) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
        return spike(x, k), (x, k)

    def bwd(res: tuple[Array, Array], cts: tuple[Array, Any]) -> tuple[Array, None]:
        x, k = res
        return cts[0] * slope(x) * k.astype(x.dtype), None

    spike.defvjp(fwd, bwd)

    def f(x: Array, k: Array) -> tuple[Array, Array]:
        y, n = spike(2.0 * x, k)
        return jnp.sin(y) + x, n

    x, k = jnp.array([-0.4, 0.3, 1.2]), jnp.array(2, jnp.int32)
    closed = jax.make_jaxpr(f)(x, k)
    converted = custom_vjp_as_jvp(closed)
    names = [e.primitive.name for e in converted.jaxpr.eqns]
    assert "custom_jvp_call" in names and "custom_vjp_call" not in names, names

    def run(c: Any) -> Callable[[Array, Array], list[Array]]:
        return lambda a, b: eval_jaxpr(c.jaxpr, c.consts, a, b)

    for a, b in zip(run(converted)(x, k), f(x, k), strict=True):
        np.testing.assert_array_equal(a, b)
    t = jnp.array([0.5, -1.0, 2.0])
    _, (dy, _) = jax.jvp(lambda a: run(converted)(a, k), (x,), (t,))
    y = (2.0 * x > 0).astype(x.dtype) * 2
    np.testing.assert_allclose(dy, jnp.cos(y) * 2.0 * slope(2.0 * x) * 2 * t + t, rtol=1e-12)
    grad_new = jax.grad(lambda a: jnp.sum(run(converted)(a, k)[0] ** 2))(x)
    grad_old = jax.grad(lambda a: jnp.sum(f(a, k)[0] ** 2))(x)
    np.testing.assert_allclose(grad_new, grad_old, rtol=1e-12)

    @jax.custom_vjp
    def signed(x: Array) -> Array:
        return jnp.tanh(x)

    signed.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (jnp.sign(g) * slope(x),))
    kept = jax.make_jaxpr(signed)(x)
    assert custom_vjp_as_jvp(kept) is kept
    plain = jax.make_jaxpr(jnp.tanh)(x)
    assert custom_vjp_as_jvp(plain) is plain


_PRE, _POST, _CONN, _BATCH = 5, 4, 2, 3
_INDICES = np.array([[0, 3], [1, 1], [2, 0], [3, 2], [0, 1]], np.int32)  # a repeat in row 1


def _event_call(name: str, transpose: bool) -> tuple[Callable[..., Any], list[Array]]:
    """A brainevent product (`EVENT_PRODUCTS`) as ``f(weights, spikes, indices)`` and
    random weights and 0 / 1 spikes for it, in brainevent's layouts."""
    import brainevent

    key1, key2 = jax.random.split(jax.random.key(4))
    n_in = _PRE if transpose else _POST  # the spikes' length, fixed connections
    if name.startswith("binary_dense"):
        shape = (_PRE, _POST) if transpose else (_POST, _PRE)
        weights = jax.random.normal(key1, shape)
        n_in = _PRE
    else:
        weights = jax.random.normal(key1, (_PRE, _CONN))
    spikes_shape = (n_in,) if name.endswith(("mv", "matvec")) else (n_in, _BATCH)
    spikes = (jax.random.uniform(key2, spikes_shape) > 0.4).astype(jnp.float64)
    fn: Callable[..., Any]
    if name == "binary_densemv":
        fn = lambda w, s, i: brainevent.binary_densemv(w, s, transpose=transpose)  # noqa: E731
    elif name == "binary_densemm":
        fn = lambda w, s, i: brainevent.binary_densemm(w, s, transpose=transpose)  # noqa: E731
    elif name == "ell_binary_matvec":
        fn = lambda w, s, i: brainevent.binary_fcnmv(  # noqa: E731
            w, i, s, shape=(_PRE, _POST), transpose=transpose
        )
    else:
        fn = lambda w, s, i: brainevent.binary_fcnmm(  # noqa: E731
            w, i, s, shape=(_PRE, _POST), transpose=transpose
        )
    return fn, [weights, spikes]


@pytest.mark.usefixtures("jax_event_kernels")
@pytest.mark.parametrize("transpose", [True, False], ids=["transpose", "plain"])
@pytest.mark.parametrize(
    "name", ["binary_densemv", "binary_densemm", "ell_binary_matvec", "binary_fcnmm"]
)
def test_brainevent_products_become_the_products_they_stand_for(name: str, transpose: bool) -> None:
    """`event_products_as_ops`: each brainevent event-driven product in a jaxpr is
    replaced by the product it stands for, with the same value on 0 / 1 spikes (also
    boolean ones) and the same forward-mode derivatives in the weights and the spikes
    as brainevent's own rules (its pure-JAX kernels are the oracle). A fixed-connection
    product becomes an `etrax.ops.sparse_matmul` when its indices are constants of
    the jaxpr, and a dense product when they are an input; a jaxpr without such a
    product is returned as it is."""
    from etrax._compat import eval_jaxpr
    from etrax.compiler._jaxpr import event_products_as_ops, inline_calls

    fn, (weights, spikes) = _event_call(name, transpose)
    fixed = not name.startswith("binary_dense")
    indices = jnp.asarray(_INDICES)
    for constant in (True, False):
        if constant:  # the indices a constant of the jaxpr, as brainstate's layers hold them

            def f(w: Array, s: Array, i: Array) -> Array:
                out: Array = fn(w, s, indices)
                return out

        else:
            f = fn
        closed = inline_calls(jax.make_jaxpr(f)(weights, spikes, indices))
        assert name in [e.primitive.name for e in closed.jaxpr.eqns]
        converted = event_products_as_ops(closed)
        names = [e.primitive.name for e in converted.jaxpr.eqns]
        assert name not in names, names
        assert ("etp_sparse_matmul" in names) is (fixed and constant), names

        def run(w: Array, s: Array, c: Any = converted) -> Array:
            out: Array = eval_jaxpr(c.jaxpr, c.consts, w, s, indices)[0]
            return out

        want = f(weights, spikes, indices)
        np.testing.assert_allclose(run(weights, spikes), want, rtol=1e-12, atol=1e-12)
        dw, ds = jax.random.normal(jax.random.key(5), weights.shape), 0.3 * spikes + 0.1
        for tangents in ((dw, jnp.zeros_like(spikes)), (jnp.zeros_like(weights), ds)):
            _, got = jax.jvp(run, (weights, spikes), tangents)
            _, ref = jax.jvp(functools.partial(f, i=indices), (weights, spikes), tangents)
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
        boolean = spikes.astype(bool)
        closed_bool = inline_calls(jax.make_jaxpr(f)(weights, boolean, indices))
        conv_bool = event_products_as_ops(closed_bool)
        got_bool = eval_jaxpr(conv_bool.jaxpr, conv_bool.consts, weights, boolean, indices)[0]
        np.testing.assert_allclose(got_bool, want, rtol=1e-12, atol=1e-12)
    plain = jax.make_jaxpr(lambda w, s: s @ w)(jnp.ones((3, 2)), jnp.ones(3))
    assert event_products_as_ops(plain) is plain


@pytest.mark.parametrize("transpose", [True, False], ids=["scatter", "gather"])
@pytest.mark.parametrize("batched", [False, True], ids=["fcnmv", "fcnmm"])
def test_brainevents_jitted_fixed_products_become_sparse_products(
    transpose: bool, batched: bool
) -> None:
    """`inline_calls(..., products=True)`: brainevent's jitted float products over fixed
    connections (``fcnmv`` / ``fcnmm``, plain JAX inside a `jit` named after them)
    become an `etrax.ops.sparse_matmul` with the body's values and forward-mode
    derivatives in the weights and the data; without ``products``, or when the body
    under that name computes something else (a changed release; checked on random
    values at compile time), the body is inlined as it is."""
    import brainevent

    from etrax._compat import eval_jaxpr
    from etrax.compiler._jaxpr import inline_calls

    indices = jnp.asarray(_INDICES)
    n = _PRE if transpose else _POST
    key1, key2 = jax.random.split(jax.random.key(6))
    weights = jax.random.normal(key1, (_PRE, _CONN))
    data = jax.random.normal(key2, (n, _BATCH) if batched else (n,))
    call = brainevent.fcnmm if batched else brainevent.fcnmv

    def f(w: Array, x: Array) -> Array:
        out: Array = call(w, indices, x, shape=(_PRE, _POST), transpose=transpose)
        return out

    def other(w: Array, i: Array, x: Array) -> Array:  # the same name, another product
        rows = jnp.broadcast_to(jnp.arange(_PRE)[:, None], i.shape)
        dense = jnp.zeros((_PRE, _POST)).at[rows, i].add(2.0 * w)  # twice the weights
        out: Array = (x.T @ (dense if transpose else dense.T)).T
        return out

    other.__name__ = f"brainevent.{call.__name__}"
    changed = jax.jit(other)

    def g(w: Array, x: Array) -> Array:
        out: Array = changed(w, indices, x)
        return out

    closed = jax.make_jaxpr(f)(weights, data)
    converted = inline_calls(closed, products=True)
    names = [e.primitive.name for e in converted.jaxpr.eqns]
    assert "etp_sparse_matmul" in names and "scatter-add" not in names, names
    assert "etp_sparse_matmul" not in [e.primitive.name for e in inline_calls(closed).jaxpr.eqns]

    def run(w: Array, x: Array) -> Array:
        out: Array = eval_jaxpr(converted.jaxpr, converted.consts, w, x)[0]
        return out

    np.testing.assert_allclose(run(weights, data), f(weights, data), rtol=1e-12, atol=1e-12)
    dw, dx = jax.random.normal(jax.random.key(7), weights.shape), 0.3 * data
    for tangents in ((dw, jnp.zeros_like(data)), (jnp.zeros_like(weights), dx)):
        _, got = jax.jvp(run, (weights, data), tangents)
        _, ref = jax.jvp(f, (weights, data), tangents)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    kept = inline_calls(jax.make_jaxpr(g)(weights, data), products=True)
    assert "etp_sparse_matmul" not in [e.primitive.name for e in kept.jaxpr.eqns]
