"""The brainstate-facing learner: masks and reductions against BPTT through the model's
own update, evolving without gradients, one-step calls, seeds and reports."""

import dataclasses
import pathlib
import warnings
from collections.abc import Callable
from typing import Any, Literal

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax

from .compiles import CompileCount
from .models import LeakyTanhReadout
from .oracles import bptt_grads
from .typechecks import unchecked as typechecks_paused

TOL = 1e-10
T = 6


def mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def setup(rule: etrax.OnlineAlgorithm[Any]) -> tuple[etrax.OnlineLearner, Array, Array]:
    brainstate.random.seed(0)
    model = LeakyTanhReadout(3, 5)
    learner = etrax.compile(model, rule, jnp.zeros((2, 3)), batch_size=2)
    xs = jax.random.normal(jax.random.key(0), (T, 2, 3))
    ys = jax.random.normal(jax.random.key(1), (T, 2, 2))
    return learner, xs, ys


def rel(a: Any, b: Any) -> float:
    worst = 0.0
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = float(jnp.max(jnp.abs(v)))
        worst = max(worst, float(jnp.max(jnp.abs(u - v))) / (scale if scale > 0 else 1.0))
    return worst


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_mask_and_reduction_against_bptt(reduction: Literal["sum", "mean"]) -> None:
    """The model is exact under D-RTRL, so the masked online gradient equals the gradient
    of the same masked loss through brainstate's own update."""
    learner, xs, ys = setup(etrax.DRTRL(chunk_steps=1))
    state = etrax.state_of(learner.graph)
    mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    w = mask / jnp.maximum(mask.sum(), 1.0) if reduction == "mean" else mask

    def weighted(y: Array, tw: tuple[Array, Array]) -> Array:
        t, wt = tw
        return wt * mse(y, t)

    ref = bptt_grads(learner.model, state, xs, (ys, w), weighted)
    got = learner.etrace_grad(xs, ys, mse, mask=mask, reduction=reduction)
    for p in ref:
        assert rel(got[p], ref[p]) < TOL, p
    # without a mask, "mean" divides by T
    learner.reset()
    plain = learner.etrace_grad(xs, ys, mse, reduction="mean")
    learner.reset()
    total = learner.etrace_grad(xs, ys, mse)
    for p in total:
        assert rel(jax.tree.map(lambda g: g * T, plain[p]), total[p]) < TOL
    with pytest.raises(etrax.StepInputError, match="one weight per step"):
        learner.etrace_grad(xs, ys, mse, mask=jnp.ones(3))


def test_evolve_leaves_the_same_state_and_traces_as_grad() -> None:
    for rule in (etrax.DRTRL(chunk_steps=2), etrax.PPProp(0.8)):
        a, xs, ys = setup(rule)
        b, _, _ = setup(rule)
        a.etrace_grad(xs, ys, mse)
        outs = b.etrace_evolve(xs, return_outputs=True)
        assert outs.shape == (T, 2, 2)
        for u, v in zip(jax.tree.leaves(a.traces), jax.tree.leaves(b.traces), strict=True):
            np.testing.assert_allclose(u, v, rtol=0, atol=1e-12)
        for u, v in zip(
            jax.tree.leaves(etrax.state_of(a.graph).hidden),
            jax.tree.leaves(etrax.state_of(b.graph).hidden),
            strict=True,
        ):
            np.testing.assert_allclose(u, v, rtol=0, atol=1e-12)
        assert b.etrace_evolve(xs) is None


class RandomStart(brainstate.nn.Module):
    """A leaky layer whose initial hidden state is drawn from brainstate's generator."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(brainstate.random.normal(size=(4,)))

    def update(self, x: Array) -> Array:
        self.h.value = 0.9 * self.h.value + jnp.tanh(self.fc(x))
        return self.h.value


def test_one_step_call_and_seed_and_report(capsys: pytest.CaptureFixture[str]) -> None:
    learner, xs, _ = setup(etrax.DRTRL(chunk_steps=1))
    y0 = learner(xs[0])
    learner.reset()
    outs = learner.etrace_evolve(xs[:1], return_outputs=True)
    np.testing.assert_allclose(y0, outs[0], rtol=0, atol=1e-12)

    def start(seed: int) -> Array:
        lrn = etrax.compile(RandomStart(), "d_rtrl", jnp.zeros(3), seed=seed)
        h: Array = etrax.state_of(lrn.graph).hidden[("h",)]
        return h

    np.testing.assert_array_equal(start(3), start(3))
    assert not np.array_equal(start(3), start(4))
    etrax.compile(LeakyTanhReadout(3, 5), "d_rtrl", jnp.zeros(3), verbose=True)
    assert "relation" in capsys.readouterr().out.lower()


def test_each_method_compiles_one_program_once() -> None:
    """A learner method's first call compiles exactly one XLA program (the online
    driver, the mask weights, the silence checks off the CPU and the totals together); a second
    call with new values, and `reset`, compile nothing."""
    learner, xs_jax, ys_jax = setup(etrax.DRTRL())
    xs, ys = np.asarray(xs_jax), np.asarray(ys_jax)  # NumPy: indexing compiles nothing
    xs2, ys2 = xs + 0.5, ys - 0.5
    mask = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    calls: list[tuple[str, Any]] = [
        ("etrace_grad", lambda x, y, m: learner.etrace_grad(x, y, mse, return_value=True)),
        (
            "etrace_grad(mask, mean, total)",
            lambda x, y, m: learner.etrace_grad(
                x, y, mse, mask=m, reduction="mean", loss_output="total"
            ),
        ),
        ("etrace_evolve", lambda x, y, m: learner.etrace_evolve(x, return_outputs=True)),
        ("__call__", lambda x, y, m: learner(x[0])),
        ("bptt_grad", lambda x, y, m: learner.bptt_grad(x, y, mse)),
    ]
    for name, call in calls:
        with CompileCount() as first:
            call(xs, ys, mask)  # compiles synchronously
        with CompileCount() as second:
            call(xs2, ys2, 1.0 - mask)
        assert (first.count, second.count) == (1, 0), name
    with CompileCount() as reset:
        learner.reset()
    assert reset.count == 0


class _StateSeeded(etrax.LearningRule[Any]):
    """D-RTRL whose initial traces depend on the hidden state (by a zero amount):
    not a constant, so the learner must run its ``init`` under `jax.jit`."""

    def init(self, graph: etrax.ETraceGraph, state: Any) -> Any:
        traces = super().init(graph, state)
        h = jnp.sum(jax.tree.leaves(state.hidden)[0])
        return jax.tree.map(lambda a: a + 0.0 * h, traces)


def _jitted_init(learner: etrax.OnlineLearner, vmap: bool) -> Any:
    from etrax.executor import state_of

    graph, algo = learner.graph, learner.algorithm

    def init(st: Any) -> Any:
        return algo.init(graph, st)

    state = state_of(graph)
    if vmap:  # the model holds every sample's hidden values; init sees one sample's
        one = jax.tree.map(lambda a: a[0], state.hidden)
        state = etrax.ModelState(state.params, one, state.other)
    return jax.jit(jax.vmap(init, in_axes=None, axis_size=2) if vmap else init)(state)


def test_initial_traces_compile_nothing() -> None:
    """Zero initial traces are made on the host (`constant_outputs` folds the rule's
    ``init``), so building a learner compiles no XLA program, with and without
    ``vmap``, and its traces equal the rule's ``init`` run under `jax.jit`; traces
    that are not constants still come from one jitted ``init``."""
    drtrl = etrax.DRTRL()
    seeded = _StateSeeded(**{f.name: getattr(drtrl, f.name) for f in dataclasses.fields(drtrl)})
    none, one = range(1), range(1, 2)
    rules: list[tuple[etrax.OnlineAlgorithm[Any], tuple[range, range]]] = [
        (drtrl, (none, none)),
        (etrax.PPProp(0.9), (none, none)),
        (etrax.EProp(0.9), (none, none)),
        # with vmap, the key is split per sample: an eager split, compiled unless cached
        (etrax.UORO(jax.random.key(0)), (none, range(2))),
        (seeded, (one, one)),
    ]
    for rule, compiled in rules:
        for vmap, programs in zip((False, True), compiled, strict=True):
            brainstate.random.seed(0)
            x0 = jnp.zeros((2, 3))
            model = LeakyTanhReadout(3, 5)  # its random weights compile programs of their own
            brainstate.nn.init_all_states(model, batch_size=None if vmap else 2)  # so do its
            # zero states (eager jnp.zeros): done once here, cached for etrax.compile's call
            with CompileCount() as count:
                learner = etrax.compile(model, rule, x0, batch_size=2, vmap=vmap)
            assert count.count in programs, (rule.name, vmap)
            jitted = _jitted_init(learner, vmap)
            treedef: Any = jax.tree.structure(learner.traces)  # PyTreeDef is untyped
            assert treedef == jax.tree.structure(jitted)
            for a, b in zip(jax.tree.leaves(learner.traces), jax.tree.leaves(jitted), strict=True):
                assert (a.shape, a.dtype) == (b.shape, b.dtype)
                if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):  # UORO's noise
                    a, b = jax.random.key_data(a), jax.random.key_data(b)
                    if vmap:  # the samples draw apart
                        assert len({tuple(np.asarray(k)) for k in a}) == len(a)
                        continue
                np.testing.assert_array_equal(a, b)


def test_constant_outputs_folds_only_constants() -> None:
    """`constant_outputs` returns numpy-made values for outputs built from literals by
    broadcasts, casts and reshapes, and `None` as soon as one output depends on an
    argument, a random key or another primitive."""
    from etrax._compat import constant_outputs

    x = jnp.arange(3.0)

    def zeros(v: Array) -> dict[str, Any]:
        return {
            "a": jnp.zeros((2, 3)),
            "b": jnp.zeros((4,), jnp.int32).reshape(2, 2),
            "c": jnp.full((3,), 2.5).astype(jnp.float16),
            "d": jax.vmap(lambda _: jnp.ones((2,)))(v),
            "e": jnp.full((2,), -0.0, jnp.float32),
            "f": jnp.zeros((3,), bool),
        }

    folded = constant_outputs(zeros, x)
    assert folded is not None
    for key, want in zeros(x).items():
        assert (folded[key].dtype, folded[key].shape) == (want.dtype, want.shape), key
        np.testing.assert_array_equal(folded[key], want)
        np.testing.assert_array_equal(np.signbit(folded[key]), np.signbit(want))
    assert constant_outputs(lambda v: (jnp.zeros(3), v * 0.0), x) is None
    assert constant_outputs(lambda v: jnp.zeros(3) + 1.0, x) is None
    assert constant_outputs(lambda v: jax.random.normal(jax.random.key(0), (3,)), x) is None


def test_constant_outputs_leaves_large_outputs_to_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `FOLD_MAX_BYTES` of outputs, host-made values cost more than an XLA
    program: `constant_outputs` then returns `None`; at the bound it still folds."""
    from etrax import _compat

    def zeros() -> tuple[Array, Array]:
        return jnp.zeros((4, 8), jnp.float32), jnp.zeros((2,), jnp.float64)

    monkeypatch.setattr(_compat, "FOLD_MAX_BYTES", 4 * 8 * 4 + 2 * 8)
    assert _compat.constant_outputs(zeros) is not None
    monkeypatch.setattr(_compat, "FOLD_MAX_BYTES", 4 * 8 * 4 + 2 * 8 - 1)
    assert _compat.constant_outputs(zeros) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: etrax.DRTRL(),
        lambda: etrax.PPProp(0.9),
        lambda: etrax.EProp(0.9),
        lambda: etrax.UORO(jax.random.key(0)),
    ],
    ids=["drtrl", "pp_prop", "eprop", "uoro"],
)
def test_an_eager_rule_init_compiles_nothing(
    make: Callable[[], etrax.OnlineAlgorithm[Any]],
) -> None:
    """The functional ``rule.init(graph, state)``, called eagerly, makes its zero
    traces on the host (one XLA program per trace shape otherwise); under `jax.jit`
    and `jax.vmap` it still builds them in the program. The values agree."""
    rule = make()
    model = LeakyTanhReadout(3, 5)
    brainstate.nn.init_all_states(model, batch_size=2)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((2, 3)))
    state = etrax.state_of(graph)
    with CompileCount() as count:
        eager = rule.init(graph, state)
    assert count.count == 0, count.names
    jitted = jax.jit(lambda st: rule.init(graph, st))(state)
    mapped = jax.vmap(lambda _: rule.init(graph, state))(jnp.arange(2))
    for a, b, m in zip(*(jax.tree.leaves(t) for t in (eager, jitted, mapped)), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) == (m.shape[1:], m.dtype)
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b, m = (jax.random.key_data(k) for k in (a, b, m))
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(m, np.stack([b, b]))


def test_the_learner_keeps_a_bounded_number_of_programs() -> None:
    """A new loss function per call builds a new program; the learner keeps the
    `MAX_PROGRAMS` most recently used (a recently used one survives the others)."""
    from etrax.algorithms._learner import MAX_PROGRAMS

    learner, _, _ = setup(etrax.DRTRL(chunk_steps=1))
    kept = learner._program(("kept",), lambda: None)
    for i in range(2 * MAX_PROGRAMS):
        learner._program(("loss", i), lambda: None)
        assert learner._program(("kept",), lambda: None) is kept  # used again: kept
    assert len(learner._programs) == MAX_PROGRAMS
    assert ("loss", 0) not in learner._programs
    assert ("loss", 2 * MAX_PROGRAMS - 1) in learner._programs


def test_reset_restores_states_no_reset_state_resets() -> None:
    """`LeakyTanh` creates its state in ``init_state`` and has no ``reset_state``:
    `reset` still returns it (and the traces) to the start."""
    learner, xs, ys = setup(etrax.DRTRL(chunk_steps=1))
    start = etrax.state_of(learner.graph).hidden
    first = learner.etrace_grad(xs, ys, mse)
    moved = etrax.state_of(learner.graph).hidden
    assert any(not np.array_equal(start[p], moved[p]) for p in start)
    learner.reset()
    for p in start:
        np.testing.assert_array_equal(etrax.state_of(learner.graph).hidden[p], start[p])
    again = learner.etrace_grad(xs, ys, mse)
    for p in first:
        assert rel(again[p], first[p]) == 0.0


class Counting(brainstate.nn.Module):
    """A leaky unit driven by a step counter (a short-term state the step writes)
    and keeping a running mean of its input (a long-term state); no
    ``reset_state``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        lead = () if batch_size is None else (batch_size,)
        self.h = brainstate.HiddenState(jnp.zeros((*lead, 4)))
        self.count = brainstate.ShortTermState(jnp.zeros((*lead, 1)))
        self.mean = brainstate.LongTermState(jnp.zeros((*lead, 3)))

    def update(self, x: Array) -> Array:
        self.count.value = self.count.value + 1.0
        self.mean.value = 0.9 * self.mean.value + 0.1 * x
        self.h.value = 0.7 * self.h.value + jnp.tanh(self.fc(x)) + 0.1 * self.count.value
        return self.h.value


@pytest.mark.parametrize("vmap", [False, True], ids=["batched", "vmap"])
def test_reset_restores_written_short_term_states(vmap: bool) -> None:
    """`reset` returns a short-term state the step writes (a counter) to its start,
    so a sequence after a reset gives its first gradient again, with and without
    ``vmap``; without ``vmap`` a long-term state (a running mean) keeps its value."""
    B, steps = 2, 5
    xs = jax.random.normal(jax.random.key(0), (steps, B, 3))
    ys = jnp.zeros((steps, B, 4))
    brainstate.random.seed(0)
    model = Counting()
    learner = etrax.compile(model, etrax.DRTRL(), jnp.zeros((B, 3)), batch_size=B, vmap=vmap)
    first = learner.etrace_grad(xs, ys, mse)
    mean = np.asarray(model.mean.value)
    learner.reset()
    np.testing.assert_array_equal(np.asarray(model.count.value), 0.0)
    if not vmap:
        np.testing.assert_array_equal(np.asarray(model.mean.value), mean)
    again = learner.etrace_grad(xs, ys, mse)
    for p in first:
        assert rel(again[p], first[p]) == 0.0


class TwoLayerSpiking(brainstate.nn.Module):
    """``Linear → spiking → Linear → spiking`` with every default."""

    def __init__(self, neuron: Any, threshold: float = 1.0) -> None:
        super().__init__()
        self.fc1, self.n1 = etrax.nn.Linear(10, 32), neuron(32, v_th=threshold)
        self.fc2, self.n2 = etrax.nn.Linear(32, 16), neuron(16, v_th=threshold)

    def update(self, x: Array) -> tuple[Array, Array]:
        s1 = self.n1(self.fc1(x))
        return s1, self.n2(self.fc2(s1))


@pytest.mark.parametrize("neuron", [etrax.nn.LIF, etrax.nn.ALIF])
def test_default_spiking_layers_spike_on_unit_scale_input(neuron: Any) -> None:
    brainstate.random.seed(0)
    model = TwoLayerSpiking(neuron)
    brainstate.nn.init_all_states(model, batch_size=8)
    graph = etrax.compile_etrace_graph(model, jnp.zeros((8, 10)))
    xs = jax.random.normal(jax.random.key(0), (60, 8, 10))  # unit scale
    (s1, s2), _, _ = etrax.multi_step(graph, etrax.state_of(graph), xs)
    assert 0.02 < float(s1.mean()) < 0.5 and 0.02 < float(s2.mean()) < 0.5


def test_a_silent_network_warns() -> None:
    brainstate.random.seed(0)

    def loss(y: tuple[Array, Array], t: Array) -> Array:
        return jnp.sum((y[1] - t) ** 2)

    silent = etrax.compile(
        TwoLayerSpiking(etrax.nn.LIF, threshold=1e3),
        etrax.DRTRL(),
        jnp.zeros((8, 10)),
        batch_size=8,
    )
    xs = jax.random.normal(jax.random.key(0), (20, 8, 10))
    with pytest.warns(etrax.SilentNetworkWarning) as record:
        silent.etrace_grad(xs, jnp.ones((20, 8, 16)), loss)
    messages = " | ".join(str(w.message) for w in record)
    assert "every gradient is exactly zero" in messages
    assert "hidden group(s) [1] did not change" in messages  # no spike reaches layer 2
    alive = etrax.compile(
        TwoLayerSpiking(etrax.nn.LIF), etrax.DRTRL(), jnp.zeros((8, 10)), batch_size=8
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", etrax.SilentNetworkWarning)
        alive.etrace_grad(xs, jnp.ones((20, 8, 16)), loss)


def test_silence_checks_agree_in_the_program_and_on_the_host() -> None:
    """The silent-network check runs in the program off the CPU (`_silence`) and on
    the host on the CPU (`_silence_host`, which stops at the first deciding leaf):
    both give the same flags for unchanged and moved hidden groups and for all-zero
    and nonzero gradients."""
    brainstate.random.seed(0)
    learner = etrax.compile(
        TwoLayerSpiking(etrax.nn.LIF), etrax.DRTRL(), jnp.zeros((8, 10)), batch_size=8
    )
    before = etrax.state_of(learner.graph)
    first = next(iter(before.hidden))
    moved = before.replace_hidden(
        {p: v + 1.0 if p == first else v for p, v in before.hidden.items()}
    )
    zeros = jax.tree.map(jnp.zeros_like, before.params)
    ones = jax.tree.map(jnp.ones_like, before.params)
    seen = set()
    for after in (before, moved):
        for grads in (zeros, ones):
            still, all_zero = learner._silence(before, after, grads)
            host_still, host_zero = learner._silence_host(before, after, grads)
            assert still.tolist() == host_still and bool(all_zero) == host_zero
            seen.add((tuple(host_still), host_zero))
    assert len(seen) == 4  # each case is told apart


# --- has_aux, loss_output, vmap ------------------------------------------------------------


def mse_and_output(y: Array, t: Array) -> tuple[Array, Array]:
    return mse(y, t), y


def setup_vmap(rule: etrax.OnlineAlgorithm[Any]) -> etrax.OnlineLearner:
    """`setup`'s model written per sample and mapped over the same batch of 2."""
    brainstate.random.seed(0)
    return etrax.compile(LeakyTanhReadout(3, 5), rule, jnp.zeros((2, 3)), batch_size=2, vmap=True)


@pytest.mark.parametrize("window", [None, 4])
def test_has_aux_returns_the_aux_and_leaves_the_gradients(window: int | None) -> None:
    """The aux comes back stacked over time (here the outputs, checked against
    `etrace_evolve`'s); the gradients, state and traces are those without aux. T = 6
    with windows of 4 and chunks of 4 leaves a shorter last block."""
    rule = etrax.DRTRL(chunk_steps=4)
    plain, xs, ys = setup(rule)
    aux_l, _, _ = setup(rule)
    outs_l, _, _ = setup(rule)
    mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    cases: list[tuple[Array | None, Literal["sum", "mean"]]] = [(None, "sum"), (mask, "mean")]
    for m, how in cases:
        want, want_losses = plain.etrace_grad(
            xs, ys, mse, mask=m, reduction=how, window=window, return_value=True
        )
        grads, losses, outs = aux_l.etrace_grad(
            xs, ys, mse_and_output, mask=m, reduction=how, window=window, has_aux=True,
            return_value=True,
        )  # fmt: skip
        ref = outs_l.etrace_evolve(xs, return_outputs=True)
        assert outs.shape == (T, 2, 2)
        np.testing.assert_allclose(outs, ref, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(losses, want_losses)
        for p in want:
            assert rel(grads[p], want[p]) == 0.0, p
        for a, b in zip(jax.tree.leaves(aux_l.traces), jax.tree.leaves(plain.traces), strict=True):
            np.testing.assert_array_equal(a, b)
    # both: (grads, losses, aux); and loss_output picks the losses
    for lrn in (plain, aux_l):
        lrn.reset()
    _, losses, outs = aux_l.etrace_grad(
        xs, ys, mse_and_output, mask=mask, has_aux=True, return_value=True, loss_output="per_step"
    )
    raw = jnp.stack([mse(outs[t], ys[t]) for t in range(T)])
    np.testing.assert_allclose(losses, raw, rtol=1e-13)
    assert float(jnp.min(losses)) > 0  # the masked steps' raw losses too
    _, weighted = plain.etrace_grad(xs, ys, mse, mask=mask, return_value=True)
    np.testing.assert_allclose(weighted, mask * raw, rtol=1e-13)
    plain.reset()
    _, total = plain.etrace_grad(xs, ys, mse, mask=mask, return_value=True, loss_output="total")
    assert total.shape == () and abs(float(total) - float(jnp.sum(mask * raw))) < 1e-12


def unchecked(f: Any) -> Any:
    """`f` without the test run's runtime type checker (which refuses ill-typed
    arguments first, with its own message), to reach etrax's own checks."""
    return getattr(f, "__wrapped__", f)


def test_learner_arguments_are_checked() -> None:
    learner, xs, ys = setup(etrax.DRTRL())
    with pytest.raises(etrax.StepInputError, match="has_aux=True"):
        learner.etrace_grad(xs, ys, mse_and_output)  # type: ignore[arg-type]
    with pytest.raises(etrax.StepInputError, match="pair"):
        learner.etrace_grad(xs, ys, mse, has_aux=True)
    grad = unchecked(etrax.OnlineLearner.etrace_grad)
    with pytest.raises(TypeError, match="has_aux must be True or False"):
        grad(learner, xs, ys, mse, has_aux=1)
    with pytest.raises(TypeError, match="return_value must be True or False"):
        grad(learner, xs, ys, mse, return_value="yes")
    with pytest.raises(ValueError, match="loss_output must be"):
        grad(learner, xs, ys, mse, loss_output="masked")
    with pytest.raises(TypeError, match="needs loss_fn"):
        grad(learner, xs, ys)
    build = unchecked(etrax.compile)
    with pytest.raises(ValueError, match="batch_size=B"):
        build(LeakyTanhReadout(3, 5), "d_rtrl", jnp.zeros((2, 3)), vmap=True)
    with pytest.raises(TypeError, match="vmap must be True or False"):
        build(LeakyTanhReadout(3, 5), "d_rtrl", jnp.zeros((2, 3)), batch_size=2, vmap=1)
    with pytest.raises(etrax.StepInputError, match="leading batch axis of size batch_size=2"):
        etrax.compile(LeakyTanhReadout(3, 5), "d_rtrl", jnp.zeros((3,)), batch_size=2, vmap=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule",
    [etrax.DRTRL(chunk_steps=4), etrax.PPProp(0.8), etrax.EProp(kappa=0.5)],
    ids=["drtrl", "pp_prop", "eprop"],
)
def test_vmap_equals_the_batched_learner(rule: etrax.OnlineAlgorithm[Any]) -> None:
    """The per-sample graph mapped over the batch gives the batched-in-state learner's
    gradients, losses, aux, states and outputs, over two calls that carry state and
    traces, with a mask and a mean; and after a reset."""
    batched, xs, ys = setup(rule)
    mapped = setup_vmap(rule)
    mapped.params = batched.params
    assert [g.varshape for g in mapped.graph.hidden_groups] == [(5,)]  # one sample
    assert [g.varshape for g in batched.graph.hidden_groups] == [(2, 5)]
    mask = jnp.asarray([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    cases: list[tuple[Array | None, Literal["sum", "mean"]]] = [(None, "sum"), (mask, "mean")]
    for m, how in cases:
        for lrn in (batched, mapped):
            lrn.reset()
        for _ in range(2):
            want, want_l, want_y = batched.etrace_grad(
                xs, ys, mse_and_output, mask=m, reduction=how, has_aux=True, return_value=True
            )
            got, got_l, got_y = mapped.etrace_grad(
                xs, ys, mse_and_output, mask=m, reduction=how, has_aux=True, return_value=True
            )
            for p in want:
                assert rel(got[p], want[p]) < TOL, p
            np.testing.assert_allclose(got_l, want_l, rtol=1e-12)
            np.testing.assert_allclose(got_y, want_y, rtol=1e-12)
            for p, h in batched.state.hidden.items():
                np.testing.assert_allclose(mapped.state.hidden[p], h, rtol=1e-12)
    np.testing.assert_allclose(
        mapped.etrace_evolve(xs, return_outputs=True),
        batched.etrace_evolve(xs, return_outputs=True),
        rtol=1e-12,
    )
    np.testing.assert_allclose(mapped(xs[0]), batched(xs[0]), rtol=1e-12)
    want_b = batched.bptt_grad(xs, ys, mse)
    got_b = mapped.bptt_grad(xs, ys, mse)
    for p in want_b:
        assert rel(got_b[p], want_b[p]) < TOL, p
    # a vmap learner may be reset to another batch size
    mapped.reset(batch_size=3)
    assert all(h.shape[0] == 3 for h in mapped.state.hidden.values())
    assert mapped.etrace_grad(xs[:, [0, 1, 1]], ys[:, [0, 1, 1]], mse).keys() == want.keys()


@pytest.mark.parametrize("cell", [etrax.nn.GRUCell, brainstate.nn.GRUCell], ids=["etrax", "bst"])
def test_reinitialised_states_are_refused_and_reset_keeps_them(cell: Any) -> None:
    """``brainstate.nn.init_all_states`` after `etrax.compile` creates new states the
    learner would never see: every call then raises a `StepInputError` that says to
    use `reset` (which resets the states in place, so calls keep working)."""
    model = cell(3, 4)
    learner = etrax.compile(model, etrax.DRTRL(), jnp.zeros((2, 3)), batch_size=2)
    xs, ys = jnp.ones((3, 2, 3)), jnp.zeros((3, 2, 4))

    def mse(y: Array, t: Array) -> Array:
        return jnp.sum((y - t) ** 2)

    learner.etrace_grad(xs, ys, mse)
    learner.reset()
    learner.etrace_grad(xs, ys, mse)
    assert float(jnp.abs(model.h.value).max()) > 0  # the model's own state was written
    brainstate.nn.init_all_states(model, batch_size=2)
    for call in (
        lambda: learner.etrace_grad(xs, ys, mse),
        lambda: learner.etrace_evolve(xs),
        lambda: learner(xs[0]),
        lambda: learner.bptt_grad(xs, ys, mse),
        learner.reset,
    ):
        with pytest.raises(etrax.StepInputError, match=r"learner\.reset"):
            call()


class _LeakyReadout(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 6)
        self.out = etrax.nn.Linear(6, 2)

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((6,) if batch_size is None else (batch_size, 6)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.8 * self.h.value + jnp.tanh(self.fc(x))
        return self.out(self.h.value)


def _sq(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def _seq(T: int, B: int, seed: int = 0) -> tuple[Array, Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, (T, B, 3)), jax.random.normal(k2, (T, B, 2))


def _close(a: Any, b: Any) -> None:
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-10, atol=1e-12)


def test_bptt_grad_in_the_middle_of_a_sequence_moves_the_traces_on() -> None:
    """``etrace_grad``, then ``bptt_grad`` on the next steps, then ``etrace_grad``
    gives the last call's gradient of the uninterrupted sequence (the traces advance
    with the hidden states, as in ``etrace_evolve``)."""
    xs, ys = _seq(9, 2)
    brainstate.random.seed(0)
    a = etrax.compile(_LeakyReadout(), etrax.DRTRL(), xs[0], batch_size=2)
    brainstate.random.seed(0)
    b = etrax.compile(_LeakyReadout(), etrax.DRTRL(), xs[0], batch_size=2)
    a.etrace_grad(xs[:3], ys[:3], _sq)
    a.etrace_evolve(xs[3:6])
    want = a.etrace_grad(xs[6:], ys[6:], _sq)
    b.etrace_grad(xs[:3], ys[:3], _sq)
    b.bptt_grad(xs[3:6], ys[3:6], _sq)
    _close(b.etrace_grad(xs[6:], ys[6:], _sq), want)


class _WithUnusedWeight(_LeakyReadout):
    def __init__(self) -> None:
        super().__init__()
        self.spare = brainstate.ParamState(jnp.ones(6))  # e.g. a head used only elsewhere


def test_a_weight_the_step_never_reads_is_reported_and_left_out() -> None:
    """A `ParamState` that ``update`` never reads has no entry in the learner's
    parameters or gradients, and the report says so, with what to do (not that its
    gradient is zero, which would suggest an entry)."""
    xs, ys = _seq(3, 2)
    model = _WithUnusedWeight()
    learner = etrax.compile(model, etrax.DRTRL(), xs[0], batch_size=2)
    grads = learner.etrace_grad(xs, ys, _sq)
    assert ("spare",) not in learner.params
    assert ("spare",) not in grads
    assert set(grads) == set(learner.params)
    assert learner.weight_rules()[("spare",)].rule is etrax.WeightRule.UNUSED
    (record,) = [
        r
        for r in learner.graph.explain(kind=etrax.DiagnosticKind.STATE_MISMATCH)
        if r.weight_path == ("spare",)
    ]
    assert record.level is etrax.DiagnosticLevel.WARNING
    assert "left out of" in record.message and "learner.params" in record.message
    assert "zero" not in record.message


def test_reset_returns_to_the_compiled_batch_size_and_its_initial_values() -> None:
    """``reset()`` defaults to the batch size given to `etrax.compile`, and a hidden
    state that no ``reset_state`` resets gets its initial value back, even after a
    reset to another batch size."""
    xs, ys = _seq(4, 3)
    model = _LeakyReadout()
    learner = etrax.compile(model, etrax.DRTRL(), xs[0], batch_size=3)
    initial = jnp.asarray(model.h.value)
    learner.etrace_grad(xs, ys, _sq)
    learner.reset(batch_size=2)
    learner.reset()
    assert learner.batch_size == 3
    np.testing.assert_array_equal(model.h.value, initial)
    learner.etrace_grad(xs, ys, _sq)


def test_the_learner_carries_dnis_synthesiser_between_calls() -> None:
    """With `DNI`, each `etrace_grad` call trains the synthesiser and the next starts
    from it, as the functional form with ``synthesiser=aux["synthesiser"]`` does."""
    xs, ys = _seq(6, 2)
    brainstate.random.seed(0)
    model = _LeakyReadout()
    learner = etrax.compile(model, etrax.DNI(0.1), xs[0], batch_size=2)
    graph, rule = learner.graph, learner.algorithm
    state, synth = etrax.state_of(graph), None
    traces = rule.init(graph, state)
    for _ in range(3):
        got = learner.etrace_grad(xs, ys, _sq, window=3)
        res = etrax.online_grad(
            graph, rule, state, traces, xs, ys, _sq, window=3, synthesiser=synth
        )
        state, traces, synth = res.state, res.traces, res.synthesiser
        _close(got, res.grads)
    assert learner.synthesiser is not None
    with pytest.raises(ValueError, match="synthesiser"):
        etrax.compile(_LeakyReadout(), etrax.DNI(), xs[0], batch_size=2, vmap=True)


def test_snap_runs_in_a_vmap_learner_as_in_a_batched_one() -> None:
    xs, ys = _seq(4, 3)
    brainstate.random.seed(0)
    batched = etrax.compile(_LeakyReadout(), etrax.SnAp(2), xs[0], batch_size=3)
    brainstate.random.seed(0)
    mapped = etrax.compile(_LeakyReadout(), etrax.SnAp(2), xs[0], batch_size=3, vmap=True)
    _close(mapped.etrace_grad(xs, ys, _sq), batched.etrace_grad(xs, ys, _sq))


def _same(a: Any, b: Any) -> bool:
    return all(
        np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _projection(learner: etrax.OnlineLearner) -> etrax.ProjectionTraces:
    assert isinstance(learner.traces, etrax.ProjectionTraces)
    return learner.traces


def test_uoro_draws_fresh_noise_per_sample_and_sequence_and_resumes(
    tmp_path: pathlib.Path,
) -> None:
    """A learner gives `UORO`'s noise its own stream per sample (``vmap=True``, where
    the rule's ``init`` gives every sample one key) and per sequence (each ``reset``
    derives a new key from the last), and a run resumed from a checkpoint draws what
    the saved run would have, across a ``reset``."""
    xs, ys = _seq(4, 3)
    same = jnp.broadcast_to(xs[:, :1], xs.shape)  # every sample sees the same inputs
    brainstate.random.seed(0)
    mapped = etrax.compile(
        _LeakyReadout(), etrax.UORO(jax.random.key(7)), xs[0], batch_size=3, vmap=True
    )
    mapped.etrace_grad(same, ys, _sq)
    traces = _projection(mapped)
    keys = jax.random.key_data(traces.key)
    assert len({tuple(np.asarray(k)) for k in keys}) == 3
    tilde = traces.s[0]  # ŝ per sample: the same inputs, other noise
    assert not np.allclose(tilde[0], tilde[1]) and not np.allclose(tilde[1], tilde[2])

    def learner() -> etrax.OnlineLearner:
        brainstate.random.seed(0)
        rule = etrax.UORO(jax.random.key(7))
        return etrax.compile(_LeakyReadout(), rule, xs[0], batch_size=3)

    first = learner()
    before = first.etrace_grad(xs, ys, _sq)
    first.save(tmp_path / "uoro.eqx")
    key = _projection(first).key
    first.reset()
    assert not np.array_equal(jax.random.key_data(_projection(first).key), jax.random.key_data(key))
    again = first.etrace_grad(xs, ys, _sq)  # the same sequence, new noise
    exact = ("out", "weight")  # the readout's gradient has no noise
    assert _same(again[exact], before[exact])
    assert not _same(again[("fc", "weight")], before[("fc", "weight")])
    resumed = learner()
    resumed.load(tmp_path / "uoro.eqx")
    resumed.reset()
    assert _same(resumed.etrace_grad(xs, ys, _sq), again)


def test_an_all_zero_mask_is_not_a_silent_network_and_losses_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk whose mask scores no step has a zero gradient by design: no
    `SilentNetworkWarning` (one scored step with a dead input still warns); and a new
    loss function per call keeps at most `MAX_PROGRAMS` wrapped losses (lowered to 3
    here: each new loss compiles a program)."""
    from etrax.algorithms import _learner

    monkeypatch.setattr(_learner, "MAX_PROGRAMS", 3)
    learner, xs, ys = setup(etrax.DRTRL())
    with warnings.catch_warnings():
        warnings.simplefilter("error", etrax.SilentNetworkWarning)
        learner.etrace_grad(xs, ys, mse, mask=jnp.zeros(T))
    with pytest.warns(etrax.SilentNetworkWarning, match="every gradient is exactly zero"):
        learner.etrace_grad(xs, ys, lambda y, t: 0.0 * mse(y, t), mask=jnp.ones(T))

    def scaled(k: int) -> Callable[[Array, Array], Array]:
        return lambda y, t: mse(y, t) * (1.0 + k)

    for k in range(_learner.MAX_PROGRAMS + 2):
        learner.etrace_grad(xs, ys, scaled(k), reduction="mean")
        assert len(learner._weighted_losses) <= _learner.MAX_PROGRAMS
        assert len(learner._programs) <= _learner.MAX_PROGRAMS
    assert len(learner._weighted_losses) == _learner.MAX_PROGRAMS


def recording_jit_options(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Patch `jax.jit` to record the ``compiler_options`` of every program jitted until
    ``monkeypatch.undo()``; returns the list it fills."""
    seen: list[object] = []
    jit = jax.jit

    def recording_jit(fn: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("compiler_options"))
        return jit(fn, **kwargs)

    monkeypatch.setattr(jax, "jit", recording_jit)
    return seen


def test_compiler_options_reach_every_program_and_keep_the_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`compile(..., compiler_options=...)`: every program of the learner is jitted
    with the options (XLA:CPU's older element-wise emitters here), the gradients
    equal the default learner's, and the learner keeps the options read-only."""
    options = {"xla_cpu_use_fusion_emitters": False}
    brainstate.random.seed(0)
    model = LeakyTanhReadout(3, 5)
    learner = etrax.compile(
        model, etrax.PPProp(0.8), jnp.zeros((2, 3)), batch_size=2, compiler_options=options
    )
    assert dict(learner.compiler_options or {}) == options
    with pytest.raises(TypeError):
        learner.compiler_options["xla_cpu_use_fusion_emitters"] = True  # type: ignore[index]
    options["xla_cpu_use_fusion_emitters"] = True  # the learner keeps its own copy
    assert dict(learner.compiler_options or {}) == {"xla_cpu_use_fusion_emitters": False}
    default, xs, ys = setup(etrax.PPProp(0.8))
    assert default.compiler_options is None
    seen = recording_jit_options(monkeypatch)
    got = learner.etrace_grad(xs, ys, mse)
    learner.etrace_evolve(xs)
    monkeypatch.undo()
    assert len(seen) == 2
    assert all(o == {"xla_cpu_use_fusion_emitters": False} for o in seen), seen
    want = default.etrace_grad(xs, ys, mse)
    assert rel(got, want) < TOL


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ([("xla_cpu_use_fusion_emitters", False)], TypeError, "must be a mapping"),
        ({"xla_cpu_use_fusion_emitters": [False]}, TypeError, "str, bool, int or float"),
        ({1: False}, TypeError, "option names"),
        ({"xla_no_such_option": 1}, ValueError, "xla_no_such_option"),
        ({"xla_cpu_use_fusion_emitters": 0}, ValueError, "True or False"),
    ],
)
def test_compiler_options_xla_refuses_fail_when_the_learner_is_built(
    options: Any, error: type[Exception], match: str
) -> None:
    """Options of the wrong form, an option this XLA does not know, or a value of the
    wrong type fail in `etrax.compile`, not at the first training call (etrax's own
    checks: the suite's runtime type checks paused)."""
    with typechecks_paused(), pytest.raises(error, match=match):
        etrax.compile(
            LeakyTanhReadout(3, 5),
            "d_rtrl",
            jnp.zeros((2, 3)),
            batch_size=2,
            compiler_options=options,
        )


def test_compiler_options_are_checked_by_value_and_type() -> None:
    """XLA's answer is cached per set of options, keyed by type as well as value:
    ``True`` is accepted for a bool option, and ``1`` (equal to ``True``, so the same
    key in a plain cache) is still refused after it."""
    model = LeakyTanhReadout(3, 5)
    ok = etrax.compile(
        model,
        "d_rtrl",
        jnp.zeros((2, 3)),
        batch_size=2,
        compiler_options={"xla_cpu_use_fusion_emitters": True},
    )
    assert dict(ok.compiler_options or {}) == {"xla_cpu_use_fusion_emitters": True}
    with pytest.raises(ValueError, match="True or False"):
        etrax.compile(
            model,
            "d_rtrl",
            jnp.zeros((2, 3)),
            batch_size=2,
            compiler_options={"xla_cpu_use_fusion_emitters": 1},
        )


ONE_SAMPLE = dict(etrax.algorithms.ONE_SAMPLE_CPU_OPTIONS)


@pytest.mark.parametrize(
    ("batch_size", "vmap", "example", "want"),
    [
        (None, False, (3,), ONE_SAMPLE),  # no batch
        (1, False, (1, 3), ONE_SAMPLE),  # a batch of one
        (2, False, (2, 3), None),  # a batch: XLA's defaults
        (1, True, (1, 3), ONE_SAMPLE),  # one sample mapped once
        (2, True, (2, 3), None),  # one sample's graph mapped over a batch of 2
    ],
)
def test_auto_compiler_options_pick_the_older_emitters_on_one_sample_on_the_cpu(
    batch_size: int | None, vmap: bool, example: tuple[int, ...], want: dict[str, bool] | None
) -> None:
    """``compiler_options="auto"`` (the default) gives `etrace_grad`'s program for a
    model run on one sample on the CPU XLA:CPU's older element-wise emitters, and a
    batched one (or one sample's graph mapped over a batch) XLA's defaults; every other
    program keeps XLA's defaults; `default_compiler_options` says the same."""
    brainstate.random.seed(0)
    learner = etrax.compile(
        LeakyTanhReadout(3, 5), "d_rtrl", jnp.zeros(example), batch_size=batch_size, vmap=vmap
    )
    assert learner.compiler_options is None
    got = learner.grad_compiler_options
    assert (None if got is None else dict(got)) == want
    samples = batch_size if vmap and batch_size else 1
    direct = etrax.algorithms.default_compiler_options(learner.graph, etrax.DRTRL(), samples)
    assert (None if direct is None else dict(direct)) == want


@pytest.mark.parametrize(
    "rule",
    [
        etrax.DRTRL(chunk_steps=1),
        etrax.PPProp(0.9, chunk_steps=1),
        etrax.EProp(0.5, chunk_steps=1),
        etrax.SnAp(2),
    ],
    ids=["drtrl-per-step", "pp-prop-per-step", "eprop-per-step", "snap"],
)
def test_auto_compiler_options_keep_xla_defaults_for_per_step_traces(
    rule: etrax.OnlineAlgorithm[Any],
) -> None:
    """A rule whose loop updates trace-sized arrays at every step (``chunk_steps=1``,
    or a scope the fused chunk does not take) keeps XLA's defaults on one sample too:
    the older emitters' code for those kernels is several times slower."""
    brainstate.random.seed(0)
    learner = etrax.compile(LeakyTanhReadout(3, 5), rule, jnp.zeros(3))
    assert not rule.vector_steps(learner.graph)
    assert learner.grad_compiler_options is None
    assert etrax.algorithms.default_compiler_options(learner.graph, rule) is None
    chunked = (etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5))  # the control
    assert all(r.vector_steps(learner.graph) for r in chunked)


def test_auto_compiler_options_keep_xla_defaults_for_streamed_pp_prop() -> None:
    """pp-prop's streamed chunks (its default) keep XLA's defaults on one sample: its
    per-step loop is vector-sized like D-RTRL's and e-prop's, which get the older
    emitters (the control), but ran faster per step with XLA's defaults."""
    brainstate.random.seed(0)
    model = LeakyTanhReadout(3, 5)
    pp = etrax.PPProp(0.9)
    learner = etrax.compile(model, pp, jnp.zeros(3))
    assert pp.vector_steps(learner.graph) and pp.streams(learner.graph)
    assert learner.grad_compiler_options is None
    assert etrax.algorithms.default_compiler_options(learner.graph, pp) is None
    for rule in (etrax.DRTRL(), etrax.EProp(0.5)):  # vector-sized, not streamed
        assert not rule.streams(learner.graph)
        got = etrax.algorithms.default_compiler_options(learner.graph, rule)
        assert got is not None and dict(got) == ONE_SAMPLE


def test_auto_compiler_options_are_xla_defaults_off_the_cpu_or_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On another backend, "auto" leaves XLA's defaults; ``None`` asks for XLA's
    defaults on one sample too; another string is a `TypeError` that names "auto"."""
    brainstate.random.seed(0)
    model = LeakyTanhReadout(3, 5)
    plain = etrax.compile(model, "d_rtrl", jnp.zeros(3), compiler_options=None)
    assert plain.compiler_options is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert etrax.compile(model, "d_rtrl", jnp.zeros(3)).grad_compiler_options is None
    monkeypatch.undo()
    with typechecks_paused(), pytest.raises(TypeError, match="'auto'"):
        etrax.compile(model, "d_rtrl", jnp.zeros(3), compiler_options="fast")  # type: ignore[arg-type]


def test_auto_compiler_options_keep_the_gradients_on_one_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One sample: the learner compiled with the "auto" options gives the gradients of
    brainstate's own update under `jax.grad` (D-RTRL is exact on this model);
    `etrace_grad`'s program is jitted with the older emitters, `etrace_evolve`'s (which
    updates the traces at every step) with XLA's defaults."""
    brainstate.random.seed(0)
    model = LeakyTanhReadout(3, 5)
    learner = etrax.compile(model, etrax.DRTRL(), jnp.zeros(3))
    xs = jax.random.normal(jax.random.key(0), (T, 3))
    ys = jax.random.normal(jax.random.key(1), (T, 2))
    want = bptt_grads(model, etrax.state_of(learner.graph), xs, ys, mse)
    seen = recording_jit_options(monkeypatch)
    got = learner.etrace_grad(xs, ys, mse)
    learner.etrace_evolve(xs)
    monkeypatch.undo()
    assert seen == [ONE_SAMPLE, None], seen
    for p in want:
        assert rel(got[p], want[p]) < TOL, p


def test_auto_compiler_options_probe_xla_once_per_process() -> None:
    """A one-sample learner with the "auto" options asks XLA once per process whether
    it knows them (one tiny program, when they are first read), and compiles nothing
    for that on later reads or builds."""
    from etrax.algorithms import _learner

    brainstate.random.seed(0)
    model = LeakyTanhReadout(3, 5)
    brainstate.nn.init_all_states(model)  # its eager zero states, compiled outside the count
    etrax.compile(model, "d_rtrl", jnp.zeros(3), compiler_options=None)  # warms the rest
    _learner._refused_by_xla.cache_clear()
    with CompileCount() as built:
        learner = etrax.compile(model, "d_rtrl", jnp.zeros(3))
    with CompileCount() as first:
        assert learner.grad_compiler_options is not None
    with CompileCount() as second:
        assert etrax.compile(model, "d_rtrl", jnp.zeros(3)).grad_compiler_options is not None
    assert (built.count, first.count, second.count) == (0, 1, 0)


def test_a_new_rule_assigned_to_the_learner_is_the_one_that_runs() -> None:
    """Assigning ``learner.algorithm`` drops the programs built for the old rule (they
    closed over it: the old rule ran, silently) and starts fresh traces."""
    learner, xs, ys = setup(etrax.PPProp(0.9))
    learner.etrace_grad(xs, ys, mse)
    learner.algorithm = etrax.PPProp(0.2)
    learner.reset()
    switched = learner.etrace_grad(xs, ys, mse)
    fresh, _, _ = setup(etrax.PPProp(0.2))
    old, _, _ = setup(etrax.PPProp(0.9))
    assert rel(switched, fresh.etrace_grad(xs, ys, mse)) < TOL
    assert rel(switched, old.etrace_grad(xs, ys, mse)) > 1e-3  # negative control
    learner.algorithm = "d_rtrl"  # a name, as etrax.compile takes; new traces' type
    assert isinstance(learner.traces, etrax.ParamTraces)
    with pytest.raises(AttributeError):
        learner.graph = fresh.graph  # type: ignore[misc]  # read-only, under test


def test_the_learner_says_what_it_is_and_refuses_params_that_are_not_a_mapping() -> None:
    learner, _, _ = setup(etrax.DRTRL())
    assert repr(learner) == (
        "OnlineLearner(LeakyTanhReadout, DRTRL, batch_size=2; 1 hidden group, 1 traced relation)"
    )
    with pytest.raises(TypeError, match="mapping from parameter path"):
        learner.params = list(learner.params.values())
