"""The op zoo: conv, sparse, einsum, embedding, grouped and LoRA ops.

Per op: the rule record's weight gradient equals `jax.vjp` of the op; on a leaky
model ``h ← 0.5 h + op(x)`` D-RTRL equals BPTT at T = 1 and 4 and pp-prop at T = 1
(float64); trace sizes follow the op's complexity; bad input is refused early."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax
from etrax.algorithms._plan import plan_of

TOL = 1e-10


def _rand(key: int, shape: tuple[int, ...], scale: float = 0.5) -> Array:
    return scale * jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float64)


PATTERN = etrax.SparsePattern.from_mask(
    np.asarray(jax.random.bernoulli(jax.random.PRNGKey(9), 0.4, (5, 4)))
)


@dataclass(frozen=True)
class OpCase:
    """``op(x, **weights)`` with example shapes."""

    name: str
    op: Callable[..., Array]
    x: Callable[[int], Array]
    weights: dict[str, tuple[int, ...]]
    hidden: tuple[int, ...]


def _dense(x: Array, weight: Array, bias: Array) -> Array:
    return etrax.matmul(x, weight, bias)


def _grouped(x: Array, weight: Array, bias: Array) -> Array:
    return etrax.grouped_matmul(x, weight, bias, weight_fn=jnp.tanh)


def _grouped_merged(x: Array, weight: Array, bias: Array) -> Array:
    return etrax.grouped_matmul(x, weight, bias, weight_fn=jnp.tanh, merge_groups=True)


def _embedding(x: Array, weight: Array) -> Array:
    return etrax.embedding(x, weight)


def _lora(x: Array, lora_b: Array, lora_a: Array, bias: Array) -> Array:
    return etrax.lora_matmul(x, lora_b, lora_a, bias, alpha=2.0)


def _einsum(x: Array, weight: Array) -> Array:
    return etrax.einsum("bti,io->bto", x, weight)


def _sparse(x: Array, weight: Array, bias: Array) -> Array:
    return etrax.sparse_matmul(x, weight, PATTERN, bias)


def _conv1d(x: Array, weight: Array, bias: Array) -> Array:
    return etrax.conv(x, weight, bias, padding="SAME")


def _conv2d(x: Array, weight: Array) -> Array:
    return etrax.conv(x, weight, strides=(1, 2), padding="VALID")


def _conv1d_dilated(x: Array, weight: Array, bias: Array) -> Array:
    return etrax.conv(x, weight, bias, strides=(2,), padding="SAME", rhs_dilation=(2,))


def _conv3d(x: Array, weight: Array) -> Array:
    return etrax.conv(x, weight, padding="VALID")


OPS = (
    OpCase("dense", _dense, lambda k: _rand(k, (2, 3)), {"weight": (3, 4), "bias": (4,)}, (2, 4)),
    OpCase(
        "grouped",
        _grouped,
        lambda k: _rand(k, (2, 3, 2)),
        {"weight": (3, 2, 4), "bias": (3, 4)},
        (2, 3, 4),
    ),
    OpCase(
        "grouped_merged",
        _grouped_merged,
        lambda k: _rand(k, (2, 3, 2)),
        {"weight": (3, 2, 4), "bias": (3, 4)},
        (2, 12),
    ),
    OpCase(
        "embedding",
        _embedding,
        lambda k: jax.random.randint(jax.random.PRNGKey(k), (3,), 0, 6),
        {"weight": (6, 4)},
        (3, 4),
    ),
    OpCase(
        "lora",
        _lora,
        lambda k: _rand(k, (2, 5)),
        {"lora_b": (5, 2), "lora_a": (2, 4), "bias": (4,)},
        (2, 4),
    ),
    OpCase("einsum", _einsum, lambda k: _rand(k, (2, 3, 4)), {"weight": (4, 5)}, (2, 3, 5)),
    OpCase(
        "sparse",
        _sparse,
        lambda k: _rand(k, (2, 5)),
        {"weight": (PATTERN.nnz,), "bias": (4,)},
        (2, 4),
    ),
    OpCase(
        "conv1d",
        _conv1d,
        lambda k: _rand(k, (2, 6, 3)),
        {"weight": (3, 3, 4), "bias": (4,)},
        (2, 6, 4),
    ),
    OpCase(
        "conv2d", _conv2d, lambda k: _rand(k, (2, 5, 6, 2)), {"weight": (2, 3, 2, 3)}, (2, 4, 2, 3)
    ),
    OpCase(
        "conv1d_dilated",
        _conv1d_dilated,
        lambda k: _rand(k, (2, 7, 2)),
        {"weight": (3, 2, 3), "bias": (3,)},
        (2, 4, 3),
    ),
    OpCase(
        "conv3d",
        _conv3d,
        lambda k: _rand(k, (1, 3, 3, 4, 2)),
        {"weight": (2, 2, 3, 2, 2)},
        (1, 2, 2, 2, 2),
    ),
)


@pytest.mark.parametrize("case", OPS, ids=lambda c: c.name)
def test_weight_gradient_rule_equals_vjp(case: OpCase) -> None:
    x = case.x(0)
    weights = {k: _rand(i + 1, s) for i, (k, s) in enumerate(case.weights.items())}
    y, vjp = jax.vjp(lambda w: case.op(x, **w), weights)
    cot = _rand(7, y.shape)
    (expected,) = vjp(cot)
    jaxpr = jax.make_jaxpr(lambda w: case.op(x, **w))(weights)
    (eqn,) = [e for e in jaxpr.eqns if etrax.etp_spec(e.primitive) is not None]
    spec = etrax.etp_spec(eqn.primitive)
    assert spec is not None and spec.rules is not None
    keys = spec.trainable(eqn.params)
    operands = {k: weights[k] for k in keys}
    got = spec.rules.weight_grad(x, cot, operands, eqn.params)
    assert got.keys() == expected.keys()
    for k in got:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=TOL)


class Leaky(brainstate.nn.Module):
    """``h ← 0.5 h + op(x)``."""

    def __init__(self, case: OpCase) -> None:
        super().__init__()
        self.case = case
        for i, (k, shape) in enumerate(case.weights.items()):
            setattr(self, k, brainstate.ParamState(_rand(10 + i, shape)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.case.hidden, jnp.float64))

    def update(self, x: Array) -> Array:
        weights = {k: getattr(self, k).value for k in self.case.weights}
        h = 0.5 * self.h.value + self.case.op(x, **weights)
        self.h.value = h
        return h


def _mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def _rel(a: Any, b: Any) -> float:
    worst = 0.0
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = float(jnp.max(jnp.abs(v)))
        worst = max(worst, float(jnp.max(jnp.abs(u - v))) / (scale or 1.0))
    return worst


def _leaky(case: OpCase) -> tuple[etrax.ETraceGraph, etrax.ModelState]:
    model = Leaky(case)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, case.x(0))
    return graph, etrax.state_of(graph)


@pytest.mark.parametrize("case", OPS, ids=lambda c: c.name)
def test_leaky_model_online_equals_bptt(case: OpCase) -> None:
    graph, state = _leaky(case)
    (rel,) = graph.hidden_param_op_relations
    assert rel.tails[0].is_diagonal
    for T in (1, 4):
        xs = jnp.stack([case.x(100 + t) for t in range(T)])
        ts = jax.random.normal(jax.random.PRNGKey(3), (T, *case.hidden), jnp.float64)
        expected, _ = etrax.bptt_grad(graph, state, xs, ts, _mse)
        algos: list[etrax.OnlineAlgorithm[Any]] = [
            etrax.DRTRL(chunk_steps=1),
            etrax.DRTRL(chunk_steps=3),
        ]
        if T == 1:
            algos.append(etrax.PPProp(0.8))
        for algo in algos:
            got, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, _mse)
            assert _rel(got, expected) <= TOL, (case.name, T, algo)


def test_trace_sizes_follow_each_ops_complexity() -> None:
    sizes = {}
    for case in OPS:
        graph, state = _leaky(case)
        (slot,) = plan_of(graph).slots
        sizes[case.name] = {k: v for k, v in slot.trace_shapes.items()}
    assert sizes["sparse"]["weight"] == (2, PATTERN.nnz)  # nnz per sample
    assert sizes["grouped"]["weight"] == (2, 3, 2, 4)  # G·K·N per sample, not (G·K)·(G·N)
    assert sizes["grouped_merged"] == sizes["grouped"]  # the same with its groups merged
    assert sizes["embedding"]["weight"] == (3, 6, 4)  # vocabulary × dim per sample
    assert sizes["lora"]["weight"] == (2, 5, 4)  # the effective in × out weight
    assert sizes["conv1d"]["weight"] == (2, 6, 9, 4)  # per output position: patch × out
    assert sizes["einsum"]["weight"] == (2, 3, 4, 5)  # per (batch, position)
    graph, state = _leaky(next(case for case in OPS if case.name == "sparse"))
    traces = etrax.DRTRL().init(graph, state)
    (eps,) = traces.eps
    assert eps["weight"].shape == (2, PATTERN.nnz, 1)  # nnz × S per batch element


def test_bad_op_input_is_refused_early() -> None:
    with pytest.raises(TypeError, match="integers"):
        etrax.embedding(jnp.ones(3), jnp.ones((6, 4)))
    with pytest.raises(ValueError, match="mismatched LoRA ranks"):
        etrax.lora_matmul(jnp.ones(5), jnp.ones((5, 2)), jnp.ones((3, 4)))
    for bad in ("bi,io", "bi,io,oj->bj", "...i,io->...o", "bi,ioz->bo", "bi,ii->bi"):
        with pytest.raises(ValueError, match="einsum"):
            etrax.einsum(bad, jnp.ones((2, 3)), jnp.ones((3, 3)))
    with pytest.raises(ValueError, match="batch axis"):
        etrax.conv(jnp.ones((6, 3)), jnp.ones((3, 3, 4)))
    with pytest.raises(ValueError, match=r"nnz|data"):
        etrax.sparse_matmul(jnp.ones(5), jnp.ones(3), PATTERN)


class GroupedConv(brainstate.nn.Module):
    """A grouped convolution (which the online rules cannot trace), or one whose output
    puts the spatial axes in another order than the kernel (`layout`, `kernel_order`)
    or its channels first (`channels_first`), beside a traced element-wise gain."""

    NUMBERS: ClassVar[dict[str, tuple[str, str, str]]] = {
        "layout": ("NHWC", "HWIO", "NWHC"),  # output (batch, W, H, channels)
        "kernel_order": ("NHWC", "WHIO", "NHWC"),  # the kernel's spatial axes swapped
        "channels_first": ("NHWC", "HWIO", "NCHW"),
    }

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.k = brainstate.ParamState(_rand(1, (3, 2, 4) if kind == "grouped" else (2, 2, 4, 4)))
        self.g = brainstate.ParamState(_rand(2, (5,) if kind == "channels_first" else (4,)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = {"grouped": (2, 6, 4), "channels_first": (2, 4, 5, 5)}.get(self.kind, (2, 5, 5, 4))
        self.h = brainstate.HiddenState(jnp.zeros(shape, jnp.float64))

    def update(self, x: Array) -> Array:
        if self.kind == "grouped":
            c = etrax.conv(x, self.k.value, feature_group_count=2)
        else:
            numbers = self.NUMBERS[self.kind]
            c = etrax.conv(x, self.k.value, padding="SAME", dimension_numbers=numbers)
        h = 0.5 * self.h.value + c + etrax.element_wise(self.g.value)
        self.h.value = h
        return h


CONV_REASONS = {
    "grouped": "grouped convolutions",
    "layout": "the output's spatial axes 'WH' against the kernel's 'HW'",
    "kernel_order": "the output's spatial axes 'HW' against the kernel's 'WH'",
    "channels_first": "its channel axis last",
}


@pytest.mark.parametrize("kind", list(CONV_REASONS))
def test_a_conv_the_rules_cannot_trace_learns_instantaneously(kind: str) -> None:
    """A convolution the online rules cannot trace forms no relation: the compiler says
    why (`relation_excluded_unsupported`, naming the condition), its kernel learns from
    its exact instantaneous gradient (equal to BPTT at T = 1), and the other weights are
    traced as usual. Before, the kernel was reported traced and every online algorithm
    refused the whole model."""
    model = GroupedConv(kind)
    brainstate.nn.init_all_states(model)
    x = _rand(0, (2, 6, 4) if kind == "grouped" else (2, 5, 5, 4))
    graph = etrax.compile_etrace_graph(model, x)
    rules = graph.weight_rules()
    assert rules[("k",)].rule is etrax.WeightRule.INSTANTANEOUS
    assert rules[("k",)].reason is etrax.DiagnosticKind.RELATION_EXCLUDED_UNSUPPORTED
    assert rules[("g",)].rule is etrax.WeightRule.TRACED
    (rec,) = graph.explain(kind=etrax.DiagnosticKind.RELATION_EXCLUDED_UNSUPPORTED)
    assert CONV_REASONS[kind] in rec.message
    state = etrax.state_of(graph)
    xs, ts = x[None], jnp.zeros((1, *model.h.value.shape))
    exact, _ = etrax.bptt_grad(graph, state, xs, ts, _mse)
    algos: list[etrax.OnlineAlgorithm[Any]] = [etrax.DRTRL(), etrax.PPProp(0.9)]
    for algo in algos:
        got, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, _mse)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(exact), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_bind_refuses_primitives_that_are_not_etp_ops() -> None:
    with pytest.raises(ValueError, match="not an ETP primitive"):
        etrax.ops.bind(jax.lax.sin_p, jnp.ones(3))
    y = etrax.ops.bind(
        etrax.ops.matmul_p,
        jnp.ones((2, 3)),
        jnp.ones((3, 4)),
        has_bias=False,
        weight_fn=None,
        bias_fn=None,
    )
    np.testing.assert_allclose(y, 3.0 * jnp.ones((2, 4)))


def test_sparse_pattern_from_bcoo() -> None:
    from jax.experimental import sparse

    dense = jnp.asarray([[0.0, 2.0, 0.0], [1.5, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 3.0, 0.0]])
    pattern, values = etrax.ops.SparsePattern.from_bcoo(sparse.BCOO.fromdense(dense))
    assert pattern.shape == (4, 3) and pattern.nnz == 4
    x = _rand(0, (2, 4))
    np.testing.assert_allclose(etrax.ops.sparse_matmul(x, values, pattern), x @ dense, atol=TOL)
    with pytest.raises(TypeError, match="BCOO"):
        etrax.ops.SparsePattern.from_bcoo(dense)
    with pytest.raises(ValueError, match="2-D"):
        etrax.ops.SparsePattern.from_bcoo(sparse.BCOO.fromdense(jnp.ones((2, 3, 4))))


class ScalarReadIn(brainstate.nn.Module):
    """One scalar unit driven by ``einsum('i,i->', x, w)``: an einsum with an empty
    output spec (refused before, although `jnp.einsum` takes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.asarray([0.3, -0.2, 0.5], jnp.float64))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.asarray(0.4, jnp.float64))

    def update(self, x: Array) -> Array:
        self.h.value = 0.7 * self.h.value + jnp.tanh(etrax.einsum("i,i->", x, self.w.value))
        return self.h.value


def test_an_einsum_with_a_scalar_output_is_traced_exactly() -> None:
    model = ScalarReadIn()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert graph.weight_rules()[("w",)].rule is etrax.WeightRule.TRACED
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.key(0), (5, 3), jnp.float64)
    ts = jax.random.normal(jax.random.key(1), (5,), jnp.float64)

    def loss(y: Array, t: Array) -> Array:
        return (y - t) ** 2

    def bptt(w: Array, T: int) -> Array:  # the model's recurrence, written out
        h, total = jnp.asarray(0.4), jnp.asarray(0.0)
        for t in range(T):
            h = 0.7 * h + jnp.tanh(jnp.dot(xs[t], w))
            total = total + loss(h, ts[t])
        return total

    w0 = state.params[("w",)]
    checks: list[tuple[int, etrax.OnlineAlgorithm[Any]]] = [
        (1, etrax.DRTRL()),
        (1, etrax.PPProp(0.9)),
        (1, etrax.EProp(0.5)),
        (5, etrax.DRTRL()),  # a scalar unit: exact over time
    ]
    for T, rule in checks:
        want = jax.grad(bptt)(w0, T)
        traces = rule.init(graph, state)
        got, _ = etrax.online_grad(graph, rule, state, traces, xs[:T], ts[:T], loss)
        np.testing.assert_allclose(np.asarray(got[("w",)]), want, rtol=TOL, atol=1e-13)
