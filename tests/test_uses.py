"""Every use of every weight accounted for (float64).

Model families that once lost part of a gradient silently: a bias shared by a
traced and an untraced op, a weight tied between a recurrent op and a readout, an
op reaching a second group through an untraceable connection, hidden states of
different shapes that feed each other, and complex weights driving a real state.
Each is checked against `jax.grad` through brainstate's *own* ``update`` (not etrax's
programs): exact at T = 1 for every
algorithm, and at T = 4 exact wherever the traced part is exact by theory.
"""

from collections.abc import Callable, Mapping
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax
from etrax._typing import Path

from .oracles import bptt_grads

TOL = 1e-10


def _w(key: int, *shape: int, scale: float = 0.5) -> "brainstate.ParamState[Array]":
    value = scale * jax.random.normal(jax.random.PRNGKey(key), shape, brainstate.environ.dftype())
    return brainstate.ParamState(value)


def _zeros(*shape: int) -> "brainstate.HiddenState[Array]":
    return brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))


class SharedBias(brainstate.nn.Module):
    """``b[:n]`` biases a gate op that reaches ``h`` only through another weight op;
    ``b[n:]`` biases an op traced straight into ``h``."""

    def __init__(self, n_in: int = 3, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.U = _w(1, n_in, n)
        self.V = _w(2, n, n)
        self.W = _w(3, n_in, n)
        self.b = _w(4, 2 * n)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = _zeros(self.n)

    def update(self, x: Array) -> Array:
        b = self.b.value
        gate = jnp.tanh(etrax.matmul(x, self.U.value, b[: self.n]))
        h = 0.9 * self.h.value + etrax.matmul(gate, self.V.value)
        h = h + jnp.tanh(etrax.matmul(x, self.W.value, b[self.n :]))
        self.h.value = h
        return h


class TiedReadout(brainstate.nn.Module):
    """``W`` drives the recurrence and, transposed, reads it out."""

    def __init__(self, n_in: int = 3, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.W = _w(5, n_in, n)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = _zeros(self.n)

    def update(self, x: Array) -> Array:
        h = 0.8 * self.h.value + jnp.tanh(etrax.matmul(x, self.W.value))
        self.h.value = h
        return etrax.matmul(h, self.W.value.T)


class TwoGroupsOneOp(brainstate.nn.Module):
    """``y = x W`` feeds ``a (4,)`` element-wise and ``b (3,)`` through a slice."""

    def __init__(self, n_in: int = 3) -> None:
        super().__init__()
        self.W = _w(6, n_in, 4)
        self.V = _w(7, n_in, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.a = _zeros(4)
        self.b = _zeros(3)

    def update(self, x: Array) -> Array:
        y = etrax.matmul(x, self.W.value)
        a = 0.9 * self.a.value + y + etrax.matmul(x, self.V.value)
        b = 0.8 * self.b.value + jnp.tanh(y[:3])
        self.a.value = a
        self.b.value = b
        return jnp.concatenate([a, b])


class GlobalInhibition(brainstate.nn.Module):
    """A population ``v (n,)`` and a global inhibition ``c ()`` that feed each other."""

    def __init__(self, n_in: int = 3, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.W = _w(8, n_in, n)
        self.k = brainstate.ParamState(jnp.asarray(0.3, brainstate.environ.dftype()))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.v = _zeros(self.n)
        self.c = brainstate.HiddenState(jnp.zeros((), brainstate.environ.dftype()))

    def update(self, x: Array) -> Array:
        v = 0.9 * self.v.value + jnp.tanh(etrax.matmul(x, self.W.value)) - self.c.value
        c = 0.8 * self.c.value + self.k.value * jnp.mean(jnp.tanh(v))
        self.v.value = v
        self.c.value = c
        return v * c


class SliceFeeds(brainstate.nn.Module):
    """``b ← β·b + tanh(a^t[:3])`` with ``a (4,)``, ``b (3,)`` (``β = 0``: ``b`` keeps no
    memory of its own, so D-RTRL is exact through it)."""

    def __init__(self, beta: float, n_in: int = 3) -> None:
        super().__init__()
        self.beta = beta
        self.W = _w(9, n_in, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.a = _zeros(4)
        self.b = _zeros(3)

    def update(self, x: Array) -> Array:
        a = 0.9 * self.a.value + etrax.matmul(x, self.W.value)
        b = self.beta * self.b.value + jnp.tanh(a[:3])
        self.a.value = a
        self.b.value = b
        return b


# --- the oracle: jax.grad through brainstate's own update ---------------------------------


def _complex_dtype() -> Any:
    """The complex type of brainstate's float precision (complex128 at float64)."""
    real = jnp.dtype(brainstate.environ.dftype())
    return jnp.complex128 if real == jnp.float64 else jnp.complex64


class ComplexParts(brainstate.nn.Module):
    """A real state driven through complex values: ``z = x W + b`` with a complex bias
    ``b`` and ``u = x B`` with a complex weight ``B``, read through their real and
    imaginary parts. The traces are real, so the complex uses learn from their exact
    instantaneous gradient (a trace kept only the real part of theirs); ``W`` stays
    traced."""

    def __init__(self, n_in: int = 3, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.W = _w(12, n_in, n)
        complex_dtype = _complex_dtype()
        re, im = _w(13, n_in, n).value, _w(14, n_in, n).value
        self.B = brainstate.ParamState(jax.lax.complex(re, im).astype(complex_dtype))
        self.b = brainstate.ParamState(jnp.full((n,), 0.1 + 0.2j, complex_dtype))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = _zeros(self.n)

    def update(self, x: Array) -> Array:
        z = (x @ self.W.value).astype(self.b.value.dtype) + self.b.value
        u = x.astype(self.B.value.dtype) @ self.B.value
        drive = jnp.real(z) + 2.0 * jnp.imag(z) + 0.5 * jnp.real(u) - 0.3 * jnp.imag(u)
        h = 0.8 * self.h.value + jnp.tanh(drive)
        self.h.value = h
        return h


def brainstate_grads(
    model: brainstate.nn.Module,
    state: etrax.ModelState,
    xs: Array,
    targets: Array,
    loss_fn: Callable[[Any, Any], Array],
) -> dict[Path, Any]:
    """``∂/∂θ Σ_t loss(y_t, target_t)`` by `jax.grad` over a scan of ``model.update``
    itself, starting from the values in `state`."""
    fn = brainstate.transform.StatefulFunction(model.update, return_only_write=False)
    fn.make_jaxpr(xs[0])
    states = fn.get_states(xs[0])
    path_of = {st: p for p, st in model.states().items()}
    paths = [path_of[st] for st in states]
    params = {p: state.params[p] for p in paths if p in state.params}
    start = [state.value(p) for p in paths]

    def total(params: Mapping[Path, Any]) -> Array:
        vals = [params.get(p, v) for p, v in zip(paths, start, strict=True)]

        def body(vals: list[Any], inp: tuple[Array, Array]) -> tuple[list[Any], Array]:
            new, out = fn.jaxpr_call(vals, inp[0])
            new = [params.get(p, v) for p, v in zip(paths, new, strict=True)]
            return new, loss_fn(out, inp[1])

        _, losses = jax.lax.scan(body, vals, (xs, targets))
        return jnp.sum(losses)

    return dict(jax.grad(total)(params))


def mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def _random_hidden(graph: etrax.ETraceGraph, state: etrax.ModelState) -> etrax.ModelState:
    key = jax.random.PRNGKey(11)
    hidden = {}
    for p, v in state.hidden.items():
        key, sub = jax.random.split(key)
        hidden[p] = jax.random.normal(sub, jnp.shape(v), jnp.result_type(v))
    return state.replace_hidden(hidden)


def _setup(
    model: brainstate.nn.Module, T: int
) -> tuple[etrax.ETraceGraph, etrax.ModelState, Array, Array]:
    brainstate.nn.init_all_states(model)
    x0 = jnp.zeros(3, brainstate.environ.dftype())
    graph = etrax.compile_etrace_graph(model, x0)
    state = _random_hidden(graph, etrax.state_of(graph))
    xs = jax.random.normal(jax.random.PRNGKey(T), (T, 3), brainstate.environ.dftype())
    y0, _ = etrax.forward(graph, state, x0)
    targets = jax.random.normal(jax.random.PRNGKey(T + 1), (T, *jnp.shape(y0)), y0.dtype)
    return graph, state, xs, targets


ALGOS: dict[str, Callable[[], etrax.OnlineAlgorithm[Any]]] = {
    "drtrl": lambda: etrax.DRTRL(chunk_steps=1),
    "drtrl-chunk3": lambda: etrax.DRTRL(chunk_steps=3),
    "pp-prop": lambda: etrax.PPProp(decay=0.9),
    "eprop": lambda: etrax.EProp(kappa=0.5),
    "scalar-leak": lambda: etrax.LearningRule(etrax.PerParameter(), etrax.ScalarLeak(0.5)),
    "ostl-feedforward": lambda: etrax.OSTLFeedforward(),
    "ostl-recurrent": lambda: etrax.OSTLRecurrent(),
    "snap-2": lambda: etrax.SnAp(2),
    "uoro": lambda: etrax.UORO(jax.random.key(0)),
}

MODELS: dict[str, Callable[[], brainstate.nn.Module]] = {
    "shared-bias": SharedBias,
    "tied-readout": TiedReadout,
    "two-groups-one-op": TwoGroupsOneOp,
    "global-inhibition": GlobalInhibition,
    "slice-feeds": lambda: SliceFeeds(0.8),
    "complex-parts": ComplexParts,
}


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a), np.asarray(b)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0) if a.size else 0.0


def _online(
    graph: etrax.ETraceGraph,
    algo: etrax.OnlineAlgorithm[Any],
    state: etrax.ModelState,
    xs: Array,
    targets: Array,
    window: int | None = None,
) -> dict[Path, Any]:
    traces = algo.init(graph, state)
    grads, _ = etrax.online_grad(graph, algo, state, traces, xs, targets, mse, window=window)
    return dict(grads)


@pytest.fixture(scope="module")
def problems() -> dict[tuple[str, int], Any]:
    out: dict[tuple[str, int], Any] = {}
    for name, make in MODELS.items():
        model = make()
        for T in (1, 4):
            graph, state, xs, ts = _setup(model, T)
            out[(name, T)] = (graph, state, xs, ts, brainstate_grads(model, state, xs, ts, mse))
    return out


@pytest.mark.parametrize("algo_name", list(ALGOS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_every_parameter_is_exact_at_one_step(
    problems: dict[tuple[str, int], Any], model_name: str, algo_name: str
) -> None:
    graph, state, xs, ts, ref = problems[(model_name, 1)]
    for window in (None, 1) if algo_name == "drtrl" else (None,):
        got = _online(graph, ALGOS[algo_name](), state, xs, ts, window=window)
        assert set(got) == set(ref)
        for p in ref:
            err = _rel(got[p], ref[p])
            assert err < TOL, f"{model_name}/{algo_name}/window={window}: {p} off by {err:.2e}"
            assert float(np.max(np.abs(np.asarray(ref[p])))) > 0, f"{p}: oracle is zero"


# Parameters (and slices) whose traced part is exact by theory at T = 4 under D-RTRL.
EXACT_AT_4: dict[str, dict[Path, Callable[[Array], Array]]] = {
    "shared-bias": {("W",): lambda g: g, ("V",): lambda g: g, ("b",): lambda g: g[4:]},
    "tied-readout": {("W",): lambda g: g},
    "two-groups-one-op": {("V",): lambda g: g},
    "complex-parts": {("W",): lambda g: g},
}


@pytest.mark.parametrize("algo_name", ["drtrl", "drtrl-chunk3", "eprop-0"])
@pytest.mark.parametrize("model_name", list(EXACT_AT_4))
def test_traced_parts_are_exact_over_time(
    problems: dict[tuple[str, int], Any], model_name: str, algo_name: str
) -> None:
    graph, state, xs, ts, ref = problems[(model_name, 4)]
    algo = etrax.EProp(kappa=0.0) if algo_name == "eprop-0" else ALGOS[algo_name]()
    got = _online(graph, algo, state, xs, ts)
    for p, part in EXACT_AT_4[model_name].items():
        err = _rel(part(got[p]), part(ref[p]))
        assert err < TOL, f"{model_name}/{algo_name}: {p} off by {err:.2e} at T = 4"


@pytest.mark.parametrize("model_name", list(MODELS))
def test_full_window_is_exact_and_short_windows_differ(
    problems: dict[tuple[str, int], Any], model_name: str
) -> None:
    graph, state, xs, ts, ref = problems[(model_name, 4)]
    got = _online(graph, etrax.DRTRL(chunk_steps=1), state, xs, ts, window=4)
    for p in ref:
        assert _rel(got[p], ref[p]) < TOL, f"{model_name}: {p} with window = T"
    if model_name not in ("tied-readout",):  # D-RTRL is exact on it: windows change nothing
        short = _online(graph, etrax.DRTRL(chunk_steps=1), state, xs, ts, window=1)
        assert max(_rel(short[p], ref[p]) for p in ref) > 1e-6, "window=1 should be approximate"


def test_slice_without_memory_is_exact_over_time() -> None:
    """``a → b`` within a step crosses like a stacked layer: with no memory in ``b``,
    D-RTRL stays exact over time; with memory in ``b`` it does not (negative control)."""
    errs = []
    for beta in (0.0, 0.8):
        model = SliceFeeds(beta)
        graph, state, xs, ts = _setup(model, 4)
        ref = brainstate_grads(model, state, xs, ts, mse)
        got = _online(graph, etrax.DRTRL(chunk_steps=1), state, xs, ts)
        errs.append(_rel(got[("W",)], ref[("W",)]))
    assert errs[0] < TOL
    assert errs[1] > 1e-6


def test_weight_rules_report_every_use() -> None:
    model = SharedBias()
    graph, _, _, _ = _setup(model, 1)
    rules = graph.weight_rules()
    assert set(rules) == {("U",), ("V",), ("W",), ("b",)}
    b = rules[("b",)]
    assert b.rule is etrax.WeightRule.PARTLY_TRACED
    by_rule = sorted(u.rule.value for u in b.uses)
    assert by_rule == ["instantaneous", "traced"]
    (untraced,) = [u for u in b.uses if u.rule is etrax.UseRule.INSTANTANEOUS]
    assert untraced.reason is etrax.DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT
    assert rules[("U",)].rule is etrax.WeightRule.INSTANTANEOUS
    assert rules[("W",)].rule is etrax.WeightRule.TRACED
    text = str(graph.report())
    for p in rules:
        assert str(p) in text or ".".join(map(str, p)) in text

    tied = TiedReadout()
    graph, _, _, _ = _setup(tied, 1)
    w = graph.weight_rules()[("W",)]
    assert w.rule is etrax.WeightRule.PARTLY_TRACED
    assert sorted(u.rule.value for u in w.uses) == ["instantaneous", "traced"]


def test_complex_uses_are_reported_and_real_ones_traced() -> None:
    graph, _, _, _ = _setup(ComplexParts(), 1)
    rules = graph.weight_rules()
    assert rules[("W",)].rule is etrax.WeightRule.TRACED
    for p in (("B",), ("b",)):
        assert rules[p].rule is etrax.WeightRule.INSTANTANEOUS
        (use,) = rules[p].uses
        assert use.reason is etrax.DiagnosticKind.RELATION_EXCLUDED_UNSUPPORTED
    records = graph.explain(kind=etrax.DiagnosticKind.RELATION_EXCLUDED_UNSUPPORTED)
    assert len(records) == 2 and all("complex" in r.message for r in records)


class ComplexState(brainstate.nn.Module):
    """A complex diagonal recurrence (untraced: hidden states are traced only when
    real) driven through a complex weight ``B``, beside a real leaky state."""

    def __init__(self, n_in: int = 3, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.cdtype = _complex_dtype()
        self.B = brainstate.ParamState(
            jax.lax.complex(_w(15, n_in, n).value, _w(16, n_in, n).value)
        )
        self.W = _w(17, n_in, n)
        self.lam = jnp.exp(jax.lax.complex(jnp.full(n, -0.2), jnp.linspace(0.1, 1.0, n)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.z = brainstate.HiddenState(jnp.zeros(self.n, self.cdtype))
        self.h = _zeros(self.n)

    def update(self, x: Array) -> Array:
        z = self.lam.astype(self.cdtype) * self.z.value + x.astype(self.cdtype) @ self.B.value
        h = 0.8 * self.h.value + jnp.tanh(x @ self.W.value)
        self.z.value, self.h.value = z, h
        return h + jnp.real(z)


def test_a_weight_into_an_untraced_carried_state_says_so() -> None:
    """``B`` reaches only the complex state: its record names that state as carried
    without a trace (before: "reaches no hidden state ... e.g. a readout"), and every
    rule's one-step gradient is still exact."""
    model = ComplexState()
    graph, state, xs, ts = _setup(model, 1)
    (rec,) = graph.explain(
        weight_path=("B",), kind=etrax.DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL
    )
    assert "reaches [('z',)], which are carried across steps without a trace" in rec.message
    ref = brainstate_grads(model, state, xs, ts, mse)
    for name in ("drtrl", "pp-prop", "eprop"):
        got = _online(graph, ALGOS[name](), state, xs, ts)
        for p in ref:
            assert _rel(got[p], ref[p]) < TOL, f"{name}: {p}"


def test_linked_groups_are_reported() -> None:
    graph, _, _, _ = _setup(GlobalInhibition(), 1)
    (rec,) = graph.explain(kind=etrax.DiagnosticKind.GROUP_VARSHAPE_CONFLICT)
    assert rec.level is etrax.DiagnosticLevel.WARNING
    assert {g.varshape for g in graph.hidden_groups} == {(4,), ()}
    assert all(g.link is not None for g in graph.hidden_groups)


class WithUnused(brainstate.nn.Module):
    """A leaky layer whose second weight ``U`` is never read or, with `dead_read`,
    read only into a value nothing uses; with `loop`, the layer takes two sub-steps of
    a ``fori_loop`` (and the dead read is in the loop's body)."""

    def __init__(self, dead_read: bool = False, loop: bool = False) -> None:
        super().__init__()
        self.dead_read, self.loop = dead_read, loop
        self.W = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
        self.U = brainstate.ParamState(jnp.ones((4,)))

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        def sub_step(_: Any, h: Array) -> Array:
            if self.dead_read:
                _ = h * self.U.value  # never read
            return 0.5 * h + jnp.tanh(x @ self.W.value)

        h = self.h.value
        self.h.value = jax.lax.fori_loop(0, 2, sub_step, h) if self.loop else sub_step(0, h)
        return self.h.value


def test_the_report_lists_unused_weights_apart() -> None:
    """A ParamState the step never reads is listed as unused (nothing to learn), not
    among the weights that learn from their instantaneous gradient."""
    model = WithUnused()
    brainstate.nn.init_all_states(model)
    text = str(etrax.compile_etrace_graph(model, jnp.zeros(3)).report())
    head, _, rest = text.partition("Weights the step never reads")
    assert "('U',)" in rest.split("Parameters")[0]
    assert "exact instantaneous gradient" not in head


@pytest.mark.parametrize("loop", [False, True], ids=["step", "loop-body"])
def test_a_weight_read_only_by_dead_code_is_reported_unused(loop: bool) -> None:
    """A ParamState that ``update`` reads only into a value nothing uses is unused
    (its gradient is zero, and the weights it sat beside are traced as without it), and
    a warning says it was read by dead code, also where the read is in an unrolled
    loop's body."""
    model = WithUnused(dead_read=True, loop=loop)
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    rules = graph.weight_rules()
    assert rules[("U",)].rule is etrax.WeightRule.UNUSED
    assert rules[("W",)].rule is etrax.WeightRule.TRACED
    mismatches = graph.explain(kind=etrax.DiagnosticKind.STATE_MISMATCH)
    dead = [r for r in mismatches if "dead code" in r.message]
    assert [r.weight_path for r in dead] == [("U",)]
    state = etrax.state_of(graph)
    xs, ys = jnp.ones((3, 3)), jnp.zeros((3, 4))
    algo = etrax.DRTRL()

    def loss(y: Array, t: Array) -> Array:
        return jnp.sum((y - t) ** 2)

    grads = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ys, loss).grads
    assert float(np.max(np.abs(np.asarray(grads[("U",)])))) == 0.0
    assert float(np.max(np.abs(np.asarray(grads[("W",)])))) > 0.0


class Threshold(brainstate.nn.Module):
    """``V ← where(θ > 0.2, 0.9 V, 0.5 V) + fc(x) θ``: the weight θ is read by a
    comparison (a boolean use, no gradient) and by a product."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)
        self.th = brainstate.ParamState(jnp.array([0.3, 0.1, 0.5, 0.25]))

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.V = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        v = self.V.value
        new = jnp.where(self.th.value > 0.2, 0.9 * v, 0.5 * v) + self.fc(x) * self.th.value
        self.V.value = new
        return new


def test_a_boolean_use_of_a_weight_carries_no_gradient() -> None:
    """A weight read by a comparison has a boolean use, with no gradient; its other
    uses still learn, and every rule (in chunks, per step, in windows) equals BPTT
    through brainstate's own update at T = 1."""
    model = Threshold()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert any(u.dtype == jnp.bool_ for u in graph.weight_rules()[("th",)].uses)
    state = etrax.state_of(graph).replace_hidden({("V",): jnp.array([0.5, -1.0, 2.0, 0.3])})
    xs = jax.random.normal(jax.random.PRNGKey(0), (1, 3))
    ts = jax.random.normal(jax.random.PRNGKey(1), (1, 4))

    def mse(y: Any, t: Any) -> Any:
        return jnp.sum((y - t) ** 2)

    want = bptt_grads(model, state, xs, ts, mse)
    assert float(jnp.max(jnp.abs(want[("th",)]))) > 0
    rules: list[etrax.OnlineAlgorithm[Any]] = [
        etrax.DRTRL(),
        etrax.DRTRL(chunk_steps=1),
        etrax.PPProp(0.9),
        etrax.EProp(0.5),
    ]
    for rule in rules:
        for window in (None, 1):
            tr = rule.init(graph, state)
            got = etrax.online_grad(graph, rule, state, tr, xs, ts, mse, window=window).grads
            for path in want:
                for a, b in zip(
                    jax.tree.leaves(got[path]), jax.tree.leaves(want[path]), strict=True
                ):
                    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
