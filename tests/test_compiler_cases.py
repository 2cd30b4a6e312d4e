"""Corner cases of grouping and relation discovery, including the known defects of
the reference system that etrax fixes (no dependence on jaxpr shape, several
hidden states per equation, relations into stacked states, plain weight uses)."""

from collections.abc import Callable
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax
from etrax import DiagnosticKind as K
from etrax.compiler import _normalise

from .models import LeakyLinear, build
from .oracles import bptt_grads


def _compile(model: brainstate.nn.Module, x: ArrayLike) -> etrax.ETraceGraph:
    brainstate.nn.init_all_states(model)
    return etrax.compile_etrace_graph(model, x)


class VA(brainstate.nn.Module):
    """``V`` and adaptation ``a``; `first` chooses how the jaxpr happens to be written."""

    def __init__(self, first: bool, fused: bool = False) -> None:
        super().__init__()
        self.first = first
        self.fused = fused
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.V = brainstate.HiddenState(jnp.zeros(4))
        self.a = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        if self.fused:
            v = self.V.value - self.a.value + self.fc(x)  # one equation reads V and a
        elif self.first:
            v = self.V.value * 0.9  # V^t produced by the first equation reading V
        else:
            v = self.V.value * 0.9 + 0.0 * self.fc(x)
        a = 0.8 * self.a.value + 0.1 * v
        self.V.value = v
        self.a.value = a
        return v + self.fc(x) if self.first else v


@pytest.mark.parametrize(("first", "fused"), [(True, False), (False, False), (False, True)])
def test_grouping_does_not_depend_on_jaxpr_shape(first: bool, fused: bool) -> None:
    graph = _compile(VA(first, fused), jnp.ones(3))
    assert [g.hidden_paths for g in graph.hidden_groups] == [(("V",), ("a",))]
    assert graph.hidden_groups[0].is_diagonal_recurrence


class JitInside(brainstate.nn.Module):
    def __init__(self, use_jit: bool) -> None:
        super().__init__()
        self.use_jit = use_jit
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        def inner(h: Array, y: Array) -> Array:
            return jnp.tanh(0.5 * h + y)

        fn = jax.jit(inner) if self.use_jit else inner
        h = fn(self.h.value, self.fc(x))
        self.h.value = h
        return h


def test_user_jit_is_inlined() -> None:
    a = _compile(JitInside(True), jnp.ones(3))
    b = _compile(JitInside(False), jnp.ones(3))
    assert all(e.primitive.name != "jit" for e in a.module_info.jaxpr.eqns)
    assert [g.hidden_paths for g in a.hidden_groups] == [g.hidden_paths for g in b.hidden_groups]
    assert [r.kind for r in a.diagnostics] == [r.kind for r in b.diagnostics]
    assert a.hidden_groups[0].transition.primitives == b.hidden_groups[0].transition.primitives


class StackedDirect(brainstate.nn.Module):
    """A `HiddenGroupState` fed directly by ``y`` of shape varshape."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.st = brainstate.HiddenGroupState(jnp.zeros((4, 2)))

    def update(self, x: ArrayLike) -> Array:
        st = self.st.value
        y = self.fc(x)
        self.st.value = st.at[..., 0].set(0.9 * st[..., 0] + y).at[..., 1].multiply(0.5)
        return y


def test_relation_into_stacked_hidden_state() -> None:
    graph = _compile(StackedDirect(), jnp.ones(3))
    (rel,) = graph.hidden_param_op_relations
    assert rel.hidden_groups == (0,)
    assert rel.tails[0].is_diagonal
    assert graph.hidden_groups[0].num_state == 2


class Sliced(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(2))

    def update(self, x: ArrayLike) -> Array:
        h = 0.5 * self.h.value + self.fc(x)[:2]
        self.h.value = h
        return h


def test_shape_mismatch_is_excluded_with_a_record() -> None:
    graph = _compile(Sliced(), jnp.ones(3))
    assert graph.hidden_param_op_relations == ()
    (rec,) = graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    assert rec.weight_path == ("fc", "weight")
    assert graph.weight_rules()[("fc", "weight")].reason is K.RELATION_EXCLUDED_SHAPE_MISMATCH
    assert "HiddenState of its own" not in rec.message  # y is wider than the state


class Populations(brainstate.nn.Module):
    """Two populations fed by one product cut in two, leaky at different rates: kept
    in one concatenated state, or (``apart=True``) in one HiddenState each."""

    def __init__(self, apart: bool) -> None:
        super().__init__()
        self.apart = apart
        self.W = brainstate.ParamState(0.5 * jax.random.normal(jax.random.key(2), (3, 6)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        if self.apart:
            self.e = brainstate.HiddenState(jnp.zeros(4))
            self.i = brainstate.HiddenState(jnp.zeros(2))
        else:
            self.v = brainstate.HiddenState(jnp.zeros(6))

    def update(self, x: ArrayLike) -> Array:
        to_e, to_i = jnp.split(jnp.asarray(x) @ self.W.value, [4], axis=-1)
        e, i = (self.e.value, self.i.value) if self.apart else jnp.split(self.v.value, [4])
        e, i = 0.9 * e + jnp.tanh(to_e), 0.7 * i + jnp.tanh(to_i)
        if self.apart:
            self.e.value, self.i.value = e, i
        else:
            self.v.value = jnp.concatenate([e, i])
        return jnp.concatenate([e, i])


def test_parts_of_a_concatenated_state_say_how_to_trace_them() -> None:
    """A product feeding part of a state's last axis (populations concatenated into one
    state) is not traced, and the record says to give each part a HiddenState of its
    own; done so, the weight is traced and D-RTRL equals BPTT over the sequence."""
    whole = _compile(Populations(apart=False), jnp.ones(3))
    assert whole.weight_rules()[("W",)].rule is etrax.WeightRule.INSTANTANEOUS
    records = whole.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    assert records and all("HiddenState of its own" in r.message for r in records)
    model = Populations(apart=True)
    graph = _compile(model, jnp.ones(3))
    assert graph.weight_rules()[("W",)].rule is etrax.WeightRule.TRACED
    xs = jax.random.normal(jax.random.key(3), (5, 3))
    ys = jax.random.normal(jax.random.key(4), (5, 6))
    state = etrax.state_of(graph)

    def sq(y: Array, t: Array) -> Array:
        return jnp.sum((y - t) ** 2)

    full = bptt_grads(model, state, xs, ys, sq)
    algo = etrax.DRTRL()
    got, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ys, sq)
    np.testing.assert_allclose(np.asarray(got[("W",)]), np.asarray(full[("W",)]), atol=1e-10)


class PlainUse(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.win = brainstate.ParamState(jnp.ones((3, 4)))
        self.fc = etrax.nn.Linear(3, 4)
        self.unused = brainstate.ParamState(jnp.ones(2))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        h = 0.5 * self.h.value + jnp.asarray(x) @ self.win.value + self.fc(x)
        self.h.value = h
        return h


def test_plain_weight_use_and_unused_weight_are_reported() -> None:
    model = PlainUse()
    recognised = _compile(model, jnp.ones(3)).weight_rules()
    assert recognised[("win",)].rule is etrax.WeightRule.TRACED
    graph = etrax.compile_etrace_graph(
        model, jnp.ones(3), policy=etrax.CompilePolicy(recognise_weight_ops=False)
    )
    plain = graph.explain(kind=K.WEIGHT_PLAIN_USE)
    assert [r.weight_path for r in plain] == [("win",)]
    assert plain[0].primitive == "dot_general"
    rules = graph.weight_rules()
    assert rules[("win",)].rule is etrax.WeightRule.INSTANTANEOUS
    assert rules[("win",)].reason is K.WEIGHT_PLAIN_USE
    assert rules[("unused",)].rule is etrax.WeightRule.UNUSED
    assert rules[("fc", "weight")].rule is etrax.WeightRule.TRACED
    assert not rules[("fc", "weight")].plain_use
    excluded = dict(graph.report().excluded_weights)
    assert set(excluded) == {("win",), ("unused",)}


class Processed(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = brainstate.ParamState(jnp.ones((3, 4)))
        self.w2 = brainstate.ParamState(0.5 * jnp.ones((3, 4)))
        self.mask = jnp.ones((3, 4)).at[0, 0].set(0.0)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        w = jnp.abs(self.w1.value + self.w2.value) * self.mask
        h = 0.5 * self.h.value + etrax.matmul(x, w, jnp.ones(4))
        self.h.value = h
        return h


def test_weight_program_resolves_every_parameter() -> None:
    graph = _compile(Processed(), jnp.ones(3))
    (rel,) = graph.hidden_param_op_relations
    (weight,) = rel.trainables  # the constant bias is dropped
    assert weight.key == "weight"
    assert weight.paths == (("w1",), ("w2",))
    assert set(weight.processing) >= {"add", "abs", "mul"}
    assert graph.explain(kind=K.TRAINABLE_INVAR_NOT_PARAMSTATE)
    assert not graph.explain(kind=K.WEIGHT_PLAIN_USE)
    rules = graph.weight_rules()
    assert rules[("w1",)].rule is rules[("w2",)].rule is etrax.WeightRule.TRACED


class ShapeConflict(brainstate.nn.Module):
    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.a = brainstate.HiddenState(jnp.zeros(4))
        self.b = brainstate.HiddenState(jnp.zeros(3))

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def update(self, x: ArrayLike) -> Array:
        a = 0.5 * self.a.value + self.fc(x)
        b = 0.5 * self.b.value + jnp.sum(a)
        self.a.value = a
        self.b.value = b
        return b


def test_coupled_states_of_different_shapes_are_split() -> None:
    graph = _compile(ShapeConflict(), jnp.ones(3))
    assert [g.hidden_paths for g in graph.hidden_groups] == [(("a",),), (("b",),)]
    assert graph.explain(kind=K.GROUP_VARSHAPE_CONFLICT)


class InCond(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h: Array = jax.lax.cond(x[0] > 0, lambda v: self.fc(v), lambda v: jnp.zeros(4), x)
        self.h.value = 0.5 * self.h.value + h
        return h


def test_etp_op_inside_control_flow_is_refused_without_if_conversion() -> None:
    model = InCond()
    brainstate.nn.init_all_states(model)
    off = etrax.CompilePolicy(if_convert=False)
    with pytest.raises(etrax.NotSupportedError, match=r"jnp\.where") as info:
        etrax.compile_etrace_graph(model, jnp.ones(3), policy=off)
    assert info.value.records[-1].kind is K.PRIMITIVE_INSIDE_CONTROL_FLOW


class IntHidden(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))
        self.count = brainstate.HiddenState(jnp.zeros((), jnp.int32))
        self.t = brainstate.ShortTermState(jnp.zeros(()))

    def update(self, x: ArrayLike) -> Array:
        h = 0.5 * self.h.value + self.fc(x)
        self.h.value = h
        self.count.value = self.count.value + 1
        self.t.value = self.t.value + 1.0
        return h


def test_non_float_hidden_and_dynamic_states() -> None:
    graph = _compile(IntHidden(), jnp.ones(3))
    assert graph.module_info.hidden_paths == (("h",),)
    assert graph.explain(kind=K.HIDDEN_STATE_NOT_FLOAT)
    assert ("t",) in graph.report().dynamic_states
    # the integer HiddenState is carried untraced, and said to be one (not "not a
    # HiddenState"); the report points at the reason
    dynamic = {r.hidden_paths[0]: r.message for r in graph.explain(kind=K.DYNAMIC_STATE)}
    assert "cannot be traced" in dynamic[("count",)]
    assert "is not a HiddenState" in dynamic[("t",)]
    assert "see hidden_state_not_float" in str(graph.report())


def test_a_model_whose_only_hidden_state_is_an_integer_is_refused_with_the_reason() -> None:
    class Counter(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(jnp.ones((3, 4)))
            self.h = brainstate.HiddenState(jnp.zeros((4,), jnp.int32))

        def update(self, x: Array) -> Array:
            self.h.value = self.h.value + (x @ self.w.value).astype(jnp.int32)
            return self.h.value.astype(x.dtype)

    with pytest.raises(etrax.CompilationError, match=r"\[\('h',\)\] cannot be traced"):
        etrax.compile(Counter(), etrax.DRTRL(), jnp.ones(3))


def test_tied_weight_gives_one_relation_per_call_site() -> None:
    class Tied(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(0.1 * jnp.ones((4, 4)))

        def init_state(self, batch_size: int | None = None, **kw: object) -> None:
            self.h = brainstate.HiddenState(jnp.zeros(4))

        def update(self, x: ArrayLike) -> Array:
            u = etrax.matmul(jnp.asarray(x), self.w.value)
            h = 0.5 * self.h.value + etrax.matmul(jnp.tanh(u), self.w.value) + u
            self.h.value = h
            return h

    graph = _compile(Tied(), jnp.ones(4))
    paths = [r.weight_path for r in graph.hidden_param_op_relations]
    assert paths == [("w",), ("w",)]
    assert graph.weight_rules()[("w",)].relations == (0, 1)


def test_leaky_linear_batched_shapes() -> None:
    model, x = build(LeakyLinear, 3, 4, batch=2)
    graph = etrax.compile_etrace_graph(model, x)
    (rel,) = graph.hidden_param_op_relations
    assert rel.tails[0].broadcast_ndim == 0


def test_unbatched_elementwise_weight_broadcasts_over_batch() -> None:
    from .models import ElementwiseDecay

    model, x = build(ElementwiseDecay, 3, 4, batch=2)
    graph = etrax.compile_etrace_graph(model, x)
    tau = graph.hidden_param_op_relations[0]
    assert tau.weight_path == ("tau",)
    assert tau.x_var is None
    assert tau.tails[0].broadcast_ndim == 1


class ConstantRecurrence(brainstate.nn.Module):
    """``h ← 0.7 tanh(h M) + tanh(x W)`` with a fixed (not learned) matrix `M`."""

    def __init__(self, matrix: Any, as_state: bool) -> None:
        super().__init__()
        self.W = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(1), (3, 4)))
        self.M = brainstate.State(matrix) if as_state else matrix
        self.as_state = as_state

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        m: Any = self.M.value if self.as_state else self.M
        h = 0.7 * jnp.tanh(self.h.value @ m) + jnp.tanh(x @ self.W.value)
        self.h.value = h
        return h


@pytest.mark.parametrize("as_state", [False, True], ids=["constant", "state"])
def test_a_recurrent_product_with_a_constant_matrix_is_reported(as_state: bool) -> None:
    """A hidden-to-hidden product with a matrix no ParamState feeds is a boundary
    (left out of D) and says so with a warning naming the hidden state; the same
    product with a ParamState matrix is a plain use of that weight instead."""
    model = ConstantRecurrence(jnp.diag(jnp.array([0.5, 0.6, 0.7, 0.8])), as_state)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    (rec,) = graph.explain(kind=etrax.DiagnosticKind.RECURRENT_CONSTANT_PRODUCT)
    assert rec.level is etrax.DiagnosticLevel.WARNING and rec.hidden_paths == (("h",),)
    assert "approximate for T > 1" in rec.message


def test_a_recurrent_product_with_a_weight_is_not_reported_as_constant() -> None:
    model = etrax.nn.ValinaRNNCell(3, 4)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert not graph.explain(kind=etrax.DiagnosticKind.RECURRENT_CONSTANT_PRODUCT)
    plain = brainstate.nn.ValinaRNNCell(3, 4)
    brainstate.nn.init_all_states(plain)
    graph = etrax.compile_etrace_graph(plain, jnp.zeros(3))
    assert not graph.explain(kind=etrax.DiagnosticKind.RECURRENT_CONSTANT_PRODUCT)


class LongLoop(brainstate.nn.Module):
    """Every weight is read inside a 20-step ``fori_loop`` (sub-steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.W = brainstate.ParamState(0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 4)))

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        def sub(_: Any, h: Any) -> Any:
            return 0.9 * h + 0.1 * jnp.tanh(h @ self.W.value + x)

        h = jax.lax.fori_loop(0, 20, sub, self.h.value)
        self.h.value = h
        return h


def _sum(y: Array, t: Array) -> Array:
    return jnp.sum(y - t)


def test_no_relations_because_of_a_whole_loop_says_to_unroll_it() -> None:
    """A loop longer than the unroll limit keeps its weights untraced; an online rule
    that then has nothing to trace says how to unroll it, and with the limit raised
    the weight is traced."""
    model = LongLoop()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(4))
    assert graph.explain(kind=K.LOOP_KEPT_WHOLE)
    state = etrax.state_of(graph)
    rule = etrax.DRTRL()
    with pytest.raises(etrax.CompilationError, match="unroll_limit"):
        etrax.online_grad(
            graph, rule, state, rule.init(graph, state), jnp.ones((2, 4)), jnp.ones((2, 4)), _sum
        )
    unrolled = etrax.compile_etrace_graph(
        model, jnp.zeros(4), policy=etrax.CompilePolicy(unroll_limit=32)
    )
    assert unrolled.hidden_param_op_relations


class PerHead(brainstate.nn.Module):
    """``h ← h/2 + tanh(x_g W_g + h_g U_g)`` per head `g`, written as `jnp.einsum`
    (data first or weight first) or as `jax.vmap` of ``x @ W`` over the heads."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.W = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(1), (3, 2, 4)))
        self.U = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(2), (3, 4, 4)))

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        shape = (3, 4) if batch_size is None else (batch_size, 3, 4)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def _product(self, v: Any, w: Any) -> Any:
        if self.form == "einsum":
            return jnp.einsum("...gi,gio->...go", v, w)
        if self.form == "weight_first":
            return jnp.einsum("gio,...gi->...go", w, v)
        return jax.vmap(lambda a, b: a @ b, in_axes=(-2, 0), out_axes=-2)(v, w)

    def update(self, x: Any) -> Any:
        a = self._product(x, self.W.value) + self._product(self.h.value, self.U.value)
        self.h.value = 0.5 * self.h.value + jnp.tanh(a)
        return self.h.value


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
@pytest.mark.parametrize("form", ["einsum", "weight_first", "vmap"])
def test_per_head_weights_are_recognised_as_grouped_matmul(form: str, batch: int | None) -> None:
    """A product with one batch dimension on each side (per-head weights) becomes
    `etrax.grouped_matmul`: both weights are traced, and at T = 1 every rule equals
    BPTT through brainstate's own ``update``."""
    model = PerHead(form)
    brainstate.nn.init_all_states(model, batch_size=batch)
    shape = (3, 2) if batch is None else (batch, 3, 2)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(shape))
    assert {p: s.rule for p, s in graph.weight_rules().items()} == {
        ("W",): etrax.WeightRule.TRACED,
        ("U",): etrax.WeightRule.TRACED,
    }
    notes = graph.explain(kind=K.WEIGHT_OP_RECOGNISED)
    assert len(notes) == 2 and all("grouped_matmul" in r.message for r in notes)
    state = etrax.state_of(graph)
    h = jax.random.normal(jax.random.PRNGKey(5), state.hidden[("h",)].shape)
    state = state.replace_hidden({("h",): h})
    xs = jax.random.normal(jax.random.PRNGKey(3), (1, *shape))
    ts = jax.random.normal(jax.random.PRNGKey(4), (1, *h.shape))
    want = bptt_grads(model, state, xs, ts, _squared)
    rules: list[etrax.OnlineAlgorithm[Any]] = [etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)]
    for rule in rules:
        got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
        for path in want:
            g = got.grads[path]
            assert isinstance(g, jax.Array)
            np.testing.assert_allclose(g, want[path], rtol=1e-10, atol=1e-12)


class SharedInputHeads(PerHead):
    """`PerHead` with one input for every head: ``einsum('...i,gio->...go', x, W)``
    (``"shared"``), the same with the weight first (``"shared_weight_first"``), or with
    the input broadcast to the heads by hand (``"broadcast"``, a `PerHead` product)."""

    def update(self, x: Any) -> Any:
        w = self.W.value
        if self.form == "shared":
            a = jnp.einsum("...i,gio->...go", x, w)
        elif self.form == "shared_weight_first":
            a = jnp.einsum("gio,...i->...go", w, x)
        else:
            xb = jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], 3, x.shape[-1]))
            a = jnp.einsum("...gi,gio->...go", xb, w)
        a = a + jnp.einsum("...gi,gio->...go", self.h.value, self.U.value)
        self.h.value = 0.5 * self.h.value + jnp.tanh(a)
        return self.h.value


def _wholly_traced_heads(
    model: brainstate.nn.Module, reference: brainstate.nn.Module, batch: int | None
) -> tuple[etrax.ETraceGraph, tuple[int, ...]]:
    """`model` and `reference` initialised (2 inputs), and `model`'s graph, whose two
    weights are traced; with the input's shape."""
    brainstate.nn.init_all_states(model, batch_size=batch)
    brainstate.nn.init_all_states(reference, batch_size=batch)
    shape = (2,) if batch is None else (batch, 2)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(shape))
    assert {p: s.rule for p, s in graph.weight_rules().items()} == {
        ("W",): etrax.WeightRule.TRACED,
        ("U",): etrax.WeightRule.TRACED,
    }
    return graph, shape


def _learns_like(
    model: brainstate.nn.Module,
    graph: etrax.ETraceGraph,
    shape: tuple[int, ...],
    reference: brainstate.nn.Module,
    steps: int,
    every_rule: bool = False,
    layout: Callable[[Array], Array] = lambda a: a,
) -> None:
    """From a random hidden state ``h``: every rule on `graph` equals BPTT through
    `model`'s own ``update`` at T = 1, and over `steps` steps D-RTRL (every rule with
    `every_rule`) gives what it gives on `reference`'s graph, whose hidden state and
    targets are `layout` of `model`'s."""
    state = etrax.state_of(graph)
    h = jax.random.normal(jax.random.PRNGKey(5), state.hidden[("h",)].shape)
    state = state.replace_hidden({("h",): h})
    xs = jax.random.normal(jax.random.PRNGKey(3), (steps, *shape))
    ts = jax.random.normal(jax.random.PRNGKey(4), (steps, *h.shape))
    want = bptt_grads(model, state, xs[:1], ts[:1], _squared)
    ref_graph = etrax.compile_etrace_graph(reference, jnp.zeros(shape))
    ref_state = etrax.state_of(ref_graph).replace_hidden({("h",): layout(h)})
    rules: list[etrax.OnlineAlgorithm[Any]] = [etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)]
    for n, rule in enumerate(rules):
        one = etrax.online_grad(
            graph, rule, state, rule.init(graph, state), *(xs[:1], ts[:1]), _squared
        )
        for path in want:
            _tree_close(one.grads[path], want[path])
        if n and not every_rule:
            continue
        got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
        ref = etrax.online_grad(
            ref_graph, rule, ref_state, rule.init(ref_graph, ref_state), xs, layout(ts), _squared
        )
        for path in want:
            _tree_close(got.grads[path], ref.grads[path])


def _tree_close(got: Any, want: Any) -> None:
    """Every leaf of `got` equals `want`'s to float64 precision (a parameter's gradient
    is an array, or a dict of them for an `etrax.nn` layer)."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
@pytest.mark.parametrize("form", ["shared", "shared_weight_first"])
def test_an_input_product_onto_heads_is_a_grouped_matmul(form: str, batch: int | None) -> None:
    """``einsum('...i,gio->...go', x, W)``, one input mapped onto every head of a
    ``(heads, features)`` state, becomes `etrax.grouped_matmul` with the input read
    by every head, whose output lines up with the state: both weights are traced,
    every rule equals BPTT at T = 1, and over a sequence D-RTRL learns exactly as
    with the input broadcast to the heads by hand. Before, ``W`` was a plain use
    (two free weight axes), learned from its instantaneous gradient only."""
    model, by_hand = SharedInputHeads(form), SharedInputHeads("broadcast")
    graph, shape = _wholly_traced_heads(model, by_hand, batch)
    (note,) = [r for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED) if r.weight_path == ("W",)]
    assert "grouped_matmul (the data read by every head)" in note.message, note.message
    _learns_like(model, graph, shape, by_hand, steps=6)


class MergedHeads(PerHead):
    """`SharedInputHeads`'s ``"shared"`` model with its state kept flat, ``(12,)`` or
    ``(batch, 12)``: each product's heads merged into the state's one axis right after
    it (``"each"``), their sum's (``"sum"``), or those of their sum less its mean per
    head (``"centred"``)."""

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(
            jnp.zeros((12,) if batch_size is None else (batch_size, 12))
        )

    def update(self, x: Any) -> Any:
        h = self.h.value
        lead = h.shape[:-1]
        a = jnp.einsum("...i,gio->...go", x, self.W.value)
        b = jnp.einsum("...gi,gio->...go", h.reshape(*lead, 3, 4), self.U.value)
        if self.form == "each":
            a = a.reshape(*lead, 12) + b.reshape(*lead, 12)
        elif self.form == "sum":
            a = (a + b).reshape(*lead, 12)
        else:
            c = a + b
            a = (c - jnp.mean(c, axis=-1, keepdims=True)).reshape(*lead, 12)
        self.h.value = 0.5 * h + jnp.tanh(a)
        return self.h.value


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
@pytest.mark.parametrize("form", ["each", "sum"])
def test_per_head_products_whose_heads_are_merged_into_a_flat_state_are_traced(
    form: str, batch: int | None
) -> None:
    """Each product's ``(3, 4)`` heads merged into a flat ``(12,)`` state right after it
    (``reshape``, after the transpose that lays out a batched one), or after the
    products' sum (the merge then moved onto each product, `merge_heads_first`): each
    product and its merge are one `etrax.grouped_matmul(..., merge_groups=True)`, whose
    output lines up with the state. Both weights are traced, every rule equals BPTT at
    T = 1, and over a sequence each rule learns exactly as on the ``(3, 4)`` state.
    Before, the products' outputs did not line up with the state and neither weight was
    traced."""
    model, heads = MergedHeads(form), SharedInputHeads("shared")
    graph, shape = _wholly_traced_heads(model, heads, batch)
    for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED):
        assert "heads merged into one axis by the reshape that follows" in r.message, r.message
    _learns_like(
        model, graph, shape, heads, steps=5, every_rule=True,
        layout=lambda a: a.reshape(*a.shape[:-1], 3, 4),
    )  # fmt: skip


def test_products_whose_heads_are_merged_after_a_norm_say_how_to_trace_them() -> None:
    """The negative control: the heads merged only after the products' sum less its
    mean per head, which is not element-wise, so no merge moves onto the products and
    neither product's ``(3, 4)`` output lines up with the ``(12,)`` state. Neither
    weight is traced, the online rules refuse the model with etrax's error, and the
    records say how to get the products traced."""
    model = MergedHeads("centred")
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(2))
    for path in (("W",), ("U",)):
        assert graph.weight_rules()[path].reason is K.RELATION_EXCLUDED_SHAPE_MISMATCH
    records = graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    assert len(records) == 2
    for r in records:
        assert "in another shape" in r.message and "((3, 4) with heads)" in r.message, r.message
    state, rule = etrax.state_of(graph), etrax.DRTRL()
    xs, ts = jnp.ones((1, 2)), jnp.ones((1, 12))
    with pytest.raises(etrax.CompilationError, match="no relations"):
        etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)


class StackedGates(brainstate.nn.Module):
    """A GRU whose gate weights are stacked on a leading axis, ``W (3, in, n)`` and
    ``U (3, n, n)``: ``gx = einsum('...i,gio->g...o', x, W)`` and the same for ``h``,
    each gate read as ``gx[k]`` (``"stacked"``); the same model with each gate's
    product written on its own, ``x @ W[k]`` (``"indexed"``); or, the negative
    control, with ``gx``'s first two gates taken together, ``gx[:2]`` (``"pairs"``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.W = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(7), (3, 2, 4)))
        self.U = brainstate.ParamState(0.4 * jax.random.normal(jax.random.PRNGKey(8), (3, 4, 4)))

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((4,) if batch_size is None else (batch_size, 4)))

    def update(self, x: Any) -> Any:
        h, w, u = self.h.value, self.W.value, self.U.value
        if self.form == "indexed":
            gx = [x @ w[k] for k in range(3)]
            gh = [h @ u[k] for k in range(3)]
        else:
            stacked_x = jnp.einsum("...i,gio->g...o", x, w)
            gx = [stacked_x[k] for k in range(3)]
            if self.form == "pairs":
                first_two = stacked_x[:2]
                gx = [first_two[0], first_two[1], stacked_x[2]]
            stacked_h = jnp.einsum("...i,gio->g...o", h, u)
            gh = [stacked_h[k] for k in range(3)]
        r = jax.nn.sigmoid(gx[0] + gh[0])
        z = jax.nn.sigmoid(gx[1] + gh[1])
        self.h.value = z * h + (1 - z) * jnp.tanh(gx[2] + r * gh[2])
        return self.h.value


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
def test_gates_stacked_on_a_leading_axis_are_traced(batch: int | None) -> None:
    """A product onto stacked gates, ``einsum('...i,gio->g...o', x, W)``, read one
    gate at a time (``gates[k]``) is computed one gate at a time, ``x @ W[k]``
    (`split_products_read_head_by_head`): both weights are traced, every rule equals
    BPTT at T = 1, and over a sequence D-RTRL learns exactly as the model written gate
    by gate. Before, each product's ``(3, [batch,] 4)`` output lined up with no state
    and both weights learned from their instantaneous gradient only."""
    model, by_gate = StackedGates("stacked"), StackedGates("indexed")
    graph, shape = _wholly_traced_heads(model, by_gate, batch)
    _learns_like(model, graph, shape, by_gate, steps=5)


def test_stacked_gates_read_two_at_a_time_are_not_split() -> None:
    """The negative control: ``gx[:2]`` reads two gates of the input product at once,
    so that product is kept whole; its ``(3, 4)`` output lines up with no state and
    ``W`` learns from its instantaneous gradient (``relation_excluded_shape_mismatch``),
    while ``U``'s product, read one gate at a time, is split and traced. Every rule
    still equals BPTT at T = 1."""
    model = StackedGates("pairs")
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(2))
    rules_of = graph.weight_rules()
    assert rules_of[("W",)].reason is K.RELATION_EXCLUDED_SHAPE_MISMATCH
    assert rules_of[("U",)].rule is etrax.WeightRule.TRACED
    state = etrax.state_of(graph)
    xs, ts = jnp.ones((1, 2)), jnp.ones((1, 4))
    want = bptt_grads(model, state, xs, ts, _squared)
    rules: list[etrax.OnlineAlgorithm[Any]] = [etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)]
    for rule in rules:
        got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
        for path in want:
            np.testing.assert_allclose(
                np.asarray(got.grads[path]), want[path], rtol=1e-10, atol=1e-12
            )


def _squared(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


class SelfProduct(LeakyLinear):
    """``h ← h/2 + 0.3 tanh(h (h · h)) + fc(x)``: a product of hidden values with each
    other (a `dot_general` with the hidden state on both sides)."""

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        self.h.value = 0.5 * h + 0.3 * jnp.tanh(h * jnp.dot(h, h)) + self.fc(x)
        return self.h.value


def test_a_product_of_hidden_values_with_each_other_is_reported() -> None:
    """``h · h`` mixes positions without a weight: a boundary left out of D, with a
    `RECURRENT_CONSTANT_PRODUCT` warning (never a silently wrong D)."""
    model, x = build(SelfProduct, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    (rec,) = graph.explain(kind=K.RECURRENT_CONSTANT_PRODUCT)
    assert "with each other" in rec.message and rec.hidden_paths == (("h",),)


class Refractory(brainstate.nn.Module):
    """A LIF with a refractory counter state, a hard threshold and a detached reset:
    the step computes boolean values that reach its outputs (``v + s``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.V = brainstate.HiddenState(jnp.array([0.9, 0.2, 1.5, 0.4]))
        self.r = brainstate.HiddenState(jnp.array([0.0, 2.0, 0.0, 1.0]))

    def update(self, x: Any) -> Any:
        v = jnp.where(self.r.value > 0, self.V.value, 0.9 * self.V.value + self.fc(x))
        s = (v > 1.0).astype(v.dtype)
        v = v - jax.lax.stop_gradient(s)
        self.V.value = v
        self.r.value = jnp.where(s > 0, 2.0, jnp.maximum(self.r.value - 1.0, 0.0))
        return v + s


def _exact_at_t1(model: brainstate.nn.Module, loss: Any) -> tuple[Any, Any, Array, Array]:
    """Compile `model` (3 inputs, 4 outputs), check that D-RTRL, pp-prop and e-prop
    equal BPTT through its own update at T = 1; returns the graph, state and data."""
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3))
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(3), (1, 3))
    ts = jax.random.normal(jax.random.PRNGKey(4), (1, 4))
    want = bptt_grads(model, state, xs, ts, loss)
    rules: list[etrax.OnlineAlgorithm[Any]] = [etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)]
    for rule in rules:
        got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, loss)
        for path in want:
            for a, b in zip(
                jax.tree.leaves(got.grads[path]), jax.tree.leaves(want[path]), strict=True
            ):
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    return graph, state, xs, ts


def test_a_refractory_neuron_with_boolean_values_compiles_and_is_exact_at_t1() -> None:
    _exact_at_t1(Refractory(), _squared)


class WithRaster(Refractory):
    """The refractory neuron returning its boolean spike raster and spike count
    beside the membrane readout (the loss reads all three)."""

    def update(self, x: Any) -> Any:
        v = super().update(x)
        raster = self.V.value > 0.5
        return v, raster, jnp.sum(raster)


def _raster_loss(out: tuple[Array, Array, Array], t: Array) -> Array:
    v, raster, count = out  # the counts weigh the loss but carry no gradient
    return jnp.sum(jnp.where(raster, 2.0, 1.0) * (v - t) ** 2) / (1.0 + count.astype(v.dtype))


def test_boolean_and_integer_outputs_are_read_not_differentiated() -> None:
    """A step that also returns a boolean raster and an integer count: every rule
    (random feedback included) runs and equals BPTT through the model at T = 1; the
    non-float outputs take part in the loss but carry no cotangent."""
    graph, state, xs, ts = _exact_at_t1(WithRaster(), _raster_loss)
    random = etrax.EProp(0.5, feedback="random", key=jax.random.key(0))  # runs, not BPTT
    got = etrax.online_grad(graph, random, state, random.init(graph, state), xs, ts, _raster_loss)
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(got.grads))


class MixedDtypes(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(4, jnp.float64))
        self.a = brainstate.HiddenState(jnp.zeros(4, jnp.float32))

    def update(self, x: Any) -> Any:
        v = 0.9 * self.v.value - self.a.value.astype(jnp.float64) + self.fc(x)
        self.a.value = 0.8 * self.a.value + 0.1 * v.astype(jnp.float32)
        self.v.value = v
        return v


def test_one_group_of_two_dtypes_is_refused_at_compile_time() -> None:
    model = MixedDtypes()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.NotSupportedError, match="dtypes differ"):
        etrax.compile_etrace_graph(model, jnp.ones(3))


def _surrogate(v: Array) -> Array:
    """The pseudo-derivative of the spikes below."""
    return 1.0 / (1.0 + 5.0 * jnp.abs(v)) ** 2


def _heaviside(v: Array) -> Array:
    return (v > 0).astype(v.dtype)


@jax.custom_vjp
def _vjp_spike(v: Array) -> Array:
    return _heaviside(v)


def _spike_fwd(v: Array) -> tuple[Array, Array]:
    return _vjp_spike(v), v


def _spike_bwd(v: Array, g: Array) -> tuple[Array]:
    return (g * _surrogate(v),)


_vjp_spike.defvjp(_spike_fwd, _spike_bwd)


def _gradient_spike_rule(v: Array) -> tuple[Array, Callable[[Array], Array]]:
    return _heaviside(v), lambda g: g * _surrogate(v)


_gradient_spike: Callable[[Array], Array] = jax.custom_gradient(_gradient_spike_rule)  # type: ignore[no-untyped-call]  # unannotated in JAX


@jax.custom_jvp
def _jvp_spike(v: Array) -> Array:
    return _heaviside(v)


@_jvp_spike.defjvp
def _jvp_spike_rule(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (v,), (t,) = primals, tangents
    return _jvp_spike(v), _surrogate(v) * t


@jax.custom_vjp
def _sign_spike(v: Array) -> Array:
    return _heaviside(v)


_sign_spike.defvjp(_spike_fwd, lambda v, g: (jnp.sign(g) * _surrogate(v),))

SPIKES: dict[str, Callable[[Array], Array]] = {
    "custom_vjp": _vjp_spike,
    "custom_gradient": _gradient_spike,
    "custom_jvp": _jvp_spike,
    "not_linear": _sign_spike,
}


class Spiking(LeakyLinear):
    """A LIF-like neuron whose spike function is one of `SPIKES`: its reset has its
    gradient stopped, its own spikes feed back with theirs."""

    def __init__(self, n_in: int, n_out: int, spike: str) -> None:
        super().__init__(n_in, n_out)
        self.spike = spike

    def update(self, x: ArrayLike) -> Array:
        spike = SPIKES[self.spike]
        v = 0.9 * self.h.value + self.fc(x)
        self.h.value = v - jax.lax.stop_gradient(spike(v - 1.0)) + 0.1 * spike(v)
        return self.h.value


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
@pytest.mark.parametrize("spike", ["custom_vjp", "custom_gradient"])
def test_a_custom_vjp_surrogate_learns_like_its_custom_jvp_twin(
    spike: str, batch: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A surrogate spike written with `jax.custom_vjp` (or `jax.custom_gradient`) is
    differentiated in forward mode through the transpose of its backward rule: the
    neuron compiles as its `jax.custom_jvp` twin does (the same relations, no
    warning), D-RTRL over five steps equals BPTT through the model's own ``update``
    (the user's backward rule; the model is diagonal, so D-RTRL is exact), and every
    rule learns exactly as on the twin. Without the conversion it is refused."""
    model, x = build(Spiking, 3, 4, spike, batch=batch)
    twin, _ = build(Spiking, 3, 4, "custom_jvp", batch=batch)
    graph = etrax.compile_etrace_graph(model, x)
    twin_graph = etrax.compile_etrace_graph(twin, x)
    assert not [r for r in graph.explain() if r.level is not etrax.DiagnosticLevel.INFO]
    assert len(graph.hidden_param_op_relations) == len(twin_graph.hidden_param_op_relations) > 0
    state = etrax.state_of(graph)
    h = 1.2 * jax.random.normal(jax.random.PRNGKey(5), state.hidden[("h",)].shape)
    state = state.replace_hidden({("h",): h})
    xs = jax.random.normal(jax.random.PRNGKey(3), (5, *x.shape))
    ts = jax.random.normal(jax.random.PRNGKey(4), (5, *h.shape))
    want = bptt_grads(model, state, xs, ts, _squared)
    rule = etrax.DRTRL()
    got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
    for path in want:
        _tree_close(got.grads[path], want[path])
    assert any(float(jnp.max(jnp.abs(g))) > 1e-3 for g in jax.tree.leaves(want))
    _learns_like(model, graph, x.shape, twin, steps=5, every_rule=True)
    # the negative control: the conversion switched off
    monkeypatch.setattr(_normalise, "custom_vjp_as_jvp", lambda closed: closed)
    with pytest.raises(etrax.NotSupportedError, match="custom_vjp function"):
        etrax.compile_etrace_graph(model, x)


def test_a_custom_vjp_whose_backward_rule_is_not_linear_is_refused() -> None:
    """A backward rule that is not linear in the cotangent (``jnp.sign(g)``) has no
    transpose: the spike stays a custom_vjp call, refused at compile time with a
    typed error that says what the rule needs."""
    model, x = build(Spiking, 3, 4, "not_linear")
    with pytest.raises(etrax.NotSupportedError, match="linear in the cotangent"):
        etrax.compile_etrace_graph(model, x)


class SubSteppedSpiking(LeakyLinear):
    """`Spiking`'s neuron in 20 sub-steps of a ``fori_loop``, more than the compiler
    unrolls (`CompilePolicy.unroll_limit`): the loop is kept whole, the spike inside it."""

    def __init__(self, n_in: int, n_out: int, spike: str) -> None:
        super().__init__(n_in, n_out)
        self.spike = spike

    def update(self, x: ArrayLike) -> Array:
        spike, i = SPIKES[self.spike], self.fc(x)

        def sub_step(k: Array, v: Array) -> Array:
            reset = jax.lax.stop_gradient(spike(v - 1.0))
            return 0.95 * v + 0.05 * i - 0.1 * reset + 0.02 * spike(v)

        self.h.value = jax.lax.fori_loop(0, 20, sub_step, self.h.value)
        return self.h.value


@pytest.mark.parametrize("spike", ["custom_vjp", "not_linear"])
def test_a_custom_vjp_surrogate_inside_a_loop_kept_whole(spike: str) -> None:
    """A custom_vjp spike inside a loop the compiler keeps whole is converted there
    too: the transition is diagonal (the body keeps positions apart, its
    `stop_gradient` included: before, a `transition_mixes_positions` warning), so
    D-RTRL over four steps equals BPTT through the model's own ``update``, and every
    rule learns as on the custom_jvp twin. One whose backward rule cannot be
    transposed is refused at compile time with the typed error (before, JAX's
    "can't apply forward-mode autodiff" at the first step)."""
    model, x = build(SubSteppedSpiking, 3, 4, spike)
    if spike == "not_linear":
        with pytest.raises(etrax.NotSupportedError, match="linear in the cotangent"):
            etrax.compile_etrace_graph(model, x)
        return
    graph = etrax.compile_etrace_graph(model, x)
    # no warning: the loop's body (`stop_gradient` included) keeps positions apart
    assert not [r for r in graph.explain() if r.level is not etrax.DiagnosticLevel.INFO]
    state = etrax.state_of(graph).replace_hidden(
        {("h",): jnp.array([0.9, 1.1, 0.2, 1.4], dtype=x.dtype)}
    )
    xs = jax.random.normal(jax.random.PRNGKey(3), (4, *x.shape))
    ts = jax.random.normal(jax.random.PRNGKey(4), (4, 4))
    want = bptt_grads(model, state, xs, ts, _squared)  # diagonal: D-RTRL is exact
    rule = etrax.DRTRL()
    got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
    for path in want:
        _tree_close(got.grads[path], want[path])
    twin, _ = build(SubSteppedSpiking, 3, 4, "custom_jvp")
    _learns_like(model, graph, x.shape, twin, steps=4, every_rule=True)


@jax.custom_vjp
def _vjp_softsign(v: Array) -> Array:
    return v / (1.0 + jnp.abs(v))


_vjp_softsign.defvjp(lambda v: (_vjp_softsign(v), v), lambda v, g: (g / (1.0 + jnp.abs(v)) ** 2,))


@jax.custom_jvp
def _jvp_softsign(v: Array) -> Array:
    return v / (1.0 + jnp.abs(v))


@_jvp_softsign.defjvp
def _jvp_softsign_rule(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (v,), (t,) = primals, tangents
    return _jvp_softsign(v), t / (1.0 + jnp.abs(v)) ** 2


class SoftsignGates(brainstate.nn.Module):
    """``a, b = split(softsign(W [x, h] + c), 2)``, ``h ← h a / 2 + b``: two gates cut
    from one product after a softsign written with `jax.custom_vjp` (``"vjp"``) or
    `jax.custom_jvp` (``"jvp"``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.W = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(1), (7, 8)))
        self.c = brainstate.ParamState(0.1 * jnp.arange(8.0))

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((4,) if batch_size is None else (batch_size, 4)))

    def update(self, x: ArrayLike) -> Array:
        act = _vjp_softsign if self.form == "vjp" else _jvp_softsign
        z = jnp.concatenate([jnp.asarray(x), self.h.value], axis=-1) @ self.W.value
        a, b = jnp.split(act(z + self.c.value), 2, axis=-1)
        self.h.value = 0.5 * self.h.value * a + b
        return self.h.value


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
def test_gates_cut_after_a_custom_vjp_activation_are_traced(batch: int | None) -> None:
    """An element-wise `jax.custom_vjp` function between a product and the cut that
    makes gates of it is evaluated part by part, as a `jax.custom_jvp` one is: the
    product is cut in two and traced, and every rule learns as with the custom_jvp
    twin (and equals BPTT at T = 1)."""
    model, x = build(SoftsignGates, "vjp", batch=batch)
    twin, _ = build(SoftsignGates, "jvp", batch=batch)
    graph = etrax.compile_etrace_graph(model, x)
    assert not graph.explain(kind=K.WEIGHT_PLAIN_USE)
    reads = [
        path
        for r in graph.hidden_param_op_relations
        for t in r.trainables
        for path, _ in t.param_leaves
    ]
    assert reads.count(("W",)) == 2, reads
    _learns_like(model, graph, x.shape, twin, steps=5, every_rule=True)


class DetachedReset(LeakyLinear):
    """A LIF whose reset subtracts this step's spike with its gradient stopped."""

    def update(self, x: ArrayLike) -> Array:
        v = 0.9 * self.h.value + self.fc(x)
        s = etrax.nn.spike(v - 1.0, etrax.nn.ReluGrad())
        self.h.value = v - jax.lax.stop_gradient(s)
        return s


def test_a_route_through_stop_gradient_is_no_partial_path() -> None:
    """No derivative passes a `stop_gradient`, so the input weight's route through
    the detached reset is not an untraced contribution: no `RELATION_PARTIAL_PATH`,
    and D-RTRL equals BPTT over several steps (the model is diagonal)."""
    model, x = build(DetachedReset, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    assert not graph.explain(kind=K.RELATION_PARTIAL_PATH)
    state = etrax.state_of(graph).replace_hidden({("h",): jnp.array([0.9, 0.2, 1.5, 0.4])})
    xs = jax.random.normal(jax.random.PRNGKey(3), (3, 3))
    ts = jax.random.normal(jax.random.PRNGKey(4), (3, 4))
    want = bptt_grads(model, state, xs, ts, _squared)
    rule = etrax.DRTRL()
    got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
    for path in want:
        pairs = zip(jax.tree.leaves(got.grads[path]), jax.tree.leaves(want[path]), strict=True)
        for a, b in pairs:
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


class Pipelined(brainstate.nn.Module):
    """Two leaky layers where the second reads the first's values of the step before
    (``delayed=False``) or, through a two-slot buffer in a short-term state, of two
    steps before (``delayed=True``); the readout sees the second layer only."""

    def __init__(self, delayed: bool, cut: bool = False) -> None:
        super().__init__()
        self.delayed = delayed
        self.cut = cut  # an oracle's variant: the second layer's memory cut from its past
        key = jax.random.PRNGKey(1)
        self.w1 = brainstate.ParamState(0.6 * jax.random.normal(key, (3, 5)))
        self.w2 = brainstate.ParamState(0.6 * jax.random.normal(jax.random.fold_in(key, 1), (5, 4)))
        self.ro = brainstate.ParamState(0.6 * jax.random.normal(jax.random.fold_in(key, 2), (4, 2)))

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.v1 = brainstate.HiddenState(jnp.full(5, 0.6))
        self.v2 = brainstate.HiddenState(jnp.full(4, 0.6))
        self.buffer = brainstate.ShortTermState(jnp.zeros((2, 5)))

    def update(self, x: Array) -> Array:
        v1 = 0.9 * self.v1.value + jnp.tanh(x @ self.w1.value)
        if self.delayed:
            old = self.buffer.value[0]
            self.buffer.value = jnp.stack([self.buffer.value[1], jnp.tanh(v1)])
        else:
            old = jnp.tanh(self.v1.value)
        past = jax.lax.stop_gradient(self.v2.value) if self.cut else self.v2.value
        v2 = 0.9 * past + old @ self.w2.value
        self.v1.value, self.v2.value = v1, v2
        out: Array = v2 @ self.ro.value
        return out


def test_a_group_read_only_in_later_steps_is_reported() -> None:
    """A group whose values reach the outputs only in later steps (through a delay
    buffer, a short-term state no trace follows) has no learning signal: the compiler
    warns (naming its weights) and the report marks them; online they get exactly
    zero, and a window as long as the sequence, as the warning advises, gives BPTT
    through the model's own update."""
    model = Pipelined(True)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    (rec,) = graph.explain(kind=K.HIDDEN_GROUP_NOT_READ)
    assert rec.level is etrax.DiagnosticLevel.WARNING and rec.weight_path == ("w1",)
    assert rec.hidden_paths == (("v1",),) and "window=k" in rec.message
    assert "no learning signal" in graph.report().to_str()
    state = etrax.state_of(graph)
    T = 4
    xs = jax.random.normal(jax.random.PRNGKey(3), (T, 3))
    ts = jax.random.normal(jax.random.PRNGKey(4), (T, 2))
    rule = etrax.DRTRL()
    online = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
    assert not np.any(np.asarray(online.grads[("w1",)]))
    windowed = etrax.online_grad(
        graph, rule, state, rule.init(graph, state), xs, ts, _squared, window=T
    )
    want = bptt_grads(model, state, xs, ts, _squared)
    assert np.any(np.asarray(want[("w1",)]))
    for path in want:
        np.testing.assert_allclose(
            np.asarray(windowed.grads[path]), np.asarray(want[path]), rtol=1e-10, atol=1e-12
        )


def test_a_second_layer_reading_the_firsts_previous_values_carries_its_signal() -> None:
    """A second layer that reads the first's previous values, read out through a
    weight: the first layer's old values reach the output within the step through the
    second's new value, whose computation carries their direct signal (before, the
    first layer was reported as having no learning signal and its weight got zero).
    No warning; D-RTRL gives the first layer's weight exactly the gradient of BPTT
    through the model with the second layer's memory cut (the route on through that
    memory is the cross-group approximation the report names), and the second
    layer's and the readout's weights that of the model itself, as before."""
    model, cut = Pipelined(False), Pipelined(False, cut=True)
    brainstate.nn.init_all_states(model)
    brainstate.nn.init_all_states(cut)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert not graph.explain(kind=K.HIDDEN_GROUP_NOT_READ)
    state = etrax.state_of(graph)
    T = 4
    xs = jax.random.normal(jax.random.PRNGKey(3), (T, 3))
    ts = jax.random.normal(jax.random.PRNGKey(4), (T, 2))
    for rule in (etrax.DRTRL(), etrax.DRTRL(chunk_steps=1)):
        online = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _squared)
        want = bptt_grads(cut, state, xs, ts, _squared)[("w1",)]
        assert np.any(np.asarray(want))
        np.testing.assert_allclose(
            np.asarray(online.grads[("w1",)]), np.asarray(want), rtol=1e-10, atol=1e-12
        )
        exact = bptt_grads(model, state, xs, ts, _squared)
        for path in (("w2",), ("ro",)):
            np.testing.assert_allclose(
                np.asarray(online.grads[path]), np.asarray(exact[path]), rtol=1e-10, atol=1e-12
            )


def test_groups_read_in_their_step_or_the_next_are_not_reported() -> None:
    """No false alarm: every catalogue model, a readout of the old values (the direct
    route) and a stack whose second layer reads the first's new values."""
    from .models import CATALOGUE

    for case in CATALOGUE:
        model, x = case.make()
        graph = etrax.compile_etrace_graph(model, x)
        assert not graph.explain(kind=K.HIDDEN_GROUP_NOT_READ), case.name

    class ReadBefore(Pipelined):
        def update(self, x: Array) -> Array:
            out: Array = jnp.tanh(self.v1.value) @ self.w2.value @ self.ro.value
            self.v1.value = 0.9 * self.v1.value + jnp.tanh(x @ self.w1.value)
            return out

    model = ReadBefore(False)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert not graph.explain(kind=K.HIDDEN_GROUP_NOT_READ)


class CarriedPrevious(brainstate.nn.Module):
    """``h ← 0.5 h + 0.4 prev + tanh(x W + b)``, ``prev ← h``: the previous value kept
    in a state of class `keeper` (a ShortTermState, or a HiddenState, which joins
    `h`'s group), optionally also the readout's previous output (`feedback`)."""

    def __init__(self, keeper: type, feedback: bool = False) -> None:
        super().__init__()
        self.keeper, self.feedback = keeper, feedback
        self.fc = etrax.nn.Linear(3, 4)
        self.out = etrax.nn.Linear(4, 4)

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        lead = () if batch_size is None else (batch_size,)
        self.h = brainstate.HiddenState(jnp.zeros((*lead, 4)))
        self.prev = self.keeper(jnp.zeros((*lead, 4)))
        self.count = brainstate.ShortTermState(jnp.zeros((), jnp.int32))
        self.last_x = brainstate.ShortTermState(jnp.zeros((*lead, 3)))

    def update(self, x: Any) -> Any:
        h = 0.5 * self.h.value + 0.4 * self.prev.value + jnp.tanh(self.fc(x))
        h = h + 0.1 * jnp.sum(self.last_x.value, -1, keepdims=True)  # a carried input
        y = self.out(h)
        self.h.value = h
        self.prev.value = y if self.feedback else h
        self.count.value = self.count.value + 1  # a counter: nothing to differentiate
        self.last_x.value = x
        return y


def _mse(y: Any, t: Any) -> Any:
    return jnp.sum((y - t) ** 2)


@pytest.mark.parametrize("feedback", [False, True], ids=["previous_h", "previous_output"])
def test_a_state_that_carries_weight_influence_is_reported(feedback: bool) -> None:
    """A ShortTermState written from values that weights reach and read again at the
    next step is a route no online rule follows: a `carried_state_route` warning
    names it and the weights (the readout too when its output is fed back), the
    report marks the traced weight approximate, and D-RTRL indeed differs from BPTT
    after two steps. The advice works: the same model with a HiddenState is exact
    (the state joins the group) and gets no warning. A carried input and an integer
    counter are not routes."""
    xs = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    targets = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    errors = {}
    for keeper in (brainstate.ShortTermState, brainstate.HiddenState):
        model = CarriedPrevious(keeper, feedback)
        brainstate.nn.init_all_states(model)
        graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
        records = graph.explain(kind=K.CARRIED_STATE_ROUTE)
        state = etrax.state_of(graph)
        rule = etrax.DRTRL()
        online, _ = etrax.online_grad(
            graph, rule, state, rule.init(graph, state), xs, targets, _mse
        )
        exact = bptt_grads(model, state, xs, targets, _mse)
        errors[keeper] = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(online[("fc", "weight")]),
                jax.tree.leaves(exact[("fc", "weight")]),
                strict=True,
            )
        )
        if keeper is brainstate.HiddenState:
            assert not records
            continue
        (rec,) = records  # neither the carried input nor the counter
        assert rec.level is etrax.DiagnosticLevel.WARNING
        assert rec.hidden_paths == (("prev",),)
        weights = set(rec.context_dict["weight_paths"])
        assert ("fc", "weight") in weights
        assert (("out", "weight") in weights) == feedback
        text = graph.report().to_str(1)
        assert "('prev',)  [carries the influence of" in text
        assert "see carried_state_route" in text.split("Weights traced online:")[1]
    assert errors[brainstate.ShortTermState] > 1e-3  # the route the warning names
    if not feedback:  # `prev` joins `h`'s group: every route is in D
        assert errors[brainstate.HiddenState] < 1e-10


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batched"])
def test_two_hidden_states_holding_one_value(batch: int | None) -> None:
    """``h`` and ``prev`` both set to the same new value (one jaxpr variable): the
    step's outputs read it once, so its learning signal is counted once. It was
    counted per state, doubling every online gradient of the traced weight at T = 1.
    Now every rule equals BPTT at T = 1 and D-RTRL equals it over 5 steps (the two
    states form one group whose D holds every route)."""
    model, x = build(CarriedPrevious, brainstate.HiddenState, batch=batch)
    graph = etrax.compile_etrace_graph(model, x)
    (group,) = graph.hidden_groups
    assert group.hidden_paths == (("h",), ("prev",))
    assert len({v for v in group.hidden_outvars}) == 1  # one variable, two states
    state = etrax.state_of(graph)
    shape = (5, *jnp.shape(x))
    xs = jax.random.normal(jax.random.PRNGKey(0), shape)
    targets = jax.random.normal(jax.random.PRNGKey(1), (5, *shape[1:-1], 4))
    rules: list[etrax.OnlineAlgorithm[Any]] = [etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)]
    for T, algos in ((1, rules), (5, rules[:1])):
        exact = bptt_grads(model, state, xs[:T], targets[:T], _mse)
        for algo in algos:
            got, _ = etrax.online_grad(
                graph, algo, state, algo.init(graph, state), xs[:T], targets[:T], _mse
            )
            for path in exact:
                for a, b in zip(
                    jax.tree.leaves(got[path]), jax.tree.leaves(exact[path]), strict=True
                ):
                    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=str(path))


def test_the_default_report_marks_a_constant_recurrent_product() -> None:
    """The relation into a group whose recurrence holds a product with a constant
    matrix is marked approximate in the level-1 report (not only in the warnings),
    and the report counts the warnings."""
    model = ConstantRecurrence(jnp.diag(jnp.array([0.5, 0.6, 0.7, 0.8])), False)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    text = str(graph.report())
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("Weight 0: ('W',)")]
    assert "see recurrent_constant_product" in line
    assert "warning(s): report().to_str(2)" in text


def test_a_stacked_layer_is_marked_as_the_diagonal_approximation() -> None:
    """Two leaky layers: layer 1's weight is traced, but layer 2's memory carries its
    influence on; the report says so (`cross_group_route`, information), and indeed
    D-RTRL differs from BPTT for it, while layer 2's own weight is exact."""

    class TwoLeaky(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = LeakyLinear(3, 4), LeakyLinear(4, 4)

        def update(self, x: Any) -> Any:
            return self.l2(self.l1(x))

    model, x = build(TwoLeaky)
    graph = etrax.compile_etrace_graph(model, x)
    (rec,) = graph.explain(kind=K.CROSS_GROUP_ROUTE)
    assert rec.weight_path == ("l1", "fc", "weight")
    assert rec.context_dict["hidden_group_indices"] == (0, 1)
    lines = str(graph.report()).splitlines()
    (l1,) = [ln for ln in lines if "Weight 0: ('l1', 'fc', 'weight') via" in ln]
    (l2,) = [ln for ln in lines if "Weight 1: ('l2', 'fc', 'weight') via" in ln]
    assert "see cross_group_route" in l1 and "(" not in l2.split("->")[1]
    xs = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    targets = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    state = etrax.state_of(graph)
    rule = etrax.DRTRL()
    online, _ = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, targets, _mse)
    exact = bptt_grads(model, state, xs, targets, _mse)

    def err(path: Any) -> float:
        pairs = zip(jax.tree.leaves(online[path]), jax.tree.leaves(exact[path]), strict=True)
        return max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)

    assert err(("l1", "fc", "weight")) > 1e-3
    assert err(("l2", "fc", "weight")) < 1e-10
    assert graph.explain(kind=K.RECURRENT_WEIGHT_ROUTE) == ()  # no weight reads an old h


class PlainRNN(brainstate.nn.Module):
    """``h ← 0.9 h + tanh(x W + h U)``, read out by ``V``: written in plain JAX, the
    products recognised as weight operations; ``U`` reads the previous ``h``."""

    def __init__(self) -> None:
        super().__init__()
        keys = jax.random.split(jax.random.PRNGKey(5), 3)
        self.W = brainstate.ParamState(0.5 * jax.random.normal(keys[0], (3, 4)))
        self.U = brainstate.ParamState(0.5 * jax.random.normal(keys[1], (4, 4)))
        self.V = brainstate.ParamState(0.5 * jax.random.normal(keys[2], (4, 2)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((4,)))

    def update(self, x: Any) -> Any:
        h = 0.9 * self.h.value + jnp.tanh(x @ self.W.value + self.h.value @ self.U.value)
        self.h.value = h
        out: Any = h @ self.V.value
        return out


def test_a_recurrent_weight_is_marked_as_the_diagonal_approximation() -> None:
    """A weight that reads the group's previous values (``U h``) is a boundary of the
    transition: the route through it is not in `D`, so the traces of every weight
    traced into the group miss it. The compiler says so (`recurrent_weight_route`,
    information, naming ``U``'s operation and both traced weights), the report marks
    both, and indeed D-RTRL differs from BPTT for both over several steps (it equals
    BPTT at T = 1). Before, the report listed them as traced with no remark."""
    model, x = build(PlainRNN)
    graph = etrax.compile_etrace_graph(model, x)
    (rec,) = graph.explain(kind=K.RECURRENT_WEIGHT_ROUTE)
    assert rec.level is etrax.DiagnosticLevel.INFO
    assert rec.context_dict["weight_paths"] == (("W",), ("U",))
    assert rec.context_dict["hidden_group_indices"] == (0,)
    assert "PlainRNN.update" in rec.message and rec.message.count("test_compiler_cases") == 1
    lines = str(graph.report()).splitlines()
    for name in ("W", "U"):
        (line,) = [ln for ln in lines if f"('{name}',) via" in ln]
        assert "see recurrent_weight_route" in line
    assert graph.weight_rules()[("V",)].rule is etrax.WeightRule.INSTANTANEOUS
    state = etrax.state_of(graph).replace_hidden({("h",): jnp.array([0.3, -0.5, 0.8, 0.1])})
    rule = etrax.DRTRL()
    for T, exact_expected in ((1, True), (6, False)):
        xs = jax.random.normal(jax.random.PRNGKey(0), (T, 3))
        targets = jax.random.normal(jax.random.PRNGKey(1), (T, 2))
        online, _ = etrax.online_grad(
            graph, rule, state, rule.init(graph, state), xs, targets, _mse
        )
        exact = bptt_grads(model, state, xs, targets, _mse)
        for path in (("W",), ("U",)):
            pairs = zip(jax.tree.leaves(online[path]), jax.tree.leaves(exact[path]), strict=True)
            gap = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)
            assert (gap <= 1e-10) == exact_expected, (T, path, gap)
