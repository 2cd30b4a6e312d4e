"""Learning rules as points on axes: validation, presets by name, and the rules beyond
D-RTRL / pp-prop / e-prop (three-factor, random feedback, scalar leak, no recursion,
OSTL feed-forward, low-precision traces), each against an independent oracle."""

import warnings
from typing import Any

import brainstate
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax
from etrax._typing import Path

from .compiles import CompileCount
from .models import LeakyTanh, LeakyTanhReadout, build
from .oracles import bptt_grads

TOL = 1e-10


def mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def linear_loss(y: Array, t: Array) -> Array:
    """``Σ y · t``: its output cotangent is the target, whatever the readout."""
    return jnp.sum(y * t)


def rel(a: Any, b: Any) -> float:
    worst = 0.0
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        scale = float(np.max(np.abs(v))) if v.size else 0.0
        worst = max(worst, float(np.max(np.abs(u - v))) / (scale if scale > 0 else 1.0))
    return worst


def problem(
    model: brainstate.nn.Module, x: Array, T: int, seed: int = 0
) -> tuple[etrax.ETraceGraph, etrax.ModelState, Array, Array]:
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.key(seed), (T, *x.shape), x.dtype)
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.key(seed + 1), (T, *y0.shape), y0.dtype)
    return graph, state, xs, ts


def online(
    algo: etrax.OnlineAlgorithm[Any],
    graph: etrax.ETraceGraph,
    state: etrax.ModelState,
    xs: Array,
    ts: Array,
    loss: Any = mse,
    **kw: Any,
) -> dict[Path, Any]:
    grads, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, loss, **kw)
    return dict(grads)


def traced_paths(graph: etrax.ETraceGraph) -> list[Path]:
    rules = graph.weight_rules()
    return [p for p, r in rules.items() if r.rule is etrax.WeightRule.TRACED]


# --- construction -------------------------------------------------------------------------


def test_invalid_axis_combinations_are_construction_errors() -> None:
    with pytest.raises(ValueError, match="factorisation InputOutput and filter Kappa"):
        etrax.LearningRule(etrax.InputOutput(0.5), filter=etrax.Kappa(0.5))
    # refused by the suite's runtime type checks, or without them by the rule's own check
    with pytest.raises(TypeError, match="recursion"):
        etrax.LearningRule(etrax.PerParameter(), "jacobian")  # type: ignore[arg-type]  # the error under test
    with pytest.raises(ValueError, match="decay must be in"):
        etrax.ScalarLeak(1.0)
    with pytest.raises(ValueError, match="kappa must be in"):
        etrax.Kappa(0.0)
    with pytest.raises(TypeError, match="trace_dtype must be a float dtype"):
        etrax.DRTRL(trace_dtype="int8")
    with pytest.raises(ValueError, match="chunk_steps"):
        etrax.LearningRule(etrax.PerParameter(), chunk_steps=0)


def test_presets_are_points_on_the_axes() -> None:
    d = etrax.DRTRL(chunk_steps=1)
    assert d == etrax.LearningRule(etrax.PerParameter(), name="DRTRL")
    assert isinstance(etrax.PPProp(0.5).factorisation, etrax.InputOutput)
    e = etrax.EProp(kappa=0.5, feedback="random", key=jax.random.key(0))
    assert isinstance(e.filter, etrax.Kappa) and isinstance(e.signal, etrax.RandomFeedback)
    assert isinstance(etrax.ThreeFactor().signal, etrax.Modulatory)
    assert isinstance(etrax.OSTLFeedforward().recursion, etrax.NoRecursion)
    # a coordinate changed with eqx.tree_at is a new rule
    leaky = eqx.tree_at(lambda r: r.recursion, d, etrax.ScalarLeak(0.5))
    assert isinstance(leaky.recursion, etrax.ScalarLeak) and leaky != d


def test_compile_accepts_every_preset_name() -> None:
    for name, kind in (
        ("D_RTRL", etrax.PerParameter),
        ("pp-prop", etrax.InputOutput),
        ("ES_D_RTRL", etrax.InputOutput),
        ("EProp", etrax.PerParameter),
        ("OSTL_FeedForward", etrax.InputOutput),
        ("Three-Factor", etrax.PerParameter),
        ("OSTL_Recurrent", etrax.PerParameter),
        ("SnAp", etrax.PerParameter),
        ("UORO", etrax.RandomProjection),
        ("dni", etrax.PerParameter),
    ):
        model, x = build(LeakyTanh, 3, 4)
        learner = etrax.compile(model, name, x)
        assert isinstance(learner.algorithm, etrax.LearningRule), name
        assert isinstance(learner.algorithm.factorisation, kind), name
    model, x = build(LeakyTanh, 3, 4)
    assert isinstance(etrax.compile(model, etrax.DRTRL, x).algorithm, etrax.LearningRule)
    with pytest.raises(ValueError, match=r"unknown learning rule 'rtrl'.*three_factor"):
        etrax.compile(model, "rtrl", x)


# --- recursion ------------------------------------------------------------------------------


class NoMemory(brainstate.nn.Module):
    """``h ← tanh(x W + b)``: a hidden state with no dependence on its past (D = 0)."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.fc = etrax.nn.Linear(n_in, n)
        self.out = etrax.nn.Linear(n, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        self.h.value = jnp.tanh(self.fc(x))
        out: Array = self.out(self.h.value)
        return out


def test_ostl_feedforward_is_exact_without_memory() -> None:
    model, x = build(NoMemory, 3, 4)
    graph, state, xs, ts = problem(model, x, T=5)
    ref = bptt_grads(model, state, xs, ts, mse)
    got = online(etrax.OSTLFeedforward(), graph, state, xs, ts)
    for p in ref:
        assert rel(got[p], ref[p]) < TOL, p


def test_no_recursion_equals_ostl_feedforward_and_differs_from_drtrl() -> None:
    """Two engines (per-parameter and input/output) without recursion both give the sum of
    each step's instantaneous traced gradient; D-RTRL (with memory) differs."""
    model, x = build(LeakyTanh, 3, 4)
    graph, state, xs, ts = problem(model, x, T=5)
    none = online(
        etrax.LearningRule(etrax.PerParameter(), etrax.NoRecursion()), graph, state, xs, ts
    )
    ostl = online(etrax.OSTLFeedforward(), graph, state, xs, ts)
    drtrl = online(etrax.DRTRL(chunk_steps=1), graph, state, xs, ts)
    for p in none:
        assert rel(none[p], ostl[p]) < TOL, p
    assert max(rel(none[p], drtrl[p]) for p in traced_paths(graph)) > 1e-3


def test_scalar_leak_equals_drtrl_when_the_leak_is_the_dynamics() -> None:
    """``h ← 0.5 h + x W + b`` has ``D = 0.5`` exactly: ScalarLeak(0.5) equals D-RTRL (and
    BPTT) there, chunked or not, and a different leak changes the result."""
    from .models import LeakyLinear

    model, x = build(LeakyLinear, 3, 4)
    graph, state, xs, ts = problem(model, x, T=6)
    ref = bptt_grads(model, state, xs, ts, mse)
    for chunk in (1, 4):
        rule = etrax.LearningRule(etrax.PerParameter(), etrax.ScalarLeak(0.5), chunk_steps=chunk)
        got = online(rule, graph, state, xs, ts)
        for p in ref:
            assert rel(got[p], ref[p]) < TOL, (chunk, p)
    other = online(
        etrax.LearningRule(etrax.PerParameter(), etrax.ScalarLeak(0.9)), graph, state, xs, ts
    )
    assert max(rel(other[p], ref[p]) for p in traced_paths(graph)) > 1e-3


# --- three-factor ---------------------------------------------------------------------------


def true_signals(graph: etrax.ETraceGraph, state: etrax.ModelState, xs: Array, ts: Array) -> Array:
    """``∂L_t/∂h^t`` of the single hidden group at every step, through `etrax.step_vjp`."""
    out = []
    for t in range(xs.shape[0]):
        y, state, _, pullback = etrax.step_vjp(graph, state, xs[t])
        (signal,) = pullback(jax.grad(mse)(y, ts[t]))
        out.append(signal)
    return jnp.stack(out)


def test_three_factor_with_the_true_signal_equals_drtrl() -> None:
    model, x = build(LeakyTanhReadout, 3, 5)
    graph, state, xs, ts = problem(model, x, T=6)
    assert len(graph.hidden_groups) == 1
    ms = true_signals(graph, state, xs, ts)
    drtrl = online(etrax.DRTRL(chunk_steps=1), graph, state, xs, ts)
    for chunk in (1, 4):
        three = online(etrax.ThreeFactor(chunk), graph, state, xs, ts, modulators=ms)
        for p in drtrl:
            assert rel(three[p], drtrl[p]) < TOL, (chunk, p)
    ref = bptt_grads(model, state, xs, ts, mse)  # this model is exact under D-RTRL
    for p in ref:
        assert rel(drtrl[p], ref[p]) < TOL, p


def test_three_factor_modulator_is_data_step_by_step() -> None:
    model, x = build(LeakyTanhReadout, 3, 5)
    graph, state, xs, ts = problem(model, x, T=6)
    rule = etrax.ThreeFactor()
    traced = traced_paths(graph)
    assert traced
    zero = online(rule, graph, state, xs, ts, modulators=jnp.zeros((6,)))
    for p in traced:
        assert all(float(np.max(np.abs(g))) == 0.0 for g in jax.tree.leaves(zero[p])), p
    readout = ("readout", "weight")
    assert readout not in traced
    assert all(float(np.max(np.abs(g))) > 0 for g in jax.tree.leaves(zero[readout]))
    # a per-step scalar: a modulator only at step 2 gives that step's traces' gradient
    first = online(rule, graph, state, xs, ts, modulators=jnp.zeros((6,)).at[2].set(1.0))
    last = online(rule, graph, state, xs, ts, modulators=jnp.zeros((6,)).at[5].set(1.0))
    assert max(rel(first[p], last[p]) for p in traced) > 1e-3
    # modulators are data: new values (even weakly typed ones) reuse the compiled program
    from etrax.algorithms._drivers import _online_jit

    jitted: Any = _online_jit  # its cache size is not in JAX's annotations
    before = jitted._cache_size()
    online(rule, graph, state, xs, ts, modulators=jnp.full((6,), 0.5))
    assert jitted._cache_size() == before
    # per position: broadcast to (*varshape, S)
    per_unit = jnp.ones((6, 5, 1))
    ones = online(rule, graph, state, xs, ts, modulators=jnp.ones((6,)))
    per = online(rule, graph, state, xs, ts, modulators=per_unit)
    for p in traced:
        assert rel(per[p], ones[p]) < TOL
    with pytest.raises(ValueError, match="pass modulators="):
        online(rule, graph, state, xs, ts)
    with pytest.raises(ValueError, match="does not learn from a modulator"):
        online(etrax.DRTRL(), graph, state, xs, ts, modulators=jnp.ones((6,)))
    with pytest.raises(etrax.StepInputError, match="leading time axis of length T = 6"):
        online(rule, graph, state, xs, ts, modulators=jnp.ones((5,)))
    with pytest.raises(ValueError, match="windows compute that signal"):
        online(rule, graph, state, xs, ts, modulators=jnp.ones((6,)), window=2)


# --- random feedback ------------------------------------------------------------------------


def _scaled_readout(state: etrax.ModelState, factor: float) -> etrax.ModelState:
    params = dict(state.params)
    readout = params[("readout", "weight")]
    assert isinstance(readout, dict)
    params[("readout", "weight")] = {k: factor * v for k, v in readout.items()}
    return state.replace_params(params)


def test_random_feedback_does_not_depend_on_the_readout_weights() -> None:
    """With ``∂L/∂y`` fixed (a linear loss), scaling the readout by 5 leaves the traced
    gradients unchanged under random feedback, and scales them by 5 under the true signal."""
    model, x = build(LeakyTanhReadout, 3, 5)
    graph, state, xs, ts = problem(model, x, T=6)
    traced = traced_paths(graph)
    rfa = etrax.EProp(feedback="random", key=jax.random.key(3))
    sym = etrax.EProp()
    base_r = online(rfa, graph, state, xs, ts, linear_loss)
    base_s = online(sym, graph, state, xs, ts, linear_loss)
    big = _scaled_readout(state, 5.0)
    big_r = online(rfa, graph, big, xs, ts, linear_loss)
    big_s = online(sym, graph, big, xs, ts, linear_loss)
    for p in traced:
        assert rel(big_r[p], base_r[p]) < TOL, p
        assert rel(big_s[p], jax.tree.map(lambda g: 5.0 * g, base_s[p])) < TOL, p
    # the random signal is not the true one
    assert max(rel(base_r[p], base_s[p]) for p in traced) > 1e-2


def _train(rule: etrax.OnlineAlgorithm[Any], *, freeze: Path | None = None) -> list[float]:
    """Adam on a smoothing task (``z ← 0.7 z + 0.3 x[:2]``) for a leaky tanh network with a
    readout; returns the loss per iteration. `freeze` keeps one parameter fixed."""
    import optax

    brainstate.random.seed(0)
    model, x = build(LeakyTanhReadout, 3, 16, batch=8)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.key(0), (20, 8, 3), x.dtype)

    def smooth(z: Array, xt: Array) -> tuple[Array, Array]:
        z = 0.7 * z + 0.3 * xt[:, :2]
        return z, z

    _, ts = jax.lax.scan(smooth, jnp.zeros((8, 2), x.dtype), xs)

    def mean_sq(y: Array, t: Array) -> Array:
        return jnp.mean((y - t) ** 2)

    opt = optax.adam(0.01)
    params = dict(state.params)
    opt_state = opt.init(params)
    losses = []
    for _ in range(150):
        start = state.replace_params(params)
        grads, aux = etrax.online_grad(graph, rule, start, rule.init(graph, start), xs, ts, mean_sq)
        g = dict(grads)
        if freeze is not None:
            g[freeze] = jax.tree.map(jnp.zeros_like, g[freeze])
        losses.append(float(jnp.sum(aux["losses"])))
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 scalars
            updates, opt_state = opt.update(g, opt_state, params)
            params = optax.apply_updates(params, updates)
    return losses


@pytest.mark.slow
def test_random_feedback_learns_a_task() -> None:
    """Trained by e-prop with random feedback, the network lowers the task's loss to
    under 5 % of its start, and below what the readout alone reaches (so the randomly
    fed-back signal teaches the recurrent layer something)."""
    rule = etrax.EProp(feedback="random", key=jax.random.key(1))
    losses = _train(rule)
    readout_only = _train(rule, freeze=("rnn", "fc", "weight"))
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])
    assert losses[-1] < readout_only[-1], (losses[-1], readout_only[-1])


class FlatReadout(brainstate.nn.Module):
    """A batched leaky tanh layer whose readout is flattened (no batch axis)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LeakyTanhReadout(3, 5)

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.inner(x)
        return out.reshape(-1)


def test_random_feedback_refuses_outputs_that_do_not_fit_the_group() -> None:
    rule = etrax.EProp(feedback="random", key=jax.random.key(3))
    model, x = build(LeakyTanhReadout, 3, 5, batch=2)
    graph, state, xs, ts = problem(model, x, T=2)
    assert set(online(rule, graph, state, xs, ts)) == set(state.params)  # batched outputs fit
    flat, x = build(FlatReadout, batch=2)
    graph, state, xs, ts = problem(flat, x, T=2)
    with pytest.raises(ValueError, match="leading axes \\(a batch axis\\) equal the group's"):
        online(rule, graph, state, xs, ts)


# --- trace storage precision ----------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda d: etrax.DRTRL(4, trace_dtype=d), lambda d: etrax.PPProp(0.9, 4, trace_dtype=d)]
)
def test_bfloat16_traces_halve_memory_and_stay_close(make: Any) -> None:
    brainstate.environ.set(precision=32)
    model, x = build(LeakyTanhReadout, 3, 8, batch=4)
    graph, state, xs, ts = problem(model, x, T=24)
    full, low = make(None), make("bfloat16")
    t_full, t_low = full.init(graph, state), low.init(graph, state)

    def float_bytes(tree: Any) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating))

    assert all(
        a.dtype == jnp.bfloat16
        for a in jax.tree.leaves(t_low)
        if jnp.issubdtype(a.dtype, jnp.floating)
    )
    assert 2 * float_bytes(t_low) == float_bytes(t_full)
    g_full, _ = etrax.online_grad(graph, full, state, t_full, xs, ts, mse)
    g_low, aux_low = etrax.online_grad(graph, low, state, t_low, xs, ts, mse)
    assert str(jax.tree.structure(aux_low["traces"])) == str(jax.tree.structure(t_low))
    assert all(
        a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(aux_low["traces"]), jax.tree.leaves(t_low), strict=True)
    )
    for p in g_full:
        assert jax.tree.map(lambda g: g.dtype, g_low[p]) == jax.tree.map(
            lambda g: g.dtype, g_full[p]
        )
        assert rel(g_low[p], g_full[p]) < 3e-2, p


# --- coupled and sparse scopes (OSTL, SnAp) -------------------------------------------------


class ChainRNN(brainstate.nn.Module):
    """``h ← tanh(x W + h (U ⊙ M))`` with a chain mask ``M`` (unit ``q`` reads ``q`` and
    ``q − 1``): a sparse recurrent weight whose position graph has diameter ``n − 1``."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.win = etrax.nn.Linear(n_in, n)
        dtype = brainstate.environ.dftype()
        self.u = brainstate.ParamState(
            1.5 + 0.3 * jax.random.normal(jax.random.key(5), (n, n), dtype)
        )
        self.mask = jnp.eye(n, dtype=dtype) + jnp.eye(n, k=1, dtype=dtype)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        self.h.value = jnp.tanh(self.win(x) + self.h.value @ (self.u.value * self.mask))
        return self.h.value


def _max_rel(got: dict[Path, Any], ref: dict[Path, Any]) -> float:
    return max(rel(got[p], ref[p]) for p in ref)


class ReluRNN(brainstate.nn.Module):
    """etrax's vanilla RNN cell with its default ReLU and a readout: each unit's
    dependence on the others vanishes wherever it is off."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        brainstate.random.seed(0)
        self.rnn = etrax.nn.VanillaRNNCell(3, 5, activation=activation)
        self.out = etrax.nn.Linear(5, 2)

    def update(self, x: ArrayLike) -> Array:
        y: Array = self.out(self.rnn(x))
        return y


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_snap_probes_a_relu_transition_at_enough_points(activation: str) -> None:
    """ReLU units are off at about half of all points: the position graph is the union
    over the probes (SnAp-2 equals BPTT), and a `ProbeWarning` says the pattern
    depends on the point; a tanh cell (never flat) raises none."""
    model, x = build(ReluRNN, activation, batch=2)
    graph, state, xs, ts = problem(model, x, T=6)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        snap2 = online(etrax.SnAp(2), graph, state, xs, ts)
    probes = [w for w in seen if issubclass(w.category, etrax.ProbeWarning)]
    assert len(probes) == (activation == "relu")
    assert _max_rel(snap2, bptt_grads(model, state, xs, ts, mse)) < TOL


class MillivoltLIF(brainstate.nn.Module):
    """A recurrent LIF layer in millivolts (threshold −50, reset −65): the recurrent
    weight reads the previous spikes, which only change near the threshold, far from
    zero (`shift` = 0); with `shift` a ReLU RNN whose units only switch on above 3."""

    def __init__(self, shift: float | None = None) -> None:
        super().__init__()
        brainstate.random.seed(0)
        self.shift = shift
        self.fc = etrax.nn.Linear(3, 4)
        self.rec = etrax.nn.Linear(4, 4, b_init=None)
        self.lif = etrax.nn.LIF(4, tau=10.0, v_th=-50.0, v_reset=-65.0)
        self.ro = etrax.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        if self.shift is not None:
            self.h = brainstate.HiddenState(jnp.zeros(4, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        if self.shift is None:
            last = self.lif._spike(self.lif.V.value)
            y: Array = self.ro(self.lif(-4.0 + 2.0 * self.fc(x) + 3.0 * self.rec(last)))
            return y
        h = 0.9 * self.h.value + 6.0 * self.fc(x) + self.rec(jax.nn.relu(self.h.value - 3.0))
        self.h.value = h
        out: Array = self.ro(h)
        return out


def test_snap_probes_around_the_models_own_values() -> None:
    """SnAp's position graph is also probed around the model's current values: a
    membrane in millivolts only crosses its threshold there, so probing around zero
    alone found no dependence between positions (SnAp-2 silently ran as OSTLRecurrent,
    12 % off BPTT). Now SnAp-2 equals BPTT; and where the probes still find none
    although a weight reads the group's previous values (a ReLU that only opens above
    3), a `ProbeWarning` says SnAp runs as OSTLRecurrent there."""
    model, x = build(MillivoltLIF)
    graph, state, xs, ts = problem(model, x, T=8)
    xs = 1.0 + xs
    with pytest.warns(etrax.ProbeWarning, match="differ from point to point"):
        snap2 = online(etrax.SnAp(2), graph, state, xs, ts)
    assert _max_rel(snap2, bptt_grads(model, state, xs, ts, mse)) < TOL
    assert _max_rel(online(etrax.OSTLRecurrent(), graph, state, xs, ts), snap2) > 1e-3
    model, x = build(MillivoltLIF, 3.0)
    graph, state, xs, ts = problem(model, x, T=4)
    with pytest.warns(etrax.ProbeWarning, match="runs as OSTLRecurrent"):
        etrax.SnAp(2).init(graph, state)


@pytest.mark.parametrize("batch", [None, 2])
def test_snap_is_full_rtrl_on_a_dense_recurrent_weight(batch: int | None) -> None:
    """A dense recurrent weight reaches every position in one hop: SnAp-2 equals BPTT;
    SnAp-1 does not, and equals OSTLRecurrent (two separate kernels)."""
    from .models import TanhRNN

    model, x = build(TanhRNN, 3, 4, batch=batch)
    graph, state, xs, ts = problem(model, x, T=6)
    ref = bptt_grads(model, state, xs, ts, mse)
    snap2 = online(etrax.SnAp(2), graph, state, xs, ts)
    assert _max_rel(snap2, ref) < TOL
    snap1 = online(etrax.SnAp(1), graph, state, xs, ts)
    ostl = online(etrax.OSTLRecurrent(), graph, state, xs, ts)
    assert _max_rel(snap1, ostl) < TOL
    assert _max_rel(snap1, ref) > 1e-2
    drtrl = online(etrax.DRTRL(chunk_steps=1), graph, state, xs, ts)
    assert _max_rel(ostl, drtrl) > 1e-3  # the coupled block differs from D-RTRL's D
    # the traces cover one batch entry's positions: no op mixes the batch axis
    traces = etrax.SnAp(2).init(graph, state)
    widths = {a.shape[-2] for a in jax.tree.leaves(traces)}
    assert widths == {4}


def test_snap_follows_a_sparse_pattern() -> None:
    brainstate.random.seed(0)
    model, x = build(ChainRNN, 3, 6)
    graph, state, xs, ts = problem(model, x, T=7)
    ref = bptt_grads(model, state, xs, ts, mse)
    assert _max_rel(online(etrax.SnAp(6), graph, state, xs, ts), ref) < TOL  # diameter 5
    assert _max_rel(online(etrax.SnAp(5), graph, state, xs, ts), ref) > 1e-6
    traces = etrax.SnAp(3).init(graph, state)
    shapes = [a.shape for a in jax.tree.leaves(traces)]
    # (NB, [I,] O, K, S): each entry covers its own and the next two positions
    assert sorted(shapes) == sorted([(1, 6, 3, 1), (1, 3, 6, 3, 1), (1, 6, 6, 3, 1)]), shapes


def test_scope_errors() -> None:
    with pytest.raises(ValueError, match="needs the Jacobian recursion"):
        etrax.LearningRule(etrax.PerParameter(), etrax.ScalarLeak(0.5), etrax.Coupled())
    with pytest.raises(ValueError, match="axes factorisation and scope"):
        etrax.LearningRule(etrax.InputOutput(0.5), scope=etrax.Sparse(2))
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        etrax.Sparse(0)
    model, x = build(ChainRNN, 3, 6)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    tiny = etrax.LearningRule(etrax.PerParameter(), scope=etrax.Coupled(max_elements=10))
    with pytest.raises(etrax.CompilationError, match="max_elements=10"):
        tiny.init(graph, state)
    capped = etrax.LearningRule(etrax.PerParameter(), scope=etrax.Sparse(3, max_trace_elements=20))
    with pytest.raises(etrax.CompilationError, match="max_trace_elements=20"):
        capped.init(graph, state)


# --- UORO -----------------------------------------------------------------------------------


def _uoro_grads(
    graph: etrax.ETraceGraph, state: etrax.ModelState, xs: Array, ts: Array, keys: int
) -> np.ndarray:
    """UORO's gradient for `keys` noise keys (one vmapped call), flattened per key."""

    def one(key: Array) -> Array:
        rule = etrax.UORO(key)
        g = online(rule, graph, state, xs, ts)
        return jnp.concatenate([jnp.ravel(a) for p in sorted(g) for a in jax.tree.leaves(g[p])])

    return np.asarray(jax.vmap(one)(jax.random.split(jax.random.key(0), keys)))


def test_uoro_is_exact_at_one_step_and_unbiased() -> None:
    from .models import TanhRNN

    model, x = build(TanhRNN, 3, 4)
    graph, state, xs, ts = problem(model, x, T=4)
    ref_1 = bptt_grads(model, state, xs[:1], ts[:1], mse)
    one = online(etrax.UORO(jax.random.key(7)), graph, state, xs[:1], ts[:1])
    assert _max_rel(one, ref_1) < TOL
    ref = bptt_grads(model, state, xs, ts, mse)
    flat_ref = np.concatenate([np.ravel(a) for p in sorted(ref) for a in jax.tree.leaves(ref[p])])
    samples = _uoro_grads(graph, state, xs, ts, 1600)

    def err(block: np.ndarray) -> float:
        return float(np.linalg.norm(block.mean(axis=0) - flat_ref) / np.linalg.norm(flat_ref))

    # the mean over K keys converges like 1/√K: 16× the keys, about 4× smaller error
    err_100 = float(np.sqrt(np.mean([err(b) ** 2 for b in samples.reshape(16, 100, -1)])))
    err_1600 = err(samples)
    assert 2.0 < err_100 / err_1600 < 8.0, (err_100, err_1600)
    assert err_1600 < 0.1


class TwoStateRNN(brainstate.nn.Module):
    """``c ← 0.9 c + tanh(x W + h U)``, ``h ← tanh(c)``: S = 2 states per position."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.win = etrax.nn.Linear(n_in, n)
        self.rec = etrax.nn.Linear(n, n, b_init=None)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        dtype = brainstate.environ.dftype()
        self.h = brainstate.HiddenState(jnp.zeros((self.n,), dtype))
        self.c = brainstate.HiddenState(jnp.zeros((self.n,), dtype))

    def update(self, x: ArrayLike) -> Array:
        self.c.value = 0.9 * self.c.value + jnp.tanh(self.win(x) + self.rec(self.h.value))
        self.h.value = jnp.tanh(self.c.value)
        return self.h.value


def _largest_intermediate(
    rule: etrax.OnlineAlgorithm[Any], graph: etrax.ETraceGraph, state: etrax.ModelState, x: Array
) -> int:
    xs, ts = x[None], jnp.zeros((1, 8), x.dtype)
    jaxpr = jax.make_jaxpr(
        lambda s: etrax.online_grad(graph, rule, s, rule.init(graph, s), xs, ts, mse)
    )(state)

    def sizes(jp: Any) -> list[int]:
        out = [int(np.prod(v.aval.shape)) for e in jp.eqns for v in e.outvars]
        for e in jp.eqns:
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                out.extend(sizes(sub))
        return out

    return max(sizes(jaxpr.jaxpr))


def test_uoro_never_forms_the_full_jacobian() -> None:
    model, x = build(TwoStateRNN, 3, 8)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    assert graph.hidden_groups[0].num_state == 2
    full = (8 * 2) ** 2
    assert _largest_intermediate(etrax.UORO(jax.random.key(0)), graph, state, x) < full
    # negative control: the coupled scope does form it
    assert _largest_intermediate(etrax.OSTLRecurrent(), graph, state, x) >= full


# --- synthetic gradients (DNI) --------------------------------------------------------------


class PlainLeaky(brainstate.nn.Module):
    """``h ← 0.9 h + tanh(x W + fc(x))`` with ``W`` used plainly (not traced) and a
    readout: in windows, ``W`` sees only its window's credit."""

    def __init__(self) -> None:
        super().__init__()
        dtype = brainstate.environ.dftype()
        self.w = brainstate.ParamState(0.5 * jax.random.normal(jax.random.key(0), (3, 6), dtype))
        self.fc = etrax.nn.Linear(3, 6)
        self.out = etrax.nn.Linear(6, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (6,) if batch_size is None else (batch_size, 6)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        self.h.value = 0.9 * self.h.value + jnp.tanh(x @ self.w.value + self.fc(x))
        out: Array = self.out(self.h.value)
        return out


def test_dni_brings_windowed_gradients_closer_to_bptt() -> None:
    """Windows of 4 steps cut a 0.9-leaky memory; the plain weight's windowed gradient is
    far from BPTT's. After a synthesiser trained online on sequences of the same task,
    DNI's gradient is less than half as far, on held-out sequences."""
    model = PlainLeaky()
    brainstate.nn.init_all_states(model, batch_size=16)
    graph = etrax.compile_etrace_graph(
        model, jnp.zeros((16, 3)), policy=etrax.CompilePolicy(recognise_weight_ops=False)
    )
    assert graph.weight_rules()[("w",)].rule is etrax.WeightRule.INSTANTANEOUS
    state = etrax.state_of(graph)

    def data(k: int) -> tuple[Array, Array]:
        xs = 0.5 + 0.5 * jax.random.normal(jax.random.key(k), (20, 16, 3))
        return xs, jnp.full((20, 16, 2), 0.3)

    def mean_sq(y: Array, t: Array) -> Array:
        return jnp.mean((y - t) ** 2)

    dni = etrax.DNI(learning_rate=0.005)
    with CompileCount() as counted:
        synth = etrax.SyntheticGradient.zeros(graph)
    assert counted.count == 0  # made in NumPy, placed on the device: nothing compiled
    assert all(not np.any(a) for a in jax.tree.leaves(synth))
    for k in range(300):
        xs, ts = data(k)
        _, aux = etrax.online_grad(
            graph, dni, state, dni.init(graph, state), xs, ts, mean_sq, window=4,
            synthesiser=synth,
        )  # fmt: skip
        synth = aux["synthesiser"]
    plain, drtrl = ("w",), etrax.DRTRL(chunk_steps=1)
    with_synth, without = [], []
    for k in range(1000, 1005):
        xs, ts = data(k)
        ref, _ = etrax.bptt_grad(graph, state, xs, ts, mean_sq)
        g1, _ = etrax.online_grad(
            graph, dni, state, dni.init(graph, state), xs, ts, mean_sq, window=4,
            synthesiser=synth,
        )  # fmt: skip
        g0, _ = etrax.online_grad(
            graph, drtrl, state, drtrl.init(graph, state), xs, ts, mean_sq, window=4
        )
        with_synth.append(rel(g1[plain], ref[plain]))
        without.append(rel(g0[plain], ref[plain]))
        # the traced weight is unchanged by the synthesiser
        assert rel(g1[("fc", "weight")], g0[("fc", "weight")]) < TOL
    assert np.mean(without) > 0.3
    assert np.mean(with_synth) < 0.5 * np.mean(without), (with_synth, without)


def test_dni_errors() -> None:
    model = PlainLeaky()
    brainstate.nn.init_all_states(model)
    graph, state, xs, ts = problem(model, jnp.zeros((3,)), T=4)
    dni = etrax.DNI()
    with pytest.raises(ValueError, match="pass window=k"):
        online(dni, graph, state, xs, ts)
    with pytest.raises(ValueError, match=r"synthesiser= is for etrax\.DNI"):
        online(
            etrax.DRTRL(), graph, state, xs, ts, window=2,
            synthesiser=etrax.SyntheticGradient.zeros(graph),
        )  # fmt: skip
    for rate in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="learning_rate must be a positive finite number"):
            etrax.Bootstrapped(rate)
    wrong_dtype = r"float32.*SyntheticGradient\.zeros\(graph, 'float64'\)"
    with pytest.raises(etrax.StepInputError, match=wrong_dtype):
        online(
            dni, graph, state, xs, ts, window=2,
            synthesiser=etrax.SyntheticGradient.zeros(graph, "float32"),
        )  # fmt: skip


def test_hyper_parameters_given_as_numpy_or_0d_arrays() -> None:
    """Settings given as NumPy numbers or concrete 0-d arrays are their Python numbers,
    for every rule alike; a string or a float count is a `TypeError`; a raw PRNG key
    that JAX's default implementation cannot read is refused up front."""
    assert etrax.EProp(jnp.asarray(0.5)).filter == etrax.Kappa(0.5)
    assert etrax.ThreeFactor(np.int64(2)).chunk_steps == 2
    assert etrax.SnAp(np.int64(2)) == etrax.SnAp(2)
    assert etrax.LearningRule(etrax.PerParameter(), chunk_steps=np.int32(3)).chunk_steps == 3
    # (the runtime type checker of the test run refuses these first; without it,
    # etrax's own checks raise a TypeError that names the setting)
    with pytest.raises(TypeError):
        etrax.EProp("0.5")  # type: ignore[arg-type]
    for make in (etrax.DRTRL, etrax.ThreeFactor):
        with pytest.raises(TypeError):
            make(chunk_steps=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"raw key data must be uint32\[2\]"):
        etrax.UORO(jnp.zeros(4, jnp.uint32))


def test_drivers_return_named_results_that_unpack_as_before() -> None:
    model, x = build(LeakyTanhReadout, 3, 5)
    graph, state, xs, ts = problem(model, x, T=3)
    rule = etrax.DRTRL(chunk_steps=1)
    result = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, mse)
    grads, aux = result
    assert isinstance(result, etrax.OnlineResult)
    assert result.grads is grads and result.losses is aux["losses"]
    assert result.state is aux["state"] and result.traces is aux["traces"]
    assert result.synthesiser is None
    assert result.losses.shape == (3,)
    exact = etrax.bptt_grad(graph, state, xs, ts, mse)
    g, a = exact
    assert isinstance(exact, etrax.BPTTResult)
    assert exact.losses is a["losses"] and exact.grads is g
    np.testing.assert_allclose(exact.losses, result.losses, rtol=1e-12)


class Embedded(brainstate.nn.Module):
    """A leaky unit fed by an embedding of integer tokens, with a readout."""

    def __init__(self) -> None:
        super().__init__()
        brainstate.random.seed(1)
        self.emb = etrax.nn.Embedding(5, 4)
        self.ro = etrax.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((4,), brainstate.environ.dftype()))

    def update(self, idx: ArrayLike) -> Array:
        self.h.value = 0.7 * self.h.value + jnp.tanh(self.emb(idx))
        y: Array = self.ro(self.h.value)
        return y


@pytest.mark.parametrize(
    "rule",
    [etrax.DRTRL(), etrax.OSTLRecurrent(), etrax.SnAp(2), etrax.UORO(jax.random.key(0))],
    ids=lambda r: r.name,
)
def test_integer_inputs_in_every_trace_factorisation(rule: etrax.OnlineAlgorithm[Any]) -> None:
    """Integer op inputs (an embedding's token ids) keep their dtype in the traces
    that store them (UORO's), and every rule equals BPTT at T = 1, also for an index
    from the end (-1) and one past it (9: clamped to the last row, as JAX reads it)."""
    model = Embedded()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.asarray(0))
    state = etrax.state_of(graph)
    ts = jax.random.normal(jax.random.key(2), (1, 2))
    for index in (3, -1, 9):
        xs = jnp.array([index])
        got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, mse).grads
        want = bptt_grads(model, state, xs, ts, mse)
        assert np.any(np.asarray(want[("emb", "weight")])[4]) == (index != 3)
        assert _max_rel(dict(got), want) < TOL, index
    longer = jnp.array([3, 1, 4])  # and a longer sequence runs
    tl = jax.random.normal(jax.random.key(3), (3, 2))
    etrax.online_grad(graph, rule, state, rule.init(graph, state), longer, tl, mse)
