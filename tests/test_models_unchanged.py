"""The models people write compile and train unchanged: plain brainstate layers,
fused gates, control flow inside ``update``, units, and user position rules.

Oracles: gradients through brainstate's own jaxpr of ``model.update``
(`oracles.bptt_grads`), and the etrax.nn counterparts written with ETP ops.
"""

import functools
from collections.abc import Callable
from typing import Any

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax
from etrax.compiler import CompilationRecord, StateKind
from etrax.compiler import DiagnosticKind as K

from .oracles import bptt_grads

TOL = 1e-10
T = 6


def sq(y: Any, t: Any) -> Array:
    return jnp.sum((y - t) ** 2)


def _sequence(
    x_shape: tuple[int, ...], y_shape: tuple[int, ...], steps: int, seed: int = 0
) -> tuple[Array, Array]:
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (steps, *x_shape)), jax.random.normal(ky, (steps, *y_shape))


def _close(a: Any, b: Any, tol: float = TOL) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    scale = max(1.0, *(float(jnp.max(jnp.abs(jnp.asarray(x)))) for x in lb))
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=tol * scale)


def _online(
    graph: etrax.ETraceGraph, algo: etrax.OnlineAlgorithm[Any], xs: Array, ys: Array
) -> Any:
    state = etrax.state_of(graph)
    grads, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ys, sq)
    return grads


def _etp_free(model: brainstate.nn.Module, x: Array) -> None:
    """The model's own jaxpr has no ETP op (it is written without etrax)."""
    fn = brainstate.transform.StatefulFunction(model.update, return_only_write=False)
    eqns = fn.get_jaxpr(x).jaxpr.eqns
    assert not any(etrax.etp_spec(e.primitive) is not None for e in eqns)


def _quiet_and_exact_at_one_step(
    graph: etrax.ETraceGraph, model: brainstate.nn.Module, xs: Array, ys: Array
) -> etrax.ModelState:
    """No warning in `graph`, and every rule equals BPTT through `model`'s own
    ``update`` at T = 1; returns the compiled state."""
    warned = [r for r in graph.diagnostics if r.level is not etrax.DiagnosticLevel.INFO]
    assert not warned, warned
    state = etrax.state_of(graph)
    exact_1 = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs[:1], ys[:1])), exact_1)
    return state


# ----- plain brainstate cells against their etrax.nn counterparts ------------------------


class Net(brainstate.nn.Module):
    """A recurrent cell and a readout (both layers as given)."""

    def __init__(self, cell: brainstate.nn.Module, readout: brainstate.nn.Linear) -> None:
        super().__init__()
        self.cell = cell
        self.out = readout

    def update(self, x: ArrayLike) -> Array:
        y: Array = self.out(self.cell(x))
        return y


def _pieces(value: Array, n: int) -> list[Array]:
    return list(jnp.split(value, n, axis=-1))


# brainstate layer path → [(etrax path, feature slice count, slice index)]; for each
# cell the brainstate fused weight is the concatenation of the etrax gates.
CELLS: dict[str, tuple[Callable[[], Any], Callable[[], Any], dict[str, list[str]]]] = {
    "GRUCell": (
        lambda: brainstate.nn.GRUCell(3, 4),
        lambda: etrax.nn.GRUCell(3, 4),
        {"Wrz": ["Wr", "Wz"], "Wh": ["Wh"]},
    ),
    "LSTMCell": (
        lambda: brainstate.nn.LSTMCell(3, 4),
        lambda: etrax.nn.LSTMCell(3, 4),
        {"W": ["Wi", "Wg", "Wf", "Wo"]},
    ),
    "MGUCell": (
        lambda: brainstate.nn.MGUCell(3, 4),
        lambda: etrax.nn.MGUCell(3, 4),
        {"Wf": ["Wf"], "Wh": ["Wh"]},
    ),
    "VanillaRNNCell": (
        lambda: brainstate.nn.ValinaRNNCell(3, 4),
        lambda: etrax.nn.ValinaRNNCell(3, 4),
        {"W": ["W"]},
    ),
}


def _pair(name: str, batch: int | None) -> tuple[Net, Net]:
    make_bs, make_et, layout = CELLS[name]
    bs = Net(make_bs(), brainstate.nn.Linear(4, 2))
    et = Net(make_et(), brainstate.nn.Linear(4, 2))
    brainstate.nn.init_all_states(bs, batch_size=batch)
    brainstate.nn.init_all_states(et, batch_size=batch)
    for fused, gates in layout.items():
        value = getattr(bs.cell, fused).weight.value
        for k, gate in enumerate(gates):
            target: brainstate.ParamState[Any] = getattr(et.cell, gate).weight
            target.value = {key: _pieces(v, len(gates))[k] for key, v in value.items()}
    et.out.weight.value = dict(bs.out.weight.value)
    return bs, et


def _to_etrax_layout(name: str, grads: Any) -> dict[tuple[str, ...], Any]:
    """brainstate-cell gradients cut into the etrax cell's per-gate parameters."""
    layout = CELLS[name][2]
    out: dict[tuple[str, ...], Any] = {("out", "weight"): grads[("out", "weight")]}
    for fused, gates in layout.items():
        value = grads[("cell", fused, "weight")]
        for k, gate in enumerate(gates):
            out[("cell", gate, "weight")] = {
                key: _pieces(v, len(gates))[k] for key, v in value.items()
            }
    return out


@functools.cache
def _cell_graphs(name: str, batch: int | None) -> tuple[Net, etrax.ETraceGraph, etrax.ETraceGraph]:
    bs, et = _pair(name, batch)
    x = jnp.zeros((3,) if batch is None else (batch, 3))
    _etp_free(bs, x)
    return bs, etrax.compile_etrace_graph(bs, x), etrax.compile_etrace_graph(et, x)


# every cell batched; the fused-gate cells (GRU, LSTM) also unbatched
CELL_CASES = [(name, 2) for name in CELLS] + [("GRUCell", None), ("LSTMCell", None)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "batch"), CELL_CASES, ids=lambda v: str(v))
def test_brainstate_cell_trains_like_its_etrax_counterpart(name: str, batch: int | None) -> None:
    bs, g_bs, g_et = _cell_graphs(name, batch)
    # same groups
    assert [(gr.varshape, gr.num_state, len(gr.hidden_paths)) for gr in g_bs.hidden_groups] == [
        (gr.varshape, gr.num_state, len(gr.hidden_paths)) for gr in g_et.hidden_groups
    ]
    # every weight traced, recognised automatically
    recognised = g_bs.explain(kind=K.WEIGHT_OP_RECOGNISED)
    assert recognised and all(r.level is etrax.DiagnosticLevel.INFO for r in recognised)
    assert not g_bs.explain(kind=K.WEIGHT_PLAIN_USE)
    x_shape = (3,) if batch is None else (batch, 3)
    y_shape = (2,) if batch is None else (batch, 2)
    xs, ys = _sequence(x_shape, y_shape, T)
    algo: etrax.OnlineAlgorithm[Any]
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9)):
        got = _to_etrax_layout(name, _online(g_bs, algo, xs, ys))
        want = _online(g_et, algo, xs, ys)
        _close(dict(got), dict(want))
    # T = 1: every online rule equals BPTT through brainstate's own update
    state = etrax.state_of(g_bs)
    exact = bptt_grads(bs, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(g_bs, algo, xs[:1], ys[:1])), exact)


def test_recognition_can_be_turned_off() -> None:
    bs, g_bs, _ = _cell_graphs("GRUCell", None)
    off = etrax.compile_etrace_graph(
        bs, jnp.zeros(3), policy=etrax.CompilePolicy(recognise_weight_ops=False)
    )
    assert off.hidden_param_op_relations == ()
    assert not off.explain(kind=K.WEIGHT_OP_RECOGNISED)
    assert {r.weight_path for r in off.explain(kind=K.WEIGHT_PLAIN_USE)} >= {
        ("cell", "Wrz", "weight"),
        ("cell", "Wh", "weight"),
    }
    text = str(g_bs.report())
    assert "recognised automatically" in text


# ----- weight transforms, conv --------------------------------------------------------


class Leaky(brainstate.nn.Module):
    """``h ← 0.7 h + layer(x)`` with any brainstate layer, then a readout."""

    def __init__(self, layer: brainstate.nn.Module, n: int, n_out: int = 2) -> None:
        super().__init__()
        self.layer = layer
        self.n = n
        self.out = brainstate.nn.Linear(n, n_out)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: ArrayLike) -> Array:
        h = 0.7 * self.h.value + jnp.tanh(self.layer(x))
        self.h.value = h
        y: Array = self.out(h)
        return y


@pytest.mark.parametrize(
    "make",
    [
        lambda: brainstate.nn.Linear(3, 4),
        lambda: brainstate.nn.SignedWLinear(3, 4),
        lambda: brainstate.nn.ScaledWSLinear(3, 4),
    ],
    ids=["Linear", "SignedWLinear", "ScaledWSLinear"],
)
def test_linear_layers_with_weight_transforms_are_traced(make: Callable[[], Any]) -> None:
    model = Leaky(make(), 4)
    brainstate.nn.init_all_states(model, batch_size=2)
    x = jnp.zeros((2, 3))
    _etp_free(model, x)
    graph = etrax.compile_etrace_graph(model, x)
    rules = graph.weight_rules()
    layer_paths = [p for p in rules if p[0] == "layer"]
    assert layer_paths and all(rules[p].rule is etrax.WeightRule.TRACED for p in layer_paths)
    xs, ys = _sequence((2, 3), (2, 2), 1)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs, ys, sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs, ys)), exact)


class ConvLIF(brainstate.nn.Module):
    """``brainstate.nn.Conv2d`` → LIF neurons → a linear readout of the spikes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = brainstate.nn.Conv2d((5, 5, 1), 2, kernel_size=3)
        self.lif = etrax.nn.LIF((5, 5, 2), tau=5.0, v_th=0.5)
        self.out = brainstate.nn.Linear(50, 3)

    def update(self, x: ArrayLike) -> Array:
        s = self.lif(self.conv(x))
        y: Array = self.out(s.reshape(s.shape[0], -1))
        return y


def test_conv_lif_readout_trains_without_etrax_ops() -> None:
    model = ConvLIF()
    brainstate.nn.init_all_states(model, batch_size=2)
    x = jnp.zeros((2, 5, 5, 1))
    _etp_free(model, x)
    graph = etrax.compile_etrace_graph(model, x)
    rules = graph.weight_rules()
    assert rules[("conv", "weight")].rule is etrax.WeightRule.TRACED
    assert any("etrax.conv" in r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED))
    xs, ys = _sequence((2, 5, 5, 1), (2, 3), T, seed=3)
    xs = 2.0 * jnp.abs(xs)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs[:1], ys[:1], sq)
    _close(dict(_online(graph, etrax.DRTRL(), xs[:1], ys[:1])), exact)
    # the conv weight feeds the LIF element-wise: D-RTRL is exact over the sequence
    full = bptt_grads(model, state, xs, ys, sq)
    got = _online(graph, etrax.DRTRL(), xs, ys)
    _close(got[("conv", "weight")], full[("conv", "weight")], 1e-8)


class OneSampleConv(brainstate.nn.Module):
    """A leaky layer fed by a 1-D convolution of one sample ``(length, channels)``:
    brainstate's `Conv1d` (which wraps its op in a batch axis of 1) or etrax's."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        brainstate.random.seed(3)
        self.c = etrax.nn.Conv1d(2, 3, 3) if own else brainstate.nn.Conv1d((6, 2), 3, 3)
        self.out = brainstate.nn.Linear(18, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        lead = () if batch_size is None else (batch_size,)
        self.h = brainstate.HiddenState(jnp.zeros((*lead, 6, 3)))

    def update(self, x: ArrayLike) -> Array:
        h = 0.8 * self.h.value + jnp.tanh(self.c(x))
        self.h.value = h
        y: Array = self.out(h.reshape(*h.shape[:-2], 18))
        return y


@pytest.mark.parametrize("own", [False, True], ids=["brainstate", "etrax"])
def test_a_one_sample_convolution_is_traced(own: bool) -> None:
    """Per sample, the convolution's output has a batch axis of 1 the hidden state
    lacks: it is traced all the same, exactly (element-wise recurrence) over the
    sequence, and a vmap learner of the per-sample model equals the batched one."""
    model = OneSampleConv(own)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((6, 2)))
    assert graph.weight_rules()[("c", "weight")].rule is etrax.WeightRule.TRACED
    xs, ys = _sequence((6, 2), (2,), T, seed=4)
    state = etrax.state_of(graph)
    full = bptt_grads(model, state, xs, ys, sq)
    for rule in (etrax.DRTRL(), etrax.EProp(0.0)):
        got = _online(graph, rule, xs, ys)
        _close(got[("c", "weight")], full[("c", "weight")], 1e-9)
    B = 2
    xb, yb = _sequence((B, 6, 2), (B, 2), T, seed=5)
    mapped = etrax.compile(OneSampleConv(own), etrax.DRTRL(), xb[0], batch_size=B, vmap=True)
    batched = etrax.compile(OneSampleConv(own), etrax.DRTRL(), xb[0], batch_size=B)
    _close(dict(mapped.etrace_grad(xb, yb, sq)), dict(batched.etrace_grad(xb, yb, sq)), 1e-9)


class TransposedConv(brainstate.nn.Module):
    """A leaky layer fed by brainstate's transposed convolution, whose kernel is laid out
    ``(*spatial, out, in)`` and flipped before ``conv_general_dilated``."""

    def __init__(self, spatial: tuple[int, ...], stride: int) -> None:
        super().__init__()
        brainstate.random.seed(4)
        n = len(spatial)
        conv = brainstate.nn.ConvTranspose1d if n == 1 else brainstate.nn.ConvTranspose2d
        self.c = conv((*spatial, 2), 3, 3, stride=stride, padding="SAME")
        self.out_shape = (*(s * stride for s in spatial), 3)
        self.size = int(np.prod(self.out_shape))
        self.out = brainstate.nn.Linear(self.size, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        lead = () if batch_size is None else (batch_size,)
        self.h = brainstate.HiddenState(jnp.zeros((*lead, *self.out_shape)))

    def update(self, x: ArrayLike) -> Array:
        h = 0.8 * self.h.value + jnp.tanh(self.c(x))
        self.h.value = h
        lead = h.shape[: h.ndim - len(self.out_shape)]
        y: Array = self.out(h.reshape(*lead, self.size))
        return y


@pytest.mark.parametrize(
    ("spatial", "stride", "batch"),
    [((5,), 1, None), ((4,), 2, 2), ((3, 4), 1, None)],
    ids=["1d", "1d-stride2-b2", "2d"],
)
def test_transposed_convolutions_are_traced(
    spatial: tuple[int, ...], stride: int, batch: int | None
) -> None:
    """brainstate's ``ConvTranspose1d`` / ``2d`` keep their kernel as ``(*spatial, out,
    in)``: the kernel is laid out as etrax.conv's in its weight program and traced.
    Every rule equals BPTT at T = 1, and D-RTRL over the sequence (the element-wise
    recurrence makes it exact). Before, the kernel was a plain use, not traced."""
    model = TransposedConv(spatial, stride)
    brainstate.nn.init_all_states(model, batch_size=batch)
    lead = () if batch is None else (batch,)
    x = jnp.zeros((*lead, *spatial, 2))
    _etp_free(model, x)
    graph = etrax.compile_etrace_graph(model, x)
    assert graph.weight_rules()[("c", "weight")].rule is etrax.WeightRule.TRACED
    xs, ys = _sequence(x.shape, (*lead, 2), 5, seed=6)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for rule in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, rule, xs[:1], ys[:1])), exact)
    full = bptt_grads(model, state, xs, ys, sq)
    _close(_online(graph, etrax.DRTRL(), xs, ys)[("c", "weight")], full[("c", "weight")], 1e-9)


class LowRankInput(brainstate.nn.Module):
    """A leaky layer fed by brainstate's `LoRA`, ``(x @ A) @ B`` (plus a base `Linear`
    with ``base=True``); with ``recurrent=True`` it reads ``[x, h]``."""

    def __init__(self, base: bool, recurrent: bool = False) -> None:
        super().__init__()
        brainstate.random.seed(2)
        self.recurrent = recurrent
        n_in = 7 if recurrent else 3
        linear = brainstate.nn.Linear(n_in, 4) if base else None
        self.lora = brainstate.nn.LoRA(n_in, 2, 4, base_module=linear)
        self.out = brainstate.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        lead = () if batch_size is None else (batch_size,)
        self.h = brainstate.HiddenState(jnp.zeros((*lead, 4)))

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        inp = jnp.concatenate([jnp.asarray(x), h], -1) if self.recurrent else jnp.asarray(x)
        h = 0.8 * h + jnp.tanh(self.lora(inp))
        self.h.value = h
        y: Array = self.out(h)
        return y


@pytest.mark.parametrize(
    ("base", "recurrent", "batch"),
    [(False, False, None), (True, False, 2), (True, True, None)],
    ids=["lora", "lora+base-b2", "recurrent"],
)
def test_a_low_rank_product_is_traced_as_lora(
    base: bool, recurrent: bool, batch: int | None
) -> None:
    """``(x @ A) @ B``, brainstate's `LoRA`: the two products become one
    `etrax.lora_matmul`, and both factors are traced (before, ``A`` reached the hidden
    state only through ``B`` and got its instantaneous gradient only: the weight was
    partly traced). Every rule equals BPTT at T = 1; on the input alone (an
    element-wise recurrence) D-RTRL equals BPTT over the sequence for both factors."""
    model = LowRankInput(base, recurrent)
    brainstate.nn.init_all_states(model, batch_size=batch)
    lead = () if batch is None else (batch,)
    x = jnp.zeros((*lead, 3))
    _etp_free(model, x)
    graph = etrax.compile_etrace_graph(model, x)
    assert graph.weight_rules()[("lora", "weight")].rule is etrax.WeightRule.TRACED
    assert any("lora_matmul" in r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED))
    xs, ys = _sequence(x.shape, (*lead, 2), 5, seed=7)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for rule in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, rule, xs[:1], ys[:1])), exact)
    if not recurrent:
        full = bptt_grads(model, state, xs, ys, sq)
        got = _online(graph, etrax.DRTRL(), xs, ys)
        _close(got[("lora", "weight")], full[("lora", "weight")], 1e-9)


class TiedLowRank(brainstate.nn.Module):
    """``(x @ W) @ Wᵀ + b`` (a tied bottleneck) and ``split((x @ W) @ V, 2)`` (gates
    from a low-rank product) driving one leaky, gated hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.W = _param(21, (4, 3))
        self.V = _param(22, (3, 8))
        self.b = _param(23, (4,))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        lead = () if batch_size is None else (batch_size,)
        self.h = brainstate.HiddenState(jnp.zeros((*lead, 4)))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        z = (x @ self.W.value) @ self.W.value.T + self.b.value
        f, c = jnp.split((x @ self.W.value) @ self.V.value, 2, axis=-1)
        h = jax.nn.sigmoid(f) * self.h.value + jnp.tanh(z) + jnp.tanh(c)
        self.h.value = h
        return h


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch=2"])
def test_tied_and_gated_low_rank_products_are_traced(batch: int | None) -> None:
    """A low-rank product whose factors are one weight and its transpose, and one cut
    into gates, are each one `etrax.lora_matmul` (per part): every weight is traced,
    every rule equals BPTT at T = 1, and D-RTRL equals it over the sequence."""
    model = TiedLowRank()
    brainstate.nn.init_all_states(model, batch_size=batch)
    lead = () if batch is None else (batch,)
    x = jnp.zeros((*lead, 4))
    graph = etrax.compile_etrace_graph(model, x)
    for path, status in graph.weight_rules().items():
        assert status.rule is etrax.WeightRule.TRACED, (path, status)
    xs, ys = _sequence(x.shape, x.shape, 5, seed=8)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for rule in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, rule, xs[:1], ys[:1])), exact)
    full = bptt_grads(model, state, xs, ys, sq)
    _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), full, 1e-9)


# ----- fused gates ----------------------------------------------------------------------


def _param(key: int, shape: tuple[int, ...], scale: float = 0.5) -> "brainstate.ParamState[Array]":
    return brainstate.ParamState(scale * jax.random.normal(jax.random.PRNGKey(key), shape))


class FusedGRU(brainstate.nn.Module):
    """A GRU written the usual way: ``x @ Wx + b`` and ``h @ Wh`` each cut in three."""

    def __init__(self, n_in: int, n: int, fused: bool = True) -> None:
        super().__init__()
        self.n, self.fused = n, fused
        self.wx = _param(1, (n_in, 3 * n))
        self.wh = _param(2, (n, 3 * n))
        self.b = _param(3, (3 * n,))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.n))

    def _gates(self, x: Array, h: Array) -> tuple[list[Array], list[Array]]:
        if self.fused:
            gx = jnp.split(x @ self.wx.value + self.b.value, 3, axis=-1)
            gh = jnp.split(h @ self.wh.value, 3, axis=-1)
            return gx, gh
        n = self.n
        wx, wh, b = self.wx.value, self.wh.value, self.b.value
        gx = [x @ wx[:, k * n : (k + 1) * n] + b[k * n : (k + 1) * n] for k in range(3)]
        gh = [h @ wh[:, k * n : (k + 1) * n] for k in range(3)]
        return gx, gh

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        (xr, xz, xn), (hr, hz, hn) = self._gates(jnp.asarray(x), h)
        r = jax.nn.sigmoid(xr + hr)
        z = jax.nn.sigmoid(xz + hz)
        cand = jnp.tanh(xn + r * hn)
        new = (1.0 - z) * cand + z * h
        self.h.value = new
        return new


class FusedLSTM(brainstate.nn.Module):
    """An LSTM with one matmul on ``[x; h]`` for all four gates, then a split."""

    def __init__(self, n_in: int, n: int, fused: bool = True) -> None:
        super().__init__()
        self.n, self.fused = n, fused
        self.w = _param(4, (n_in + n, 4 * n))
        self.b = _param(5, (4 * n,))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.n))
        self.c = brainstate.HiddenState(jnp.zeros(self.n))

    def update(self, x: ArrayLike) -> Array:
        xh = jnp.concatenate([jnp.asarray(x), self.h.value], axis=-1)
        n = self.n
        if self.fused:
            i, g, f, o = jnp.split(xh @ self.w.value + self.b.value, 4, axis=-1)
        else:
            w, b = self.w.value, self.b.value
            i, g, f, o = (xh @ w[:, k * n : (k + 1) * n] + b[k * n : (k + 1) * n] for k in range(4))
        c = jax.nn.sigmoid(f) * self.c.value + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        self.c.value = c
        self.h.value = h
        return h


@pytest.mark.parametrize("cls", [FusedGRU, FusedLSTM], ids=["GRU", "LSTM"])
def test_fused_gates_are_traced_part_by_part(cls: type[brainstate.nn.Module]) -> None:
    fused, split = cls(3, 4), cls(3, 4, fused=False)  # type: ignore[arg-type, call-arg]
    brainstate.nn.init_all_states(fused)
    brainstate.nn.init_all_states(split)
    x = jnp.zeros(3)
    graph = etrax.compile_etrace_graph(fused, x)
    assert not graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    assert any("fused gates" in r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED))
    # every part reaches a hidden state element-wise: every use is traced
    for path, status in graph.weight_rules().items():
        assert status.rule is etrax.WeightRule.TRACED, (path, status)
    n_parts = 6 if cls is FusedGRU else 4
    assert len(graph.hidden_param_op_relations) == n_parts
    xs, ys = _sequence((3,), (4,), 8, seed=5)
    _learns_like_gate_by_gate(graph, fused, split, xs, ys)


def _learns_like_gate_by_gate(
    graph: etrax.ETraceGraph,
    fused: brainstate.nn.Module,
    split: brainstate.nn.Module,
    xs: Array,
    ys: Array,
) -> None:
    """Every rule equals BPTT at T = 1 on the fused model, and over the whole sequence
    D-RTRL learns the fused model exactly as the gate-by-gate one."""
    state = etrax.state_of(graph)
    exact = bptt_grads(fused, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs[:1], ys[:1])), exact)
    g_split = etrax.compile_etrace_graph(split, xs[0])
    _close(
        dict(_online(graph, etrax.DRTRL(), xs, ys)), dict(_online(g_split, etrax.DRTRL(), xs, ys))
    )


class SummedGates(brainstate.nn.Module):
    """An LSTM or GRU written as in most JAX code: the products of the input and of the
    hidden state summed, a bias (and, with ``gain``, a learned gain) added after the
    sum, and only then the result cut into gates, ``split(x @ Wx + h @ Wh + b, k)``;
    with ``fused=False``, the same model gate by gate."""

    def __init__(self, kind: str, n_in: int, n: int, fused: bool = True, gain: bool = False):
        super().__init__()
        self.kind, self.n, self.fused, self.gain = kind, n, fused, gain
        k = 4 if kind == "lstm" else 2
        self.wx = _param(11, (n_in, k * n))
        self.wh = _param(12, (n, k * n))
        self.b = _param(13, (k * n,))
        if gain:
            self.g = brainstate.ParamState(
                1.0 + 0.2 * jax.random.normal(jax.random.key(14), (k * n,))
            )

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape))
        if self.kind == "lstm":
            self.c = brainstate.HiddenState(jnp.zeros(shape))

    def _gates(self, x: Array, h: Array) -> list[Array]:
        wx, wh, b = self.wx.value, self.wh.value, self.b.value
        g = self.g.value if self.gain else None
        k = 4 if self.kind == "lstm" else 2
        if self.fused:
            s = x @ wx + h @ wh + b
            return jnp.split(s if g is None else s * g, k, axis=-1)
        n = self.n
        parts = []
        for j in range(k):
            cols = slice(j * n, (j + 1) * n)
            s = x @ wx[:, cols] + h @ wh[:, cols] + b[cols]
            parts.append(s if g is None else s * g[cols])
        return parts

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        if self.kind == "lstm":
            i, f, g, o = self._gates(jnp.asarray(x), h)
            c = jax.nn.sigmoid(f) * self.c.value + jax.nn.sigmoid(i) * jnp.tanh(g)
            self.c.value = c
            self.h.value = jax.nn.sigmoid(o) * jnp.tanh(c)
        else:
            z, cand = (jax.nn.sigmoid(a) for a in self._gates(jnp.asarray(x), h))
            self.h.value = z * h + (1.0 - z) * jnp.tanh(cand)
        return self.h.value


@pytest.mark.parametrize(
    ("kind", "gain", "batch"),
    [("lstm", False, None), ("gru", True, None), ("lstm", True, 2)],
    ids=["lstm", "gru-gain", "lstm-gain-b2"],
)
def test_gates_cut_after_a_sum_of_products_are_traced(
    kind: str, gain: bool, batch: int | None
) -> None:
    """``split(x @ Wx + h @ Wh + b, k)``: both products are cut part by part, the bias
    (and gain) after the sum becomes an element-wise op per part; the model learns as
    its gate-by-gate form does. Before, neither product was cut, no weight reached a
    hidden state element-wise, and compiling the model was refused."""
    fused = SummedGates(kind, 3, 4, gain=gain)
    split = SummedGates(kind, 3, 4, fused=False, gain=gain)
    brainstate.nn.init_all_states(fused, batch_size=batch)
    brainstate.nn.init_all_states(split, batch_size=batch)
    x = jnp.zeros(3 if batch is None else (batch, 3))
    graph = etrax.compile_etrace_graph(fused, x)
    k = 4 if kind == "lstm" else 2
    for path, status in graph.weight_rules().items():
        assert status.rule is etrax.WeightRule.TRACED, (path, status)
        assert len(status.uses) == k, (path, status)  # one traced use per gate
    products = [
        r for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED) if r.primitive == "dot_general"
    ]
    assert [r.context_dict["parts"] for r in products] == [k, k]
    assert len(graph.hidden_param_op_relations) == k * (4 if gain else 3)
    xs, ys = _sequence(x.shape, (*x.shape[:-1], 4), 6, seed=9)
    _learns_like_gate_by_gate(graph, fused, split, xs, ys)


class WholeToo(SummedGates):
    """`SummedGates` whose summed products are also used whole: in a sum over the
    features added to every gate, with ``running=True`` also in a running mean kept
    in a hidden state of the sum's width."""

    def __init__(self, kind: str, n_in: int, n: int, running: bool = False) -> None:
        super().__init__(kind, n_in, n)
        self.running = running

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        super().init_state(batch_size)
        if self.running:
            self.m = brainstate.HiddenState(jnp.zeros(4 * self.n))

    def _gates(self, x: Array, h: Array) -> list[Array]:
        s = x @ self.wx.value + h @ self.wh.value + self.b.value
        if self.running:
            self.m.value = 0.9 * self.m.value + 0.1 * s
        return [a + 0.01 * jnp.sum(s) for a in jnp.split(s, 4, axis=-1)]


def _every_rule_is_exact_at_one_step(model: brainstate.nn.Module, graph: etrax.ETraceGraph) -> None:
    xs, ys = _sequence((3,), (4,), 1, seed=9)
    exact = bptt_grads(model, etrax.state_of(graph), xs, ys, sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs, ys)), exact)


def test_gates_whose_sum_is_also_used_whole_are_cut() -> None:
    """The summed products are cut into the gates although they are also used whole
    (in a sum over the features): the whole sum (16 wide) lines up with no hidden
    state (4 wide), the gates do. Each product and the bias is computed once per gate,
    the whole sum is the gates concatenated, and every weight reaches the hidden
    states through each gate (the sum over the features mixes positions: its part is
    learned from the instantaneous gradient). Before, nothing was cut and compiling
    the model for online learning was refused (no relations)."""
    model = WholeToo("lstm", 3, 4)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    products = [
        r for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED) if r.primitive == "dot_general"
    ]
    assert [r.context_dict["parts"] for r in products] == [4, 4]
    assert all("also used whole" in r.message for r in products)
    assert not graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    for path, status in graph.weight_rules().items():
        assert status.rule is etrax.WeightRule.PARTLY_TRACED, (path, status)
        assert len(status.uses) == 4, (path, status)
        assert {u.reason for u in status.uses} == {K.TAIL_MIXES_POSITIONS}, (path, status)
    _every_rule_is_exact_at_one_step(model, graph)


def test_a_sum_as_wide_as_a_hidden_state_is_not_cut() -> None:
    """The negative control: with a hidden state as wide as the summed products (a
    running mean of them), the whole sum lines up with that state, and cutting it
    could lose that relation; nothing is cut, the products are traced into the
    running mean, and reach the gates' states only with their instantaneous
    gradient (the whole sum is wider than those states)."""
    model = WholeToo("lstm", 3, 4, running=True)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert not any("fused gates" in r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED))
    reached = {p for r in graph.hidden_param_op_relations for p in r.connected_hidden_paths}
    assert reached == {("m",)}
    assert graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    _every_rule_is_exact_at_one_step(model, graph)


class WholeAtTheOutput(brainstate.nn.Module):
    """Two gates cut from one product of the input, ``a, b = split(x @ W + c)``, in an
    element-wise recurrence; the whole product also reaches the output (but no hidden
    state), so it is used whole too."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.w = _param(31, (n_in, 2 * n))
        self.c = _param(32, (2 * n,), scale=0.1)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: ArrayLike) -> Array:
        g = jnp.asarray(x) @ self.w.value + self.c.value
        a, b = jnp.split(g, 2, axis=-1)
        self.h.value = jax.nn.sigmoid(a) * self.h.value + jnp.tanh(b)
        return self.h.value + 0.1 * jnp.sum(g, axis=-1, keepdims=True)


@pytest.mark.parametrize("batch", [None, 2])
def test_a_product_also_used_whole_at_the_output_is_exact(batch: int | None) -> None:
    """The parts of a product that is also used whole, at the output only, reach the
    hidden state element-wise (the output's direct use gets its exact instantaneous
    gradient): D-RTRL is exact over the whole sequence (an element-wise recurrence fed
    by the input), and every rule equals BPTT at T = 1. Before, the product was not cut
    and its weights learned only from the instantaneous gradient."""
    model = WholeAtTheOutput(3, 4)
    brainstate.nn.init_all_states(model, batch_size=batch)
    x = jnp.zeros(3 if batch is None else (batch, 3))
    graph = etrax.compile_etrace_graph(model, x)
    for path, status in graph.weight_rules().items():
        # traced through each gate, and the exact instantaneous gradient of the output
        assert status.rule is etrax.WeightRule.PARTLY_TRACED, (path, status)
        assert len(status.uses) == 2, (path, status)
        assert {u.reason for u in status.uses} == {K.RELATION_UNTRACED_ROUTE}, (path, status)
    assert len(graph.hidden_param_op_relations) == 2
    assert not graph.explain(kind=K.TAIL_MIXES_POSITIONS)
    xs, ys = _sequence(x.shape, (*x.shape[:-1], 4), 6, seed=3)
    state = etrax.state_of(graph)
    _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), bptt_grads(model, state, xs, ys, sq))
    exact = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs[:1], ys[:1])), exact)


class LayerNormLSTM(brainstate.nn.Module):
    """A layer-normalised LSTM (Ba et al., 2016) written with brainstate's layers: one
    `Linear` on ``[x; h]`` for the four gates, a `LayerNorm` over all of them, then the
    split."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        brainstate.random.seed(41)
        self.n = n
        self.w = brainstate.nn.Linear(n_in + n, 4 * n)
        self.ln = brainstate.nn.LayerNorm(4 * n, dtype=brainstate.environ.dftype())
        # brainstate 0.5.4's normalisation layers promote their statistics' dtype with
        # float32, which the suite's strict promotion refuses in float64: the test runs
        # under standard promotion

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape))
        self.c = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: ArrayLike) -> Array:
        xh = jnp.concatenate([jnp.asarray(x), self.h.value], axis=-1)
        i, f, g, o = jnp.split(self.ln(self.w(xh)), 4, axis=-1)
        c = jax.nn.sigmoid(f) * self.c.value + jax.nn.sigmoid(i) * jnp.tanh(g)
        self.c.value = c
        self.h.value = jax.nn.sigmoid(o) * jnp.tanh(c)
        return self.h.value


def test_a_layer_norm_over_fused_gates_is_traced() -> None:
    """`LayerNorm` over the four gates' product: the product is cut into the gates
    although the norm reads it whole (the parts concatenated), and the norm's scale
    and bias act on each gate as element-wise weights. Every weight is traced (the
    norm's statistics mix positions: that part of the product's weight is learned from
    the instantaneous gradient), and every rule equals BPTT at T = 1. Before, no
    weight was traced and online learning refused the model."""
    with jax.numpy_dtype_promotion("standard"):  # see `LayerNormLSTM`
        model = LayerNormLSTM(3, 4)
        brainstate.nn.init_all_states(model)
        graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
        rules = {path: status.rule for path, status in graph.weight_rules().items()}
        assert rules == {
            ("w", "weight"): etrax.WeightRule.PARTLY_TRACED,
            ("ln", "weight"): etrax.WeightRule.TRACED,
        }
        _every_rule_is_exact_at_one_step(model, graph)


class SubSteppedGates(brainstate.nn.Module):
    """A cell integrated with sub-steps, its input's product computed once per step
    before the loop: ``gx = x @ W``, then ``steps`` sub-steps that each cut
    ``gx + h @ U`` into two gates; with ``fused=False``, the same model gate by gate
    (each gate's slice of ``W`` and ``U`` multiplied on its own)."""

    def __init__(self, n_in: int, n: int, steps: int = 3, fused: bool = True) -> None:
        super().__init__()
        self.n, self.steps, self.fused = n, steps, fused
        self.w = _param(41, (n_in, 2 * n))
        self.u = _param(42, (n, 2 * n), scale=0.3)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.n))

    def update(self, x: ArrayLike) -> Array:
        n, w, u = self.n, self.w.value, self.u.value
        if self.fused:
            gx = jnp.asarray(x) @ w
        else:
            gx_a, gx_b = jnp.asarray(x) @ w[:, :n], jnp.asarray(x) @ w[:, n:]

        def sub_step(_: Array, h: Array) -> Array:
            if self.fused:
                a, b = jnp.split(gx + h @ u, 2, axis=-1)
            else:
                a, b = gx_a + h @ u[:, :n], gx_b + h @ u[:, n:]
            return jax.nn.sigmoid(a) * h + 0.5 * jnp.tanh(b)

        self.h.value = jax.lax.fori_loop(0, self.steps, sub_step, self.h.value)
        return self.h.value


def test_a_product_before_a_loop_of_sub_steps_is_cut_into_its_gates() -> None:
    """``x @ W`` computed before the loop is cut into the two gates once, and every
    sub-step reads its parts: ``W`` reaches the state through each gate (the later
    sub-steps' products in between are learned from the instantaneous gradient, as
    for ``U``), with no position-mixing tail; each product is recorded once, not
    once per sub-step; every rule equals BPTT at T = 1, and over a sequence D-RTRL
    learns the model exactly as the gate-by-gate one. Before, ops were recognised per
    loop body, where ``x @ W`` is an input, and ``W`` was not traced."""
    model = SubSteppedGates(3, 4)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    w = graph.weight_rules()[("w",)]
    assert w.rule is etrax.WeightRule.PARTLY_TRACED, w
    assert [use.reason for use in w.uses] == [K.RELATION_PARTIAL_PATH] * 2, w
    assert not graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    assert not graph.explain(kind=K.TAIL_MIXES_POSITIONS)
    products = [
        r for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED) if r.primitive == "dot_general"
    ]
    assert [r.context_dict["parts"] for r in products] == [2, 2]
    assert "several cut values read" in products[0].message
    # the product's value whole is read by no one: its concatenation is not kept
    names = [e.primitive.name for e in graph.module_info.jaxpr.eqns]
    assert "concatenate" not in names
    split = SubSteppedGates(3, 4, fused=False)
    brainstate.nn.init_all_states(split)
    xs, ys = _sequence((3,), (4,), 6, seed=4)
    _learns_like_gate_by_gate(graph, model, split, xs, ys)


def test_a_loop_of_sub_steps_kept_whole_leaves_the_product_untraced() -> None:
    """The negative control: with `CompilePolicy.unroll_limit` below the loop's length
    the loop stays whole, ``x @ W`` is not cut (its width lines up with no state) and
    ``W`` gets its exact instantaneous gradient only (so does ``U``, read inside the
    loop: the graph has no relation at all, and says which loop to unroll)."""
    model = SubSteppedGates(3, 4)
    brainstate.nn.init_all_states(model)
    policy = etrax.CompilePolicy(unroll_limit=2)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3), policy=policy)
    w = graph.weight_rules()[("w",)]
    assert w.rule is etrax.WeightRule.INSTANTANEOUS, w
    assert [use.reason for use in w.uses] == [K.RELATION_EXCLUDED_SHAPE_MISMATCH], w
    assert not graph.hidden_param_op_relations
    assert len(graph.explain(kind=K.LOOP_KEPT_WHOLE)) == 1
    with pytest.raises(etrax.CompilationError, match="unroll_limit"):
        _online(graph, etrax.DRTRL(), jnp.zeros((1, 3)), jnp.zeros((1, 4)))


class SlicedLSTM(brainstate.nn.Module):
    """An LSTM written with its gates' sum cut twice, as hand-written LSTMs often are:
    ``g = x @ W + h @ U + b``, then (``spelling``) ``"split"``: ``i, f, o`` the
    sigmoids of ``split(g[..., :3n], 3)``; ``"slice"``: ``i, f, o =
    split(sigmoid(g[..., :3n]), 3)``; ``"whole"``: ``s = sigmoid(g)`` and ``i, f, o``
    sliced from it; ``"reshape"``: ``i, f, o`` from ``sigmoid(g[..., :3n])``
    reshaped to ``(3, n)`` (a cut that is no split along the features); the cell's
    ``tanh(g[..., 3n:])`` in each. With ``fused=False``, the same model gate by gate."""

    def __init__(self, spelling: str, n_in: int, n: int, fused: bool = True) -> None:
        super().__init__()
        self.spelling, self.n, self.fused = spelling, n, fused
        self.w = _param(51, (n_in, 4 * n))
        self.u = _param(52, (n, 4 * n), scale=0.3)
        self.b = _param(53, (4 * n,), scale=0.1)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.n))
        self.c = brainstate.HiddenState(jnp.zeros(self.n))

    def _gates(self, x: Array, h: Array) -> tuple[Array, Array, Array, Array]:
        n, w, u, b = self.n, self.w.value, self.u.value, self.b.value
        if not self.fused:
            cols = [slice(k * n, (k + 1) * n) for k in range(4)]
            i, f, o, c = (x @ w[:, j] + h @ u[:, j] + b[j] for j in cols)
            return jax.nn.sigmoid(i), jax.nn.sigmoid(f), jax.nn.sigmoid(o), jnp.tanh(c)
        g = x @ w + h @ u + b
        if self.spelling == "split":
            i, f, o = (jax.nn.sigmoid(v) for v in jnp.split(g[..., : 3 * n], 3, axis=-1))
        elif self.spelling == "slice":
            i, f, o = jnp.split(jax.nn.sigmoid(g[..., : 3 * n]), 3, axis=-1)
        elif self.spelling == "whole":
            s = jax.nn.sigmoid(g)
            i, f, o = s[..., :n], s[..., n : 2 * n], s[..., 2 * n : 3 * n]
        else:
            i, f, o = jax.nn.sigmoid(g[..., : 3 * n]).reshape(3, n)
        return i, f, o, jnp.tanh(g[..., 3 * n :])

    def update(self, x: ArrayLike) -> Array:
        i, f, o, cell = self._gates(jnp.asarray(x), self.h.value)
        self.c.value = f * self.c.value + i * cell
        self.h.value = o * jnp.tanh(self.c.value)
        return self.h.value


@pytest.mark.parametrize("spelling", ["split", "slice", "whole"])
def test_gates_cut_again_after_a_first_cut_are_traced(spelling: str) -> None:
    """The gates' sum is computed in pieces fine enough for every later cut: the
    sigmoid's three gates, cut after a first cut (``g[..., :3n]``) or after the
    sigmoid of the whole sum, read the pieces, one per gate. Every weight is traced
    through every gate, with no position-mixing tail; every rule equals BPTT at
    T = 1, and over a sequence D-RTRL learns the model exactly as the gate-by-gate
    one. Before, the three gates were one ``3n``-wide op that lines up with no state
    (``"split"``, ``"slice"``), or the sigmoid of the pieces concatenated
    (``"whole"``: a mixing tail)."""
    model = SlicedLSTM(spelling, 3, 4)
    products = _wholly_traced_like_gate_by_gate(model, SlicedLSTM(spelling, 3, 4, False), 4)
    assert len(products) == 2


def _wholly_traced_like_gate_by_gate(
    model: brainstate.nn.Module, split: brainstate.nn.Module, parts: int
) -> list[CompilationRecord]:
    """`model` (3 inputs, 4 outputs) has every weight traced, no position-mixing tail
    or transition, and every product cut in `parts`, and learns like `split`
    (`_learns_like_gate_by_gate`);
    returns the products' records."""
    brainstate.nn.init_all_states(model)
    brainstate.nn.init_all_states(split)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    for path, status in graph.weight_rules().items():
        assert status.rule is etrax.WeightRule.TRACED, (path, status)
    assert not graph.explain(kind=K.TAIL_MIXES_POSITIONS)
    assert not graph.explain(kind=K.TRANSITION_MIXES_POSITIONS)
    assert not graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH)
    products = [
        r for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED) if r.primitive == "dot_general"
    ]
    assert [r.context_dict["parts"] for r in products] == [parts] * len(products)
    xs, ys = _sequence((3,), (4,), 6, seed=8)
    _learns_like_gate_by_gate(graph, model, split, xs, ys)
    return products


def test_a_part_cut_otherwise_keeps_its_width() -> None:
    """The negative control: the three gates taken from ``sigmoid(g[..., :3n])`` by a
    reshape, not by a split along the features, ask for no finer pieces; that part
    stays one ``3n``-wide op, which lines up with no state (its weights' share is
    learned from the instantaneous gradient), while the cell's part is traced."""
    model = SlicedLSTM("reshape", 3, 4)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    for path, status in graph.weight_rules().items():
        assert status.rule is etrax.WeightRule.PARTLY_TRACED, (path, status)
        reasons = [use.reason for use in status.uses]
        assert K.RELATION_EXCLUDED_SHAPE_MISMATCH in reasons, (path, status)
    products = [
        r for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED) if r.primitive == "dot_general"
    ]
    assert [r.context_dict["parts"] for r in products] == [2, 2]
    _every_rule_is_exact_at_one_step(model, graph)


class CutAgainButWhole(brainstate.nn.Module):
    """``p = g[..., :2n]`` (``g = x @ W``) as wide as the state ``h2`` that reads
    ``tanh(p)`` whole; ``tanh(p)`` is cut in two as well, for ``h``."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.w = _param(61, (n_in, 3 * n))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h2 = brainstate.HiddenState(jnp.zeros(2 * self.n))
        self.h = brainstate.HiddenState(jnp.zeros(self.n))

    def update(self, x: ArrayLike) -> Array:
        g = jnp.asarray(x) @ self.w.value
        t = jnp.tanh(g[..., : 2 * self.n])
        a, b = jnp.split(t, 2, axis=-1)
        self.h2.value = 0.5 * self.h2.value + t
        self.h.value = a * self.h.value + b + jax.nn.sigmoid(g[..., 2 * self.n :])
        return self.h.value


def test_a_later_cut_that_cannot_be_taken_leaves_the_first_cut_as_it_was() -> None:
    """A later cut asks for finer pieces only where a region takes it: here
    ``tanh(p)`` is read whole by a state as wide as it, so it is not cut, and ``g``
    keeps its two parts, ``p`` one op that lines up with ``h2`` (no concatenation of
    finer pieces, which would mix positions)."""
    model = CutAgainButWhole(3, 4)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    (product,) = graph.explain(kind=K.WEIGHT_OP_RECOGNISED)
    assert product.context_dict["parts"] == 2
    assert not graph.explain(kind=K.TAIL_MIXES_POSITIONS)
    reached = {p for r in graph.hidden_param_op_relations for p in r.connected_hidden_paths}
    assert reached == {("h",), ("h2",)}
    _every_rule_is_exact_at_one_step(model, graph)


class TwoActivations(brainstate.nn.Module):
    """``g = x @ W + h @ U``, then ``a, b = split(sigmoid(g))`` and ``c, d =
    split(tanh(g))``: one sum that two values cut later are computed from; with
    ``fused=False``, the same model gate by gate."""

    def __init__(self, n_in: int, n: int, fused: bool = True) -> None:
        super().__init__()
        self.n, self.fused = n, fused
        self.w = _param(71, (n_in, 2 * n))
        self.u = _param(72, (n, 2 * n), scale=0.3)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.n))

    def update(self, x: ArrayLike) -> Array:
        x, h, n = jnp.asarray(x), self.h.value, self.n
        w, u = self.w.value, self.u.value
        if self.fused:
            g = x @ w + h @ u
            a, b = jnp.split(jax.nn.sigmoid(g), 2, axis=-1)
            c, d = jnp.split(jnp.tanh(g), 2, axis=-1)
        else:
            g1, g2 = x @ w[:, :n] + h @ u[:, :n], x @ w[:, n:] + h @ u[:, n:]
            a, b, c, d = jax.nn.sigmoid(g1), jax.nn.sigmoid(g2), jnp.tanh(g1), jnp.tanh(g2)
        self.h.value = a * h + b * d + 0.1 * c
        return self.h.value


def test_a_sum_that_two_cut_values_are_computed_from_is_cut() -> None:
    """The sum is not cut itself, but both values computed from it are, at the same
    bounds: it is computed in those pieces, once, and both cut values read them.
    Every weight is traced, with no position-mixing tail; every rule equals BPTT at
    T = 1, and over a sequence D-RTRL learns the model exactly as the gate-by-gate
    one. Before, nothing was cut, no weight was traced and online rules refused the
    model (no relations)."""
    model = TwoActivations(3, 4)
    products = _wholly_traced_like_gate_by_gate(model, TwoActivations(3, 4, fused=False), 2)
    assert len(products) == 2
    assert all("several cut values read" in r.message for r in products)


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "softplus": jax.nn.softplus,
    "log_sigmoid": jax.nn.log_sigmoid,
    "logaddexp": lambda g: jnp.logaddexp(g, 0.3),
    "max": lambda g: jnp.maximum(g, 0.0),
}
"""Activations before a cut. All but ``max`` are ``custom_jvp`` functions in JAX
(`jnp.logaddexp` with a constant operand, inside `jax.nn.softplus` and
`jax.nn.log_sigmoid` after a jit); ``max`` is a plain primitive, the ReLU without its
rule for the derivative at 0."""


class ActivatedGates(brainstate.nn.Module):
    """``a, b = split(act(x @ W + h @ U + c), 2)`` and ``h ← ½ tanh(a) h + tanh(b)``;
    with ``fused=False``, the same model gate by gate (``act`` on each gate's own sum)."""

    def __init__(
        self, act: str | Callable[[Array], Array], n_in: int, n: int, fused: bool = True
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act] if isinstance(act, str) else act
        self.n, self.fused = n, fused
        self.w = _param(81, (n_in, 2 * n))
        self.u = _param(82, (n, 2 * n), scale=0.3)
        self.c = brainstate.ParamState(jnp.zeros(2 * n))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.n))

    def update(self, x: ArrayLike) -> Array:
        x, h, n = jnp.asarray(x), self.h.value, self.n
        w, u, c = self.w.value, self.u.value, self.c.value
        if self.fused:
            a, b = jnp.split(self.act(x @ w + h @ u + c), 2, axis=-1)
        else:
            a = self.act(x @ w[:, :n] + h @ u[:, :n] + c[:n])
            b = self.act(x @ w[:, n:] + h @ u[:, n:] + c[n:])
        self.h.value = 0.5 * jnp.tanh(a) * h + jnp.tanh(b)
        return self.h.value


@pytest.mark.parametrize("act", ["relu", "relu6", "softplus", "log_sigmoid", "logaddexp"])
def test_a_custom_jvp_activation_before_a_cut_is_evaluated_part_by_part(act: str) -> None:
    """An element-wise ``custom_jvp`` activation (`jax.nn.relu`, `jax.nn.softplus`, …)
    between the products and the cut is evaluated on each gate's part with its own
    JVP rule, as `jax.nn.sigmoid` is: every weight traced, no position-mixing tail,
    each product cut in 2; every rule equals BPTT at T = 1, and D-RTRL over a sequence
    learns the model exactly as the gate-by-gate one. Before, the activation was read
    whole and the 8-wide sum lined up with no state (every weight only instantaneous,
    ``relation_excluded_shape_mismatch``)."""
    model = ActivatedGates(act, 3, 4)
    _wholly_traced_like_gate_by_gate(model, ActivatedGates(act, 3, 4, fused=False), 2)


def test_a_custom_jvp_rule_is_kept_on_the_parts() -> None:
    """The parts keep the call's own derivative: from a zero state, input and bias the
    sum is exactly 0, where `jax.nn.relu`'s rule gives 0 and the plain ``max`` ½. Both
    fused models equal BPTT at T = 1 (relu: a zero bias gradient), and the two
    gradients differ, so the check would see the rule lost."""
    xs, ys = jnp.zeros((1, 3)), jnp.ones((1, 4))
    grads = {}
    for act in ("relu", "max"):
        model = ActivatedGates(act, 3, 4)
        brainstate.nn.init_all_states(model)
        graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
        assert all(s.rule is etrax.WeightRule.TRACED for s in graph.weight_rules().values())
        exact = bptt_grads(model, etrax.state_of(graph), xs, ys, sq)
        for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
            _close(dict(_online(graph, algo, xs, ys)), exact)
        grads[act] = np.asarray(exact[("c",)])
    assert not np.any(grads["relu"])
    assert np.all(grads["max"][4:] != 0.0)


@jax.custom_jvp
def _centred(g: Array) -> Array:
    """``g`` less its mean over the features: a ``custom_jvp`` call that mixes them."""
    return g - jnp.mean(g, axis=-1, keepdims=True)


@_centred.defjvp
def _centred_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    return _centred(primals[0]), _centred(tangents[0])


_GAINS = jnp.linspace(0.5, 1.5, 8)


@jax.custom_jvp
def _gained(g: Array) -> Array:
    """``g`` times a constant gain per feature: element-wise, but the constant has the
    whole shape (8 features), so the call cannot be evaluated on a part of them."""
    return g * _GAINS


@_gained.defjvp
def _gained_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    return _gained(primals[0]), tangents[0] * _GAINS


@pytest.mark.parametrize("act", ["centred", "gained"])
def test_a_custom_jvp_call_that_cannot_be_cut_is_read_whole(act: str) -> None:
    """The negative controls: a ``custom_jvp`` call that mixes the features (``g``
    less its mean), or holds a constant of their whole width (a gain per feature), is
    not evaluated part by part, and nothing is cut: the 8-wide sum lines up with no
    state (``relation_excluded_shape_mismatch``), every weight is learned from its
    instantaneous gradient, and online rules refuse the model (no relations) with
    etrax's error, as they did for every ``custom_jvp`` activation before."""
    model = ActivatedGates(_centred if act == "centred" else _gained, 3, 4)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert not graph.hidden_param_op_relations
    for path in (("w",), ("u",), ("c",)):
        status = graph.weight_rules()[path]
        assert status.reason is K.RELATION_EXCLUDED_SHAPE_MISMATCH, (path, status)
    for r in graph.explain(kind=K.RELATION_EXCLUDED_SHAPE_MISMATCH):
        assert "wider than the group's last axis" in r.message, r.message
    with pytest.raises(etrax.CompilationError, match="no relations"):
        _online(graph, etrax.DRTRL(), *_sequence((3,), (4,), 1))


class JoinedStateGates(brainstate.nn.Module):
    """A GRU with one recurrent weight per unit and gate (as in IndRNN):
    ``z, r, c = split(x @ W + join(h) * u + b, 3)`` and
    ``h ← z h + (1 − z) tanh(c + r h)``, where ``join(h)`` is the state three times
    along its features (``jnp.concatenate([h] * 3)`` or ``jnp.tile``); ``"split"``
    is the same model gate by gate, and ``"rotated"`` the negative control, whose
    ``join`` is ``concatenate([h] * 4)[..., 1 : 3n + 1]``: the state rotated by one
    unit, three times, so that each unit's gates read its neighbour."""

    def __init__(self, join: str, n_in: int, n: int) -> None:
        super().__init__()
        self.join, self.n = join, n
        self.w = _param(91, (n_in, 3 * n))
        self.u = _param(92, (3 * n,), scale=0.8)
        self.b = _param(93, (3 * n,), scale=0.1)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def _joined(self, h: Array) -> Array:
        n = self.n
        if self.join == "concatenate":
            return jnp.concatenate([h] * 3, axis=-1)
        if self.join == "tile":
            return jnp.tile(h, (1,) * (h.ndim - 1) + (3,))
        return jnp.concatenate([h] * 4, axis=-1)[..., 1 : 3 * n + 1]  # "rotated"

    def update(self, x: ArrayLike) -> Array:
        x, h, n = jnp.asarray(x), self.h.value, self.n
        w, u, b = self.w.value, self.u.value, self.b.value
        if self.join == "split":
            z, r, c = (x @ w[:, k * n : (k + 1) * n] + h * u[k * n : (k + 1) * n]
                       + b[k * n : (k + 1) * n] for k in range(3))  # fmt: skip
        else:
            z, r, c = jnp.split(x @ w + self._joined(h) * u + b, 3, axis=-1)
        z, r = jax.nn.sigmoid(z), jax.nn.sigmoid(r)
        self.h.value = z * h + (1 - z) * jnp.tanh(c + r * h)
        return self.h.value


@pytest.mark.parametrize("join", ["concatenate", "tile"])
def test_gates_on_a_state_joined_to_itself_keep_positions_apart(join: str) -> None:
    """Each gate's part of ``join(h) * u`` reads ``h`` itself (the part of the join it
    lies in), so the transition keeps positions apart: no ``transition_mixes_positions``
    warning, every weight traced, each product cut in 3, every rule equal to BPTT at
    T = 1 (also with a batch), and D-RTRL learning exactly as the gate-by-gate model.
    Before, each part read a slice of the 3n-wide join, which the position analysis
    took for a mix of positions: the warning ("gradients approximate") and ``D``
    formed from the whole Jacobian at every step."""
    _wholly_traced_like_gate_by_gate(
        JoinedStateGates(join, 3, 4), JoinedStateGates("split", 3, 4), 3
    )
    model = JoinedStateGates(join, 3, 4)
    brainstate.nn.init_all_states(model, batch_size=2)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((2, 3)))
    assert not graph.explain(kind=K.TRANSITION_MIXES_POSITIONS)
    xs, ys = _sequence((2, 3), (2, 4), 1, seed=4)
    exact = bptt_grads(model, etrax.state_of(graph), xs, ys, sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs, ys)), exact)


def test_a_part_across_the_pieces_of_a_join_still_mixes_positions() -> None:
    """The negative control: gates on the state rotated by one unit (each part of the
    join spans two of its pieces) read a neighbour's value, and the transition is still
    reported as mixing positions, with ``D`` from the whole Jacobian; every rule is
    exact at T = 1, as for any accepted model."""
    model = JoinedStateGates("rotated", 3, 4)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    (mixing,) = graph.explain(kind=K.TRANSITION_MIXES_POSITIONS)
    assert "concatenate joins along a position axis" in mixing.message, mixing.message
    _every_rule_is_exact_at_one_step(model, graph)


def test_values_left_unused_do_not_change_what_is_traced() -> None:
    """Dead code, a value computed from the summed products and never read (here a
    second split of ``x @ Wx + b``), is not a use of its weights: the model is traced
    as without it (the same relations and weight rules) and learns like the
    gate-by-gate model."""

    class Dead(SummedGates):
        def _gates(self, x: Array, h: Array) -> list[Array]:
            _ = jnp.split(x @ self.wx.value + self.b.value, 2, axis=-1)  # never read
            return super()._gates(x, h)

    model, plain = Dead("gru", 3, 4), SummedGates("gru", 3, 4)
    brainstate.nn.init_all_states(model)
    brainstate.nn.init_all_states(plain)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    reference = etrax.compile_etrace_graph(plain, jnp.zeros(3))
    assert len(graph.hidden_param_op_relations) == len(reference.hidden_param_op_relations) > 0
    rules = {p: (r.rule, r.reason) for p, r in graph.weight_rules().items()}
    assert rules == {p: (r.rule, r.reason) for p, r in reference.weight_rules().items()}
    assert all(rule is etrax.WeightRule.TRACED for rule, _ in rules.values())
    xs, ys = _sequence((3,), (4,), 6, seed=9)
    split = SummedGates("gru", 3, 4, fused=False)
    brainstate.nn.init_all_states(split)
    _learns_like_gate_by_gate(graph, model, split, xs, ys)


class SparseRecurrence(brainstate.nn.Module):
    """A recurrent weight in CSR form, ``h ← tanh(Linear(x) + SparseLinear(h))``: the
    CSR product's primitive has no batching rule, so `jax.vmap` cannot map it."""

    def __init__(self) -> None:
        super().__init__()
        dense = (
            0.8
            * jax.random.normal(jax.random.key(21), (4, 4))
            * jnp.eye(4)[jnp.array([1, 2, 3, 0])]
        )
        self.lx = brainstate.nn.Linear(3, 4)
        self.rec = brainstate.nn.SparseLinear(u.sparse.CSR.fromdense(dense))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((4,) if batch_size is None else (batch_size, 4)))

    def update(self, x: ArrayLike) -> Array:
        h: Array = jnp.tanh(self.lx(x) + self.rec(self.h.value))
        self.h.value = h
        return h


@pytest.mark.parametrize("batch", [None, 2], ids=lambda v: f"batch={v}")
def test_a_primitive_without_a_batching_rule_in_the_recurrence(batch: int | None) -> None:
    """The Jacobians etrax takes through the step (the transition's, its diagonal, the
    deferred instantaneous gradients) fall back from `jax.vmap` to `jax.lax.map` when
    a primitive of the step has no batching rule. Before, the first gradient call
    raised JAX's ``NotImplementedError`` (no batching rule for ``csr_matvec``)."""
    model = SparseRecurrence()
    lead = () if batch is None else (batch,)
    with pytest.raises(NotImplementedError, match="Batching rule"):  # the control
        jax.vmap(model.rec)(jnp.ones((2, *lead, 4)))
    brainstate.nn.init_all_states(model, batch_size=batch)
    xs, ys = _sequence((*lead, 3), (*lead, 4), 4, seed=2)
    graph = etrax.compile_etrace_graph(model, xs[0])
    assert graph.weight_rules()[("rec", "weight")].reason is K.WEIGHT_PLAIN_USE
    exact = bptt_grads(model, etrax.state_of(graph), xs[:1], ys[:1], sq)
    rules = (etrax.DRTRL(), etrax.DRTRL(chunk_steps=1), etrax.PPProp(0.9), etrax.EProp())
    for algo in rules:
        _close(dict(_online(graph, algo, xs[:1], ys[:1])), exact)
    for algo in (etrax.DRTRL(), etrax.PPProp(0.9)):  # the learner's path, over 4 steps
        learner = etrax.compile(model, algo, xs[0], batch_size=batch)
        grads = learner.etrace_grad(xs, ys, sq)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    if batch is None:  # a learner that maps the one-sample model over a batch cannot
        mapped = etrax.compile(model, etrax.DRTRL(), jnp.zeros((2, 3)), batch_size=2, vmap=True)
        xb, yb = _sequence((2, 3), (2, 4), 4, seed=3)
        with pytest.raises(etrax.NotSupportedError, match=r"no batching rule.*without vmap=True"):
            mapped.etrace_grad(xb, yb, sq)


def test_jacobians_and_maps_fall_back_to_lax_map_without_a_batching_rule() -> None:
    """`etrax._compat.jacobian` and `map_over` (the Jacobians etrax takes through a
    step) give `jax.jacfwd`'s and `jax.vmap`'s results for a function whose primitive
    (here `jax.experimental.sparse`'s ``csr_matvec``) has no batching rule."""
    from jax.experimental import sparse

    from etrax._compat import jacobian, map_over

    dense = jnp.arange(12.0).reshape(4, 3) / 7
    mat = sparse.CSR.fromdense(dense)  # type: ignore[no-untyped-call]  # unannotated in JAX

    def f(v: Array) -> Array:
        return jnp.tanh(mat @ v)

    def g(v: Array) -> Array:
        return jnp.tanh(dense @ v)

    v = jnp.linspace(-1.0, 1.0, 3)
    with pytest.raises(NotImplementedError, match="Batching rule"):  # the control
        jax.jacfwd(f)(v)
    np.testing.assert_allclose(jacobian(f, v), jax.jacfwd(g)(v), rtol=0, atol=1e-12)
    columns = jnp.arange(6.0).reshape(3, 2) / 5  # mapped along the last axis
    want = jax.vmap(g, in_axes=-1, out_axes=-1)(columns)
    np.testing.assert_allclose(map_over(f, columns, axis=-1, out_axis=-1), want, atol=1e-12)


# ----- control flow -------------------------------------------------------------------


class SubSteppedLIF(brainstate.nn.Module):
    """A leaky neuron integrated with `steps` Euler sub-steps inside ``update``."""

    def __init__(self, n_in: int, n: int, steps: int, use_scan: bool) -> None:
        super().__init__()
        self.n, self.steps, self.use_scan = n, steps, use_scan
        self.w = _param(6, (n_in, n))
        self.readout = _param(7, (n, 2))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(self.n))

    def update(self, x: ArrayLike) -> Array:
        i = jnp.asarray(x) @ self.w.value
        dt = 1.0 / self.steps

        def euler(v: Array) -> Array:
            return v + dt * 0.5 * (-v + jnp.tanh(i + v))

        if self.use_scan:
            v, _ = jax.lax.scan(lambda v, _: (euler(v), None), self.v.value, None, self.steps)
        else:
            v = jax.lax.fori_loop(0, self.steps, lambda k, v: euler(v), self.v.value)
        self.v.value = v
        y: Array = v @ self.readout.value
        return y


@pytest.mark.parametrize(("steps", "use_scan"), [(4, False), (40, True)], ids=["fori4", "scan40"])
def test_sub_stepped_neuron_is_diagonal_and_exact(steps: int, use_scan: bool) -> None:
    model = SubSteppedLIF(3, 4, steps, use_scan)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert not graph.explain(kind=K.TRANSITION_MIXES_POSITIONS)
    assert all(g.is_diagonal_recurrence for g in graph.hidden_groups)
    # a loop within CompilePolicy.unroll_limit (16) is unrolled; a longer one stays whole
    # and its element-wise body is recognised as diagonal through the scan position rule
    kept = [e for e in graph.module_info.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(kept) == (1 if steps > 16 else 0)
    xs, ys = _sequence((3,), (2,), 8, seed=6)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs, ys, sq)
    _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), exact, 1e-9)


class Branchy(brainstate.nn.Module):
    """An etrax op inside ``lax.cond`` (or the same as ``jnp.where``)."""

    def __init__(self, use_cond: bool) -> None:
        super().__init__()
        self.use_cond = use_cond
        self.fc = etrax.nn.Linear(3, 4)
        self.fc.weight.value = jax.tree.map(lambda a: a + 0.3, self.fc.weight.value)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        if self.use_cond:
            d: Array = jax.lax.cond(x[0] > 0, lambda v: self.fc(v), lambda v: -self.fc(v), x)
        else:
            d = jnp.where(x[0] > 0, self.fc(x), -self.fc(x))
        h = 0.6 * self.h.value + jnp.tanh(d)
        self.h.value = h
        return h


def test_etp_op_inside_cond_equals_the_where_form() -> None:
    with_cond, with_where = Branchy(True), Branchy(False)
    with_where.fc.weight.value = dict(with_cond.fc.weight.value)
    grads = []
    xs, ys = _sequence((3,), (4,), T, seed=7)
    for model in (with_cond, with_where):
        brainstate.nn.init_all_states(model)
        graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
        grads.append(dict(_online(graph, etrax.DRTRL(), xs, ys)))
    _close(grads[0], grads[1])


class WeightInWhile(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(8, (4, 4))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        def body(c: tuple[int, Array]) -> tuple[int, Array]:
            return c[0] + 1, jnp.tanh(c[1] @ self.w.value)

        _, h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, self.h.value + jnp.asarray(x)))
        self.h.value = h
        return h


def test_weight_inside_while_loop_is_a_typed_error() -> None:
    model = WeightInWhile()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.NotSupportedError, match=r"\('w',\).*while_loop") as info:
        etrax.compile_etrace_graph(model, jnp.zeros(4))
    assert info.value.records[-1].kind is K.PRIMITIVE_INSIDE_CONTROL_FLOW


class Nested(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _param(9, (3, 3))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(3))

    def update(self, x: ArrayLike) -> Array:
        def inner(k: Any, v: Array) -> Array:
            return jnp.tanh(v @ self.w.value)

        def outer(k: Any, v: Array) -> Array:
            out: Array = jax.lax.fori_loop(0, 16, inner, v)
            return out

        h: Array = jax.lax.fori_loop(0, 16, outer, self.h.value + jnp.asarray(x))
        self.h.value = h
        return h


def test_a_runaway_rewrite_is_a_typed_error() -> None:
    model = Nested()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.RewriteLimitError, match="unroll_limit"):
        etrax.compile_etrace_graph(
            model, jnp.zeros(3), policy=etrax.CompilePolicy(max_equations=500)
        )
    with pytest.raises(ValueError, match="unroll_limit"):
        etrax.CompilePolicy(unroll_limit=-1)


# ----- units ---------------------------------------------------------------------------


class UnitLIF(brainstate.nn.Module):
    """Conductance-input leaky neurons written with brainunit quantities."""

    def __init__(self, n_in: int, n: int, key: int) -> None:
        super().__init__()
        self.n = n
        self.w = brainstate.ParamState(
            0.8 * jax.random.normal(jax.random.PRNGKey(key), (n_in, n)) * u.nS
        )
        self.tau = 10.0 * u.ms
        self.e_syn = 20.0 * u.mV

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(self.n) * u.mV)

    def update(self, x: ArrayLike) -> Array:
        v = self.v.value
        g = u.math.matmul(jnp.asarray(x), self.w.value)
        dv = (-v + g * (self.e_syn - v) / (1.0 * u.nS)) / self.tau
        v = v + 1.0 * u.ms * dv
        self.v.value = v
        spike: Array = etrax.nn.spike(v / (5.0 * u.mV) - 1.0)
        return spike


class TwoLayerUnits(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = UnitLIF(3, 5, 10)
        self.l2 = UnitLIF(5, 4, 11)
        self.readout = brainstate.nn.Linear(4, 2)

    def update(self, x: ArrayLike) -> Array:
        y: Array = self.readout(self.l2(self.l1(x)))
        return y


def test_a_model_with_units_trains_and_gradients_carry_units() -> None:
    model = TwoLayerUnits()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    state = etrax.state_of(graph)
    assert u.get_unit(state.hidden[("l1", "v")]) == u.mV
    xs, ys = _sequence((3,), (2,), T, seed=8)
    xs = 3.0 * jnp.abs(xs)
    grads = _online(graph, etrax.DRTRL(), xs[:1], ys[:1])
    for path in (("l1", "w"), ("l2", "w")):
        assert u.get_unit(grads[path]) == u.nS, path
    _close(dict(grads), bptt_grads(model, state, xs[:1], ys[:1], sq))
    # the first layer's weight reaches only its own element-wise neurons: exact over T
    full = bptt_grads(model, state, xs, ys, sq)
    got = _online(graph, etrax.DRTRL(), xs, ys)
    _close(got[("l2", "w")], full[("l2", "w")], 1e-9)
    # and a training step keeps the units
    new_w = state.params[("l1", "w")] - 0.1 * grads[("l1", "w")]
    assert u.get_unit(new_w) == u.nS


class CurrentLIF(brainstate.nn.Module):
    """A current-based LIF in brainunit: a current ``I`` and a potential ``V`` in mV,
    a learned time constant in ms, and a spike read from the *new* potential (the
    Jacobians read the step's new hidden values)."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        self.n = n
        key = jax.random.PRNGKey(21)
        self.w = brainstate.ParamState(jax.random.normal(key, (n_in, n)))
        self.tau = brainstate.ParamState(jnp.linspace(2.0, 8.0, n) * u.ms)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.V = brainstate.HiddenState(jnp.zeros(shape) * u.mV)
        self.I = brainstate.HiddenState(jnp.zeros(shape) * u.mV)

    def update(self, x: ArrayLike) -> Array:
        current = 0.8 * self.I.value + (jnp.asarray(x) @ self.w.value) * u.mV
        V = self.V.value + 1.0 * u.ms / self.tau.value * (current - self.V.value)
        self.I.value = current
        self.V.value = V
        spike: Array = etrax.nn.spike((V - 1.0 * u.mV) / u.mV, etrax.nn.SigmoidGrad())
        return spike


@pytest.mark.parametrize("batch", [None, 2], ids=lambda v: f"batch={v}")
def test_hidden_states_with_units_read_after_the_update(batch: int | None) -> None:
    """Hidden values with units that the step reads after writing them (here the
    spike of the new potential) reach the Jacobians as plain mantissas: every rule
    equals BPTT at T = 1 and D-RTRL over the whole sequence (the neurons are
    element-wise), with the learned time constant traced."""
    model = CurrentLIF(2, 3)
    brainstate.nn.init_all_states(model, batch_size=batch)
    lead = () if batch is None else (batch,)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((*lead, 2)))
    assert graph.weight_rules()[("tau",)].rule is etrax.WeightRule.TRACED
    state = etrax.state_of(graph)
    xs, ys = _sequence((*lead, 2), (*lead, 3), T, seed=4)
    one = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for rule in (etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)):
        _close(dict(_online(graph, rule, xs[:1], ys[:1])), one)
    _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), bptt_grads(model, state, xs, ys, sq))


@pytest.mark.parametrize(
    "rule",
    [etrax.OSTLRecurrent(), etrax.SnAp(2), etrax.UORO(jax.random.key(0)), etrax.DRTRL()],
    ids=lambda r: r.name,
)
def test_rules_of_the_whole_transition_and_windows_run_with_units(
    rule: etrax.OnlineAlgorithm[Any],
) -> None:
    """Hidden states with units: the rules that follow the whole transition (its
    slabs are unit-free, the states keep their units) equal BPTT at T = 1, and a
    window as long as the sequence equals BPTT over it."""
    model = TwoLayerUnits()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    state = etrax.state_of(graph)
    xs, ys = _sequence((3,), (2,), T, seed=8)
    xs = 3.0 * jnp.abs(xs)
    _close(dict(_online(graph, rule, xs[:1], ys[:1])), bptt_grads(model, state, xs[:1], ys[:1], sq))
    whole = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ys, sq, window=T)
    _close(dict(whole.grads), bptt_grads(model, state, xs, ys, sq), 1e-9)


# ----- user position rules -------------------------------------------------------------


def _make_softsign() -> Any:
    from jax.extend.core import Primitive
    from jax.interpreters import ad, mlir

    prim = Primitive("test_softsign")
    prim.def_impl(lambda x: x / (1 + jnp.abs(x)))  # type: ignore[no-untyped-call]
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))  # type: ignore[no-untyped-call]
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x / (1 + jnp.abs(x)), False))
    ad.defjvp(prim, lambda g, x: g / (1 + jnp.abs(x)) ** 2)  # type: ignore[no-untyped-call]
    return prim


SOFTSIGN = _make_softsign()


class Softsign(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        h: Array = SOFTSIGN.bind(0.8 * self.h.value + self.fc(x))
        self.h.value = h
        return h


def test_register_position_rule_makes_a_custom_primitive_diagonal() -> None:
    model = Softsign()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    (rec,) = graph.explain(kind=K.TRANSITION_MIXES_POSITIONS)
    assert "test_softsign" in rec.message and "register_position_rule" in rec.message
    etrax.register_position_rule(SOFTSIGN, "elementwise")
    try:
        graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
        assert not graph.explain(kind=K.TRANSITION_MIXES_POSITIONS)
        assert graph.hidden_groups[0].is_diagonal_recurrence
        xs, ys = _sequence((3,), (4,), T, seed=9)
        state = etrax.state_of(graph)
        exact = bptt_grads(model, state, xs, ys, sq)
        _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), exact, 1e-9)
    finally:
        etrax.register_position_rule(SOFTSIGN, "mixing")
    with pytest.raises(TypeError, match="rule"):  # beartype on the public surface
        etrax.register_position_rule(SOFTSIGN, "diagonal")  # type: ignore[arg-type]


def test_hidden_state_kind_is_unchanged_by_normalisation() -> None:
    _, g_bs, _ = _cell_graphs("LSTMCell", 2)
    kinds = {s.path: s.kind for s in g_bs.module_info.states}
    assert kinds[("cell", "h")] is StateKind.HIDDEN and kinds[("cell", "c")] is StateKind.HIDDEN


class WhileDecay(brainstate.nn.Module):
    """A weight-free ``while_loop`` in the transition (its predicate reads the counter,
    or, with `state_predicate`, the hidden state itself)."""

    def __init__(self, state_predicate: bool) -> None:
        super().__init__()
        self.state_predicate = state_predicate
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        def cond(c: tuple[Array, Array]) -> Array:
            if self.state_predicate:
                return jnp.logical_and(c[0] < 3, jnp.sum(c[1]) < 100.0)
            return c[0] < 3

        def body(c: tuple[Array, Array]) -> tuple[Array, Array]:
            return c[0] + 1, 0.9 * c[1]

        _, h = jax.lax.while_loop(cond, body, (jnp.asarray(0), self.h.value))
        h = h + jnp.tanh(self.fc(x))
        self.h.value = h
        return h


def test_while_loop_position_rule() -> None:
    """A loop of run-time length is analysed through its body: element-wise stays
    diagonal; a trip count that reads the hidden state mixes its positions."""
    for state_predicate, diagonal in ((False, True), (True, False)):
        model = WhileDecay(state_predicate)
        brainstate.nn.init_all_states(model)
        graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
        assert graph.hidden_groups[0].is_diagonal_recurrence is diagonal
        mixing = graph.explain(kind=K.TRANSITION_MIXES_POSITIONS)
        assert bool(mixing) is not diagonal
        if mixing:
            assert "trip count" in mixing[0].message


class BiasAfterSum(brainstate.nn.Module):
    """``h ← 0.6 h + tanh(x W [+ h U] + b)``: the bias is added to a sum of products,
    so it cannot be folded into one op; it is traced as an element-wise op."""

    def __init__(self, recurrent: bool) -> None:
        super().__init__()
        self.recurrent = recurrent
        self.w = _param(10, (3, 4))
        self.u = _param(11, (4, 4))
        self.b = _param(12, (4,))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((2, 4)))

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        pre = jnp.asarray(x) @ self.w.value
        if self.recurrent:
            pre = pre + h @ self.u.value
        new = 0.6 * h + jnp.tanh(pre + self.b.value)
        self.h.value = new
        return new


@pytest.mark.parametrize("recurrent", [False, True], ids=["feedforward", "recurrent"])
def test_a_bias_added_after_a_sum_is_traced(recurrent: bool) -> None:
    model = BiasAfterSum(recurrent)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((2, 3)))
    assert graph.weight_rules()[("b",)].rule is etrax.WeightRule.TRACED
    # folded into the one matmul when it follows it directly; else an element-wise op
    folded = any("as its bias" in r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED))
    alone = any("as a bias" in r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED))
    assert (folded, alone) == (not recurrent, recurrent)
    xs, ys = _sequence((2, 3), (2, 4), T, seed=11)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(decay=0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs[:1], ys[:1])), exact)
    if not recurrent:  # element-wise recurrence, input weights: D-RTRL is exact over T
        _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), bptt_grads(model, state, xs, ys, sq))


class SharedOverPositions(brainstate.nn.Module):
    """``(batch, *positions, in) @ (in, 2F) + b``, cut into a gate and a candidate:
    one weight shared by every position, written without etrax (``@`` or
    ``jnp.einsum``), or as two `etrax.nn.Linear` layers (one masked). The recurrence
    is element-wise."""

    def __init__(self, positions: tuple[int, ...], form: str) -> None:
        super().__init__()
        self.positions, self.form = positions, form
        k1, k2 = jax.random.split(jax.random.PRNGKey(5))
        if form == "etrax.nn":
            mask = jnp.where(jax.random.uniform(k2, (3, 4)) > 0.3, 1.0, 0.0)
            self.gate = etrax.nn.Linear(3, 4, w_mask=mask)  # an ETP op is not cut: one each
            self.cand = etrax.nn.Linear(3, 4)
        else:
            self.w = brainstate.ParamState(0.6 * jax.random.normal(k1, (3, 8)))
            self.b = brainstate.ParamState(0.1 * jax.random.normal(k2, (8,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        lead = () if batch_size is None else (batch_size,)
        self.h = brainstate.HiddenState(jnp.zeros((*lead, *self.positions, 4)))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        if self.form == "etrax.nn":
            gate, cand = self.gate(x), self.cand(x)
        else:
            if self.form == "einsum":
                z = jnp.einsum("...i,io->...o", x, self.w.value) + self.b.value
            else:
                z = x @ self.w.value + self.b.value
            gate, cand = jnp.split(z, 2, axis=-1)
        g = jax.nn.sigmoid(gate)
        new = (1 - g) * self.h.value + g * jnp.tanh(cand)
        self.h.value = new
        return new


@pytest.mark.parametrize(
    ("batch", "positions", "form"),
    [
        (3, (2,), "@"),
        (None, (2, 5), "einsum"),
        (2, (2, 3), "@"),
        (2, (2, 1, 3), "einsum"),
        (2, (2, 3), "etrax.nn"),
        (None, (2, 1, 3), "etrax.nn"),
    ],
    ids=lambda v: str(v),
)
def test_a_weight_shared_along_position_axes_is_traced(
    batch: int | None, positions: tuple[int, ...], form: str
) -> None:
    """A product whose data has position axes besides the batch (``(B, N, in) @ W``)
    is a width-1 `etrax.conv`, so the weight is traced into the hidden state of the
    same positions (bias and fused gates included), exact at T = 1 for every rule
    and for D-RTRL over the sequence (the recurrence is element-wise). Before, only
    one free data axis was recognised, and the weight got its instantaneous gradient
    only."""
    model = SharedOverPositions(positions, form)
    brainstate.nn.init_all_states(model, batch_size=batch)
    lead = () if batch is None else (batch,)
    x_shape, h_shape = (*lead, *positions, 3), (*lead, *positions, 4)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(x_shape))
    rules = graph.weight_rules()
    assert rules and all(r.rule is etrax.WeightRule.TRACED for r in rules.values()), rules
    if form != "etrax.nn":  # recognised in the model's own jaxpr, and said so
        msgs = [r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED)]
        assert any("etrax.conv (width 1" in m and "2 parts" in m for m in msgs), msgs
    xs, ys = _sequence(x_shape, h_shape, T, seed=3)
    rng = np.random.default_rng(0)
    state = etrax.state_of(graph)
    state = state.replace_hidden(
        {p: jnp.asarray(rng.standard_normal(np.shape(v))) for p, v in state.hidden.items()}
    )

    def online(algo: etrax.OnlineAlgorithm[Any], steps: int) -> Any:
        tr = algo.init(graph, state)
        return dict(etrax.online_grad(graph, algo, state, tr, xs[:steps], ys[:steps], sq).grads)

    exact = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.DRTRL(chunk_steps=1), etrax.PPProp(0.9), etrax.EProp()):
        _close(online(algo, 1), exact)
    _close(online(etrax.DRTRL(), T), bptt_grads(model, state, xs, ys, sq))


def test_a_weight_shared_along_four_position_axes_is_not_traced() -> None:
    """Negative control: four position axes besides the batch are more than a
    convolution's three, so the weight stays a plain use with its instantaneous
    gradient, reported with its reason."""
    model = SharedOverPositions((2, 1, 2, 1), "@")
    brainstate.nn.init_all_states(model, batch_size=2)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((2, 2, 1, 2, 1, 3)))
    rule = graph.weight_rules()[("w",)]
    assert rule.rule is etrax.WeightRule.INSTANTANEOUS
    assert rule.reason is K.WEIGHT_PLAIN_USE


class WideAccumulation(brainstate.nn.Module):
    """``x · W`` of float32 operands summed in float64 (``preferred_element_type``),
    with `positions` axes between the batch and the features."""

    def __init__(self, positions: tuple[int, ...]) -> None:
        super().__init__()
        self.positions = positions
        self.w = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(7), (3, 4)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, *self.positions, 4)))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        f32 = jnp.float32
        z = jax.lax.dot_general(
            x.astype(f32), self.w.value.astype(f32), dims, preferred_element_type=jnp.float64
        )
        new = 0.5 * self.h.value + jnp.tanh(z)
        self.h.value = new
        return new


@pytest.mark.parametrize("positions", [(), (2,)], ids=["rows", "positions"])
def test_a_product_summed_in_a_wider_type_stays_exact(positions: tuple[int, ...]) -> None:
    """A recognised product keeps the type it is summed in: float32 operands with
    ``preferred_element_type=float64`` are computed in float64 (their products are
    exact there), not rounded to float32 and cast (a 3e-8 relative error before)."""
    model = WideAccumulation(positions)
    brainstate.nn.init_all_states(model, batch_size=3)
    x_shape, h_shape = (3, *positions, 3), (3, *positions, 4)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(x_shape))
    assert graph.weight_rules()[("w",)].rule is etrax.WeightRule.TRACED
    xs, ys = _sequence(x_shape, h_shape, 1, seed=8)
    state = etrax.state_of(graph)
    exact = bptt_grads(model, state, xs, ys, sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp()):
        _close(dict(_online(graph, algo, xs, ys)), exact)


class ElementWiseWeights(brainstate.nn.Module):
    """Plain element-wise weights in the recurrence: a learned decay ``exp(-1/τ) * v``
    with the same ``τ`` also in the input's scale, per-unit recurrent gains in a gate
    (``h * u``), an adaptation strength ``β * a`` coupling two hidden states, and a time
    constant as a divisor (``x @ W / τ``); or scalars (one decay, one threshold for
    every unit, which the primitive broadcasts; the threshold stored with shape
    ``(1,)``). `form` picks which."""

    def __init__(self, form: str, n: int = 4) -> None:
        super().__init__()
        key = iter(jax.random.split(jax.random.key(11), 6))
        self.form, self.n = form, n
        self.W = brainstate.ParamState(0.5 * jax.random.normal(next(key), (3, n)))
        self.tau = brainstate.ParamState(jnp.linspace(1.5, 3.0, n))
        self.u = brainstate.ParamState(0.5 * jax.random.normal(next(key), (n,)))
        self.beta = brainstate.ParamState(0.5 * jax.random.normal(next(key), (n,)))
        self.theta = brainstate.ParamState(jnp.asarray([0.3]))  # scalars: one for every unit
        self.tau_s = brainstate.ParamState(jnp.asarray(2.0))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape))
        self.a = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: ArrayLike) -> Array:
        # the drive is an explicit ETP op, traced whatever the recognition policy
        h, a, drive = self.h.value, self.a.value, etrax.matmul(jnp.asarray(x), self.W.value)
        if self.form == "decay":
            d = jnp.exp(-1.0 / self.tau.value)
            h = d * h + (1 - d) * drive
        elif self.form == "gain":
            z = jax.nn.sigmoid(drive + h * self.u.value)
            h = z * h + (1 - z) * jnp.tanh(drive)
        elif self.form == "adaptation":
            h = 0.9 * h + drive - self.beta.value * a
            a = 0.8 * a + 0.2 * jnp.tanh(h)
        elif self.form == "scalars":  # a scalar decay and a scalar threshold
            d = jnp.exp(-1.0 / self.tau_s.value)
            h = d * h + jnp.tanh(drive - self.theta.value)
        else:  # "divisor"
            h = 0.8 * h + jnp.tanh(drive) / self.tau.value
        self.h.value, self.a.value = h, a
        return jnp.tanh(h)


ELEMENT_WISE = {
    "decay": ("tau",),
    "gain": ("u",),
    "adaptation": ("beta",),
    "divisor": ("tau",),
    "scalars": ("tau_s", "theta"),
}


@pytest.mark.parametrize("batch", [None, 2], ids=lambda v: f"batch={v}")
@pytest.mark.parametrize("form", list(ELEMENT_WISE))
def test_element_wise_weights_are_traced(form: str, batch: int | None) -> None:
    """A weight vector along the features (or a scalar, for every feature) that meets
    data in an element-wise product, quotient, sum or difference is read through
    `etrax.element_wise`, so its effect on the hidden states is traced: D-RTRL is
    exact over the sequence on these element-wise recurrences (and every rule at
    T = 1). Negative control: with weight recognition off, the same weight is a plain
    use with its instantaneous gradient only, reported as such, and D-RTRL then
    differs from BPTT over the sequence."""
    model = ElementWiseWeights(form)
    brainstate.nn.init_all_states(model, batch_size=batch)
    lead = () if batch is None else (batch,)
    xs, ys = _sequence((*lead, 3), (*lead, 4), T, seed=5)
    graph = etrax.compile_etrace_graph(model, xs[0])
    paths = [(name,) for name in ELEMENT_WISE[form]]
    rules = graph.weight_rules()
    msgs = [r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED)]
    for path in paths:
        assert rules[path].rule is etrax.WeightRule.TRACED, rules[path]
        assert any("etrax.element_wise" in m and str(path) in m for m in msgs), msgs
    assert not graph.explain(kind=K.WEIGHT_PLAIN_USE)
    rng = np.random.default_rng(1)
    start = etrax.state_of(graph)
    state = start.replace_hidden(
        {p: jnp.asarray(rng.standard_normal(np.shape(v))) for p, v in start.hidden.items()}
    )

    def online(g: etrax.ETraceGraph, algo: etrax.OnlineAlgorithm[Any], steps: int) -> Any:
        tr = algo.init(g, state)
        return dict(etrax.online_grad(g, algo, state, tr, xs[:steps], ys[:steps], sq).grads)

    exact_1 = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp()):
        _close(online(graph, algo, 1), exact_1)
    exact = bptt_grads(model, state, xs, ys, sq)
    for algo in (etrax.DRTRL(), etrax.DRTRL(chunk_steps=1)):
        _close(online(graph, algo, T), exact)
    off = etrax.compile_etrace_graph(
        model, xs[0], policy=etrax.CompilePolicy(recognise_weight_ops=False)
    )
    plain = online(off, etrax.DRTRL(chunk_steps=1), T)
    for path in paths:
        assert off.weight_rules()[path].reason is K.WEIGHT_PLAIN_USE
        assert float(jnp.max(jnp.abs(plain[path] - exact[path]))) > 1e-3


@pytest.mark.parametrize("batch", [None, 2], ids=lambda v: f"batch={v}")
def test_element_wise_weights_of_a_single_unit_are_traced(batch: int | None) -> None:
    """A layer of one unit: its per-unit weights (shape ``(1,)``: a decay's time
    constant, a gain, an adaptation strength) are element-wise weights as for wider
    layers, traced, and D-RTRL is exact over the sequence."""
    for form in ("decay", "gain", "adaptation"):
        model = ElementWiseWeights(form, n=1)
        brainstate.nn.init_all_states(model, batch_size=batch)
        lead = () if batch is None else (batch,)
        xs, ys = _sequence((*lead, 3), (*lead, 1), T, seed=6)
        graph = etrax.compile_etrace_graph(model, xs[0])
        for name in ELEMENT_WISE[form]:
            assert graph.weight_rules()[(name,)].rule is etrax.WeightRule.TRACED, form
        assert not graph.explain(kind=K.WEIGHT_PLAIN_USE)
        state = etrax.state_of(graph)
        _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), bptt_grads(model, state, xs, ys, sq))


class ScalarBiasGates(brainstate.nn.Module):
    """Fused gates with one learned scalar bias for every unit:
    ``z, c = split(σ(x W + b₀))``, ``h ← z h + (1 − z) c``."""

    def __init__(self) -> None:
        super().__init__()
        self.W = brainstate.ParamState(0.5 * jax.random.normal(jax.random.key(3), (3, 8)))
        self.b0 = brainstate.ParamState(jnp.asarray(0.2))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((4,) if batch_size is None else (batch_size, 4)))

    def update(self, x: ArrayLike) -> Array:
        z, c = jnp.split(jax.nn.sigmoid(jnp.asarray(x) @ self.W.value + self.b0.value), 2, -1)
        h = z * self.h.value + (1 - z) * c
        self.h.value = h
        return h


def test_a_scalar_bias_after_a_fused_gate_product_is_the_ops_bias() -> None:
    """A scalar bias added after a plain product becomes the recognised op's bias (one
    value for every output feature), cut with the gates, and is traced: every rule
    equals BPTT at T = 1 and D-RTRL over the sequence."""
    model = ScalarBiasGates()
    brainstate.nn.init_all_states(model, batch_size=2)
    xs, ys = _sequence((2, 3), (2, 4), T, seed=7)
    graph = etrax.compile_etrace_graph(model, xs[0])
    rules = graph.weight_rules()
    assert rules[("b0",)].rule is rules[("W",)].rule is etrax.WeightRule.TRACED
    msgs = [r.message for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED)]
    assert any("as its bias" in m and "2 parts" in m for m in msgs), msgs
    state = etrax.state_of(graph)
    state = state.replace_hidden({p: 0.5 + 0 * v for p, v in state.hidden.items()})

    def online(algo: etrax.OnlineAlgorithm[Any], steps: int) -> Any:
        tr = algo.init(graph, state)
        return dict(etrax.online_grad(graph, algo, state, tr, xs[:steps], ys[:steps], sq).grads)

    exact_1 = bptt_grads(model, state, xs[:1], ys[:1], sq)
    for algo in (etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp()):
        _close(online(algo, 1), exact_1)
    _close(online(etrax.DRTRL(chunk_steps=1), T), bptt_grads(model, state, xs, ys, sq))


# ----- brainevent's event-driven layers ------------------------------------------------


@jax.custom_jvp
def _fire(v: Array) -> Array:
    return (v > 0).astype(v.dtype)


@_fire.defjvp
def _fire_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (v,), (dv,) = primals, tangents
    return _fire(v), dv / (1.0 + jnp.abs(v)) ** 2


class EventNeurons(brainstate.nn.Module):
    """Leaky spiking units driven by input spikes through an event layer (and, with
    `rec`, by their own previous spikes through a second one), with a readout of
    their potentials."""

    def __init__(self, inp: brainstate.nn.Module, rec: brainstate.nn.Module | None = None) -> None:
        super().__init__()
        self.inp = inp
        self.rec = rec
        self.out = brainstate.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (4,) if batch_size is None else (batch_size, 4)
        self.v = brainstate.HiddenState(jnp.full(shape, 0.3))
        self.s = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: ArrayLike) -> Array:
        current = self.inp(x)
        if self.rec is not None:
            current = current + self.rec(self.s.value)
        v = 0.8 * self.v.value + current
        s = _fire(v - 0.5)
        self.v.value = v - 0.5 * s
        self.s.value = s
        y: Array = self.out(self.v.value)
        return y


def _event_layer(kind: str, n_in: int, seed: int) -> brainstate.nn.Module:
    key = jax.random.key(seed)
    if kind == "EventLinear":
        return brainstate.nn.EventLinear(n_in, 4, 0.5 * jax.random.normal(key, (n_in, 4)))
    if kind == "EventFixedProb":  # two connections per input, a weight each
        weights = 0.5 * jax.random.normal(key, (n_in, 2))
        return brainstate.nn.EventFixedProb(n_in, 4, 2, weights, seed=seed)
    if kind == "EventFixedProb-homogeneous":  # one weight for all connections
        return brainstate.nn.EventFixedProb(n_in, 4, 2, 0.4, seed=seed)
    # float products over fixed connections (brainevent's jitted plain-JAX scatter)
    return brainstate.nn.FixedNumConn(
        n_in, 4, 2, 0.5 * jax.random.normal(key, (n_in, 2)), seed=seed
    )


EVENT_LAYERS = ("EventLinear", "EventFixedProb", "EventFixedProb-homogeneous", "FixedNumConn")


# brainstate 0.5.4's event layers use brainevent 0.2's deprecated names (EventArray, ...)
@pytest.mark.filterwarnings("ignore:brainevent.* is deprecated:DeprecationWarning")
@pytest.mark.usefixtures("jax_event_kernels")
@pytest.mark.parametrize(
    ("kind", "batch"),
    # the batched products of each kind (one homogeneous weight: its unbatched one)
    [(k, b) for k in EVENT_LAYERS for b in (None, 2) if (k, b) != (EVENT_LAYERS[2], 2)],
    ids=lambda v: {None: "unbatched", 2: "batch2"}.get(v, str(v)),
)
def test_brainevent_event_layers_are_traced(kind: str, batch: int | None) -> None:
    """brainstate's event layers (`EventLinear`, `EventFixedProb`, whose products are
    brainevent primitives) and `FixedNumConn` (brainevent's jitted plain-JAX scatter)
    are traced like the products they stand for: the dense weight is recognised, the
    fixed connections become an `etrax.ops.sparse_matmul`, and no warning. Fed by
    input spikes the model is diagonal, so D-RTRL over the sequence equals BPTT
    through the model's own ``update``; every rule equals it at T = 1. With recurrent
    spikes through a second such layer, both weights are traced and the transition
    keeps positions apart (before, the product was taken as mixing them: the whole
    Jacobian as ``D``, and the weight learnt only its instantaneous gradient). The
    relations name the model's own lines. Negative control: with recognition off, the
    weight is a plain use."""
    x_shape = (3,) if batch is None else (batch, 3)
    y_shape = (2,) if batch is None else (batch, 2)
    xs, ys = _sequence(x_shape, y_shape, T, seed=11)
    xs = (xs > 0.3).astype(xs.dtype)  # input spikes
    for rec in (False, True):
        model = EventNeurons(_event_layer(kind, 3, 1), _event_layer(kind, 4, 2) if rec else None)
        brainstate.nn.init_all_states(model, batch_size=batch)
        graph = etrax.compile_etrace_graph(model, xs[0])
        weights = {("inp", "weight")} | ({("rec", "weight")} if rec else set())
        if kind == "EventLinear":  # a plain product with the weight, then recognised
            recognised = {r.weight_path for r in graph.explain(kind=K.WEIGHT_OP_RECOGNISED)}
            assert weights <= recognised
        else:  # a sparse product over the connections: one trace value per connection
            ops = {r.weight_paths[0]: r.primitive for r in graph.hidden_param_op_relations}
            assert all(ops[p].name == "etp_sparse_matmul" for p in weights), ops
        rules = graph.weight_rules()
        assert all(rules[p].rule is etrax.WeightRule.TRACED for p in weights), rules
        # the user's line, not brainevent's (the product is bound inside its own jit)
        locations = [r.location for r in graph.hidden_param_op_relations]
        assert all(__file__ in loc for loc in locations), locations
        state = _quiet_and_exact_at_one_step(graph, model, xs, ys)
        if not rec:
            _close(
                dict(_online(graph, etrax.DRTRL(), xs, ys)), bptt_grads(model, state, xs, ys, sq)
            )
    off = etrax.compile_etrace_graph(
        model, xs[0], policy=etrax.CompilePolicy(recognise_weight_ops=False)
    )
    assert ("inp", "weight") in {r.weight_path for r in off.explain(kind=K.WEIGHT_PLAIN_USE)}


# ----- brainstate's exponential Euler integrator ---------------------------------------


class ExpEulerNeurons(brainstate.nn.Module):
    """Spiking units whose membrane follows ``dV/dt = (-V + tanh V + I) / τ`` with a
    learned ``τ`` per unit, integrated by brainstate's `exp_euler_step` (which takes
    the drift's Jacobian inside the step, with `vector_grad`, and brainunit's
    ``exprel``), driven by inputs through a `Linear`, read out after the reset."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = brainstate.nn.Linear(3, 4)
        self.tau = brainstate.ParamState(jnp.linspace(2.0, 5.0, 4))
        self.out = brainstate.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (4,) if batch_size is None else (batch_size, 4)
        self.v = brainstate.HiddenState(jnp.full(shape, 0.2))

    def update(self, x: ArrayLike) -> Array:
        def drift(v: Array, current: Array) -> Array:
            return (-v + jnp.tanh(v) + current) / self.tau.value

        v = brainstate.nn.exp_euler_step(drift, self.v.value, self.inp(x))
        self.v.value = v - 0.5 * _fire(v - 0.5)
        y: Array = self.out(self.v.value)
        return y


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
def test_a_neuron_integrated_by_exp_euler_step_is_traced(batch: int | None) -> None:
    """brainstate's `exp_euler_step` writes the drift's Jacobian into the step
    (`add_any`, the sum of cotangents, and brainunit's ``exprel`` primitive): both
    are element-wise, so the transition keeps positions apart (before: the whole
    Jacobian as ``D``, with a ``transition_mixes_positions`` warning) and ``τ`` is
    read through `etrax.element_wise` where it meets data in an ``add_any``. With a
    batch, the Jacobian's ``1 / τ`` is computed on the whole batch's shape (the ``1``
    broadcast to it); it is computed at ``(1, F)`` and broadcast after
    (`narrow_weight_values`), so that it too meets the data along the features and is
    traced (before, a plain use). Every rule equals BPTT through the model's own
    ``update`` at T = 1, and D-RTRL over the sequence (the model is diagonal)."""
    x_shape = (3,) if batch is None else (batch, 3)
    y_shape = (2,) if batch is None else (batch, 2)
    xs, ys = _sequence(x_shape, y_shape, T, seed=13)
    with brainstate.environ.context(dt=0.1):
        model = ExpEulerNeurons()
        brainstate.nn.init_all_states(model, batch_size=batch)
        graph = etrax.compile_etrace_graph(model, xs[0])
        # no mixing transition, no plain use; the oracle traces the model, so in `dt`
        state = _quiet_and_exact_at_one_step(graph, model, xs, ys)
        exact = bptt_grads(model, state, xs, ys, sq)
    assert graph.weight_rules()[("tau",)].rule is etrax.WeightRule.TRACED
    _close(dict(_online(graph, etrax.DRTRL(), xs, ys)), exact)


# ----- a leaky readout of spikes ----------------------------------------------------


class SpikesIntoLeakyReadout(brainstate.nn.Module):
    """Spiking units reset by subtraction, read by a leaky readout (a hidden state of
    its own, returned as the output): e-prop's usual model. The readout reads the
    spikes, which come from the membrane before the reset, so the units' stored
    (reset) values reach no output in their own step."""

    def __init__(self, cut: bool = False) -> None:
        super().__init__()
        self.cut = cut  # the oracle's variant: the readout's memory cut from its past
        self.inp = brainstate.nn.Linear(3, 4)
        self.out = brainstate.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        def shape(n: int) -> tuple[int, ...]:
            return (n,) if batch_size is None else (batch_size, n)

        self.v = brainstate.HiddenState(jnp.full(shape(4), 0.3))
        self.y = brainstate.HiddenState(jnp.zeros(shape(2)))

    def update(self, x: ArrayLike) -> Array:
        v = 0.9 * self.v.value + self.inp(x)
        s = _fire(v - 1.0)
        self.v.value = v - s
        past = jax.lax.stop_gradient(self.y.value) if self.cut else self.y.value
        self.y.value = 0.8 * past + self.out(s)
        return self.y.value


@pytest.mark.parametrize("batch", [None, 2], ids=["unbatched", "batch2"])
def test_spikes_read_by_a_leaky_readout_teach_the_input_weight(batch: int | None) -> None:
    """The readout is a group whose new value is the output; the units' old values
    reach it within the step through the spikes (before, that route was taken as
    leaving through a new hidden value: a `hidden_group_not_read` warning, and the
    input weight learnt its instantaneous gradient only, a sixth of the gradient
    here). That route now carries the units' direct signal: no warning, every rule
    equals BPTT at T = 1, and over the sequence D-RTRL (chunked and per step) and
    e-prop give the input weight exactly the gradient of BPTT through the model with
    the readout's memory cut (the approximation the report names: the units'
    influence through the readout's memory, a route across a weight, is not traced)."""
    x_shape = (3,) if batch is None else (batch, 3)
    y_shape = (2,) if batch is None else (batch, 2)
    xs, ys = _sequence(x_shape, y_shape, T, seed=17)
    xs = 2.0 * xs
    model, cut = SpikesIntoLeakyReadout(), SpikesIntoLeakyReadout(cut=True)
    for m in (model, cut):
        brainstate.nn.init_all_states(m, batch_size=batch)
    for a, b in ((model.inp, cut.inp), (model.out, cut.out)):
        b.weight.value = dict(a.weight.value)
    graph = etrax.compile_etrace_graph(model, xs[0])
    state = _quiet_and_exact_at_one_step(graph, model, xs, ys)
    want = bptt_grads(cut, state, xs, ys, sq)[("inp", "weight")]
    assert float(jnp.max(jnp.abs(want["weight"]))) > 1.0  # spikes happen: a real signal
    for algo in (etrax.DRTRL(), etrax.DRTRL(chunk_steps=1), etrax.EProp()):
        _close(_online(graph, algo, xs, ys)[("inp", "weight")], want)
