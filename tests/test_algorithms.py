"""Online learning against BPTT (float64): exactness where the recurrence is
diagonal, approximation elsewhere, and negative controls for every knob."""

import functools
from collections.abc import Callable
from typing import Any

import brainstate
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax
from etrax.algorithms._plan import plan_of
from etrax.algorithms._pp import _late_signals

from .compiles import scan_outputs
from .models import CATALOGUE, ModelCase, TanhRNN, build
from .oracles import bptt_grads

TOL = 1e-10
EXACT = tuple(c for c in CATALOGUE if c.exact_online)


def mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def rel_err(a: Any, b: Any) -> float:
    """Largest per-leaf ``max|a - b| / max|b|``."""
    worst = 0.0
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = float(jnp.max(jnp.abs(v)))
        worst = max(worst, float(jnp.max(jnp.abs(u - v))) / (scale if scale > 0 else 1.0))
    return worst


def _problem(
    case: ModelCase, T: int, seed: int = 0
) -> tuple[etrax.ETraceGraph, etrax.ModelState, Array, Array]:
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(seed), (T, *x.shape))
    y0, _ = etrax.forward(graph, state, x)
    targets = jax.random.normal(jax.random.PRNGKey(seed + 1), (T, *y0.shape))
    return graph, state, xs, targets


def _online(
    algo: etrax.OnlineAlgorithm[Any],
    graph: etrax.ETraceGraph,
    state: etrax.ModelState,
    xs: Array,
    ts: Array,
    **kw: Any,
) -> Any:
    grads, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, mse, **kw)
    return grads


def test_untraced_parameters_get_their_instantaneous_gradient() -> None:
    from .models import StackedGRU

    model, x = build(StackedGRU)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
    ts = jax.random.normal(jax.random.PRNGKey(1), (6, 2))
    got = _online(etrax.DRTRL(), graph, state, xs, ts)
    rules = graph.weight_rules()
    for p in (("out", "weight"), ("l1", "Wr", "weight"), ("l2", "Wr", "weight")):
        assert rules[p].rule is etrax.WeightRule.INSTANTANEOUS
        assert all(float(jnp.max(jnp.abs(v))) > 0 for v in jax.tree.leaves(got[p]))
    # the readout sees no history: its gradient is exact at every length
    expected, _ = etrax.bptt_grad(graph, state, xs, ts, mse)
    assert rel_err(got[("out", "weight")], expected[("out", "weight")]) <= TOL


@pytest.mark.parametrize("case", (*EXACT[:4], CATALOGUE[-1]), ids=lambda c: c.name)
def test_pp_prop_exact_at_t1_and_differs_later(case: ModelCase) -> None:
    graph, state, xs, ts = _problem(case, 1)
    expected, _ = etrax.bptt_grad(graph, state, xs, ts, mse)
    assert rel_err(_online(etrax.PPProp(0.9), graph, state, xs, ts), expected) <= TOL
    graph, state, xs, ts = _problem(case, 6)
    pp = _online(etrax.PPProp(0.9), graph, state, xs, ts)
    dr = _online(etrax.DRTRL(), graph, state, xs, ts)
    assert rel_err(pp, dr) > 1e-4  # negative control: the approximation shows
    assert (
        rel_err(
            _online(etrax.PPProp(4), graph, state, xs, ts),
            _online(etrax.PPProp(0.6), graph, state, xs, ts),
        )
        <= TOL
    )


def test_eprop_reduces_to_drtrl_and_its_knobs_matter() -> None:
    case = next(c for c in CATALOGUE if c.name == "two_state")
    graph, state, xs, ts = _problem(case, 8)
    dr = _online(etrax.DRTRL(), graph, state, xs, ts)
    assert rel_err(_online(etrax.EProp(kappa=0.0), graph, state, xs, ts), dr) <= TOL
    filtered = _online(etrax.EProp(kappa=0.5), graph, state, xs, ts)
    assert rel_err(filtered, dr) > 1e-4
    rnd = _online(etrax.EProp(feedback="random", key=jax.random.PRNGKey(3)), graph, state, xs, ts)
    assert rel_err(rnd, dr) > 1e-4
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(rnd))


@pytest.mark.slow
def test_windows_on_a_nondiagonal_model() -> None:
    case = ModelCase("tanh_rnn", lambda: build(TanhRNN, 3, 4), False)
    T = 12
    graph, state, xs, ts = _problem(case, T)
    expected, _ = etrax.bptt_grad(graph, state, xs, ts, mse)
    for algo in (etrax.DRTRL(), etrax.PPProp(0.5)):
        assert rel_err(_online(algo, graph, state, xs, ts, window=T), expected) <= TOL
        for k in (3, 5):
            assert rel_err(_online(algo, graph, state, xs, ts, window=k), expected) > 1e-4
    # per-step D-RTRL drops the recurrent weight's path: approximate, as documented
    assert rel_err(_online(etrax.DRTRL(), graph, state, xs, ts), expected) > 1e-4


def test_windows_are_exact_on_diagonal_models() -> None:
    case = next(c for c in CATALOGUE if c.name == "leaky_tanh_readout")
    graph, state, xs, ts = _problem(case, 10)
    expected, _ = etrax.bptt_grad(graph, state, xs, ts, mse)
    assert rel_err(_online(etrax.DRTRL(), graph, state, xs, ts, window=3), expected) <= TOL


CHUNKABLE: dict[str, Callable[[int], etrax.OnlineAlgorithm[Any]]] = {
    "drtrl": lambda k: etrax.DRTRL(chunk_steps=k),
    "pp_prop": lambda k: etrax.PPProp(0.8, chunk_steps=k),
    "eprop_kappa": lambda k: etrax.EProp(0.7, chunk_steps=k),  # the filter folded in
}


@pytest.mark.slow
@pytest.mark.parametrize("rule", list(CHUNKABLE))
@pytest.mark.parametrize("name", ["gru_b2", "lstm", "alif_ff_b2", "stacked_state"])
def test_chunked_equals_per_step(name: str, rule: str) -> None:
    """The stacked (chunked) forms equal the per-step forms: the traces' recursion and
    contractions (e-prop's κ filter folded into the chunk too), and the instantaneous
    gradients of untraced uses (GRU's reset-gate weight, the readouts), which the
    chunked driver forms as one product per chunk."""
    case = next(c for c in CATALOGUE if c.name == name)
    graph, state, xs, ts = _problem(case, 11)
    make = CHUNKABLE[rule]
    traces = make(1).init(graph, state)
    a, aux_a = etrax.online_grad(graph, make(1), state, traces, xs, ts, mse)
    for K in (2, 5, 11):  # a remainder block, several blocks, exactly one block (no loop)
        b, aux_b = etrax.online_grad(graph, make(K), state, traces, xs, ts, mse)
        assert rel_err(b, a) <= 1e-12, K
        assert rel_err(aux_b["traces"], aux_a["traces"]) <= 1e-12, K
        np.testing.assert_allclose(aux_b["losses"], aux_a["losses"], rtol=1e-12)


class _OldAndNew(brainstate.nn.Module):
    """``h ← tanh(W x + U h)``, read out from both the old and the new ``h``: the old
    value reaches the output directly (`HiddenPerturbation.direct_paths`), so the
    chunked drivers also contract the traces *before* each step."""

    def __init__(self) -> None:
        super().__init__()
        keys = jax.random.split(jax.random.PRNGKey(7), 3)
        self.w = brainstate.ParamState(0.4 * jax.random.normal(keys[0], (3, 4)))
        self.u = brainstate.ParamState(0.4 * jax.random.normal(keys[1], (4, 4)))
        self.o = brainstate.ParamState(0.4 * jax.random.normal(keys[2], (4, 2)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((4,)))

    def update(self, x: Array) -> Array:
        old = self.h.value
        self.h.value = jnp.tanh(x @ self.w.value + old @ self.u.value)
        out: Array = (old + self.h.value) @ self.o.value
        return out


@pytest.mark.parametrize("rule", list(CHUNKABLE))
def test_chunked_equals_per_step_with_direct_paths(rule: str) -> None:
    model = _OldAndNew()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3))
    assert graph.hidden_perturb is not None and graph.hidden_perturb.direct_paths == (("h",),)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(0), (9, 3))
    ts = jax.random.normal(jax.random.PRNGKey(1), (9, 2))
    make = CHUNKABLE[rule]
    per_step = _online(make(1), graph, state, xs, ts)
    for K in (2, 9):
        assert rel_err(_online(make(K), graph, state, xs, ts), per_step) <= 1e-12, K


def _stack(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _per_step(
    algo: etrax.OnlineAlgorithm[Any], graph: etrax.ETraceGraph, steps: list[Any], weights: Any
) -> tuple[Any, Any]:
    """Traces and summed gradients of `update` + `eff_grads` step by step."""
    tr = algo.init(graph, etrax.state_of(graph))
    total: Any = None
    for jac, sig, old in steps:
        g_old = algo.eff_grads(graph, tr, old, weights)
        tr = algo.update(graph, tr, jac, weights)
        g = jax.tree.map(jnp.add, g_old, algo.eff_grads(graph, tr, sig, weights))
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    return tr, total


def _streamed(
    step: Callable[..., Any],
    finish: Callable[..., Any],
    traces: Any,
    graph: etrax.ETraceGraph,
    steps: list[Any],
    weights: Any,
) -> tuple[Any, Any]:
    """Traces and summed gradients of `stream_step` over the steps, then `stream_finish`
    on the last traces and what the steps kept, stacked."""
    streamed: Any = None
    saved = []
    for jac, sig, old in steps:
        traces, now, keep = step(graph, traces, jac, sig, weights, old)
        streamed = now if streamed is None else jax.tree.map(jnp.add, streamed, now)
        saved.append(keep)
    rest = finish(graph, traces, _stack(saved), weights)
    total = tuple(
        {k: v.get(k, 0.0) + r.get(k, 0.0) for k in v.keys() | r.keys()}
        for v, r in zip(streamed, rest, strict=True)
    )
    return traces, total


@pytest.mark.parametrize("name", ["lstm", "gru_b2"])
def test_chunk_forms_equal_the_per_step_form(name: str) -> None:
    """The stacked forms, used through the pure interface, against `update` +
    `eff_grads` per step, with signals on the old hidden values too (`olds`): pp-prop's
    `chunk` (the chunk's Jacobians stacked) and `stream_step` + `stream_finish` (the
    driver's: one pass, the factorised contractions stacked; on one sample, the LSTM,
    the signals formed at the chunk's end, with a batch at every step); and the default
    streamed form of a rule that keeps nothing for `stream_finish` (D-RTRL, as a
    `LearningRule` and through `OnlineAlgorithm`'s own default)."""
    case = next(c for c in CATALOGUE if c.name == name)
    graph, state, xs, ts = _problem(case, 6)
    weights = etrax.algorithms.operand_values(graph, state.params)
    steps = []
    s = state
    for t in range(6):
        y, s, jac, pullback = etrax.step_vjp(graph, s, xs[t])
        sig = tuple(pullback(jax.grad(mse)(y, ts[t])))
        steps.append((jac, sig, tuple(0.5 * g for g in sig)))  # any signal on old values
    jacs, sigs, olds = (_stack([st[n] for st in steps]) for n in range(3))

    pp = etrax.PPProp(0.8, chunk_steps=6)
    assert pp.streams(graph)
    assert _late_signals(plan_of(graph).slots) is (name == "lstm")  # both forms run
    tr, expected = _per_step(pp, graph, steps, weights)
    traces = pp.init(graph, state)
    chunk_tr, chunk_g = pp.chunk(graph, traces, jacs, sigs, weights, olds)
    assert rel_err(chunk_g, expected) <= 1e-12 and rel_err(chunk_tr, tr) <= 1e-12
    st, total = _streamed(pp.stream_step, pp.stream_finish, traces, graph, steps, weights)
    assert rel_err(total, expected) <= 1e-12 and rel_err(st, tr) <= 1e-12

    drtrl = etrax.DRTRL()
    assert not drtrl.streams(graph)  # its chunk re-associates the recursion itself
    d_tr, d_expected = _per_step(drtrl, graph, steps, weights)
    base = etrax.OnlineAlgorithm
    forms: list[tuple[Callable[..., Any], Callable[..., Any]]] = [
        (drtrl.stream_step, drtrl.stream_finish),
        (functools.partial(base.stream_step, drtrl), functools.partial(base.stream_finish, drtrl)),
    ]
    for step, finish in forms:
        d_traces = drtrl.init(graph, state)
        d_st, d_total = _streamed(step, finish, d_traces, graph, steps, weights)
        assert rel_err(d_total, d_expected) <= 1e-12 and rel_err(d_st, d_tr) <= 1e-12
    jac, sig, _ = steps[0]
    moved = drtrl.update(graph, drtrl.init(graph, state), jac, weights)
    now, kept = base.stream_out(drtrl, graph, moved, sig, weights)  # the base default
    assert kept == () and rel_err(now, drtrl.eff_grads(graph, moved, sig, weights)) == 0.0


def test_chunks_are_alike_when_a_divisor_allows() -> None:
    """``chunk_steps`` that leaves a shorter last chunk is lowered to a divisor of the
    sequence length from half of it up, when there is one: the program then holds one
    chunk body (the same program as asking for that divisor), and the gradient is the
    per-step one. Without such a divisor the last chunk stays shorter."""
    from etrax.algorithms._drivers import _block_length

    assert [_block_length(12, k) for k in (1, 4, 5, 8, 12, 32)] == [1, 4, 4, 6, 12, 32]
    assert _block_length(11, 5) == 5 and _block_length(11, 2) == 2  # 11 is prime
    assert _block_length(1000, 32) == 25
    case = next(c for c in CATALOGUE if c.name == "gru_b2")
    graph, state, xs, ts = _problem(case, 12)
    traces = etrax.DRTRL(1).init(graph, state)

    def program(k: int) -> Any:
        algo = etrax.DRTRL(chunk_steps=k)
        return jax.make_jaxpr(lambda s: etrax.online_grad(graph, algo, s, traces, xs, ts, mse))(
            state
        )

    assert str(program(8)) == str(program(6))
    assert str(program(8)) != str(program(4))  # the comparison tells block lengths apart
    per_step, _ = etrax.online_grad(graph, etrax.DRTRL(1), state, traces, xs, ts, mse)
    chunked, _ = etrax.online_grad(graph, etrax.DRTRL(8), state, traces, xs, ts, mse)
    assert rel_err(chunked, per_step) <= 1e-12


def test_sequences_continue_from_state_and_traces() -> None:
    case = next(c for c in CATALOGUE if c.name == "gru")
    graph, state, xs, ts = _problem(case, 8)
    algo = etrax.DRTRL(chunk_steps=1)
    whole, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, mse)
    g1, aux1 = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs[:5], ts[:5], mse)
    g2, _ = etrax.online_grad(graph, algo, aux1["state"], aux1["traces"], xs[5:], ts[5:], mse)
    assert rel_err(jax.tree.map(jnp.add, g1, g2), whole) <= 1e-12


def test_drivers_hand_back_the_given_weights() -> None:
    """The drivers' final states hold the very weight arrays they were given (a
    compiled program that returned them would copy every weight at each call), and
    the hidden values they return continue the sequence."""
    case = next(c for c in CATALOGUE if c.name == "gru")
    graph, state, xs, ts = _problem(case, 6)
    algo = etrax.PPProp(0.9, chunk_steps=4)
    given = jax.tree.leaves(state.params)
    _, aux = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, mse)
    windowed = etrax.online_grad(
        graph, etrax.DRTRL(), state, etrax.DRTRL().init(graph, state), xs, ts, mse, window=2
    )
    evolved, _, _ = etrax.online_evolve(graph, algo, state, algo.init(graph, state), xs)
    bptt = etrax.bptt_grad(graph, state, xs, ts, mse)
    for final in (aux["state"], windowed.state, evolved, bptt.state):
        assert all(a is b for a, b in zip(jax.tree.leaves(final.params), given, strict=True))
        assert list(final.hidden) == list(state.hidden)
    h = next(iter(state.hidden))
    for final in (windowed.state, evolved, bptt.state):  # the same forward pass
        np.testing.assert_allclose(final.hidden[h], aux["state"].hidden[h], rtol=0, atol=TOL)
    assert not np.allclose(aux["state"].hidden[h], state.hidden[h])


def test_pure_interface_matches_the_driver() -> None:
    case = next(c for c in CATALOGUE if c.name == "two_state")
    graph, state, xs, ts = _problem(case, 3)
    algo = etrax.DRTRL()
    traces = algo.init(graph, state)
    total: Any = None
    s = state
    for t in range(3):
        y, s, jac, pullback = etrax.step_vjp(graph, s, xs[t])
        traces = algo.update(graph, traces, jac)
        cot = jax.grad(mse)(y, ts[t])
        g = algo.grads(graph, traces, pullback(cot), state.params)
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    expected, _ = etrax.bptt_grad(graph, state, xs, ts, mse)
    # the model has no untraced parameter, so the trace contraction is everything
    assert rel_err(total, expected) <= TOL


def test_batched_and_vmapped_gradients_agree() -> None:
    from .models import TwoStateNeuron

    B, T = 3, 5
    single, x1 = build(TwoStateNeuron, 3, 4)
    batched, _ = build(TwoStateNeuron, 3, 4, batch=B)
    g1 = etrax.compile_etrace_graph(single, x1)
    gb = etrax.compile_etrace_graph(batched, jnp.ones((B, 3)))
    s1 = etrax.state_of(g1)
    sb = etrax.state_of(gb).replace_params(s1.params)
    xs = jax.random.normal(jax.random.PRNGKey(0), (T, B, 3))
    ts = jax.random.normal(jax.random.PRNGKey(1), (T, B, 4))
    algo = etrax.DRTRL()
    native, _ = etrax.online_grad(gb, algo, sb, algo.init(gb, sb), xs, ts, mse)

    def per_sample(x: Array, t: Array) -> Any:
        g, _ = etrax.online_grad(g1, algo, s1, algo.init(g1, s1), x, t, mse)
        return g

    mapped = jax.vmap(per_sample, in_axes=(1, 1))(xs, ts)
    summed = jax.tree.map(lambda v: jnp.sum(v, axis=0), mapped)
    assert rel_err(summed, native) <= 1e-12


def test_data_parallel_shard_map() -> None:
    from jax.sharding import Mesh, PartitionSpec

    from .models import TwoStateNeuron

    def spec(*names: str | None) -> PartitionSpec:
        out: PartitionSpec = PartitionSpec(*names)  # type: ignore[no-untyped-call]  # unannotated
        return out

    T = 4
    local, _ = build(TwoStateNeuron, 3, 4, batch=2)
    full, _ = build(TwoStateNeuron, 3, 4, batch=4)
    gl = etrax.compile_etrace_graph(local, jnp.ones((2, 3)))
    gf = etrax.compile_etrace_graph(full, jnp.ones((4, 3)))
    sl = etrax.state_of(gl)
    sf = etrax.state_of(gf).replace_params(sl.params)
    xs = jax.random.normal(jax.random.PRNGKey(0), (T, 4, 3))
    ts = jax.random.normal(jax.random.PRNGKey(1), (T, 4, 4))
    algo = etrax.DRTRL()
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def shard(params: Any, h: Any, x: Any, t: Any) -> Any:
        st = etrax.ModelState(params, h, etrax.PathDict())
        g, _ = etrax.online_grad(gl, algo, st, algo.init(gl, st), x, t, mse)
        total: Any = jax.lax.psum(g, "data")  # type: ignore[no-untyped-call]  # unannotated
        return total

    f = jax.jit(
        jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=(spec(), spec("data"), spec(None, "data"), spec(None, "data")),
            out_specs=spec(),
        )
    )
    parallel = f(sl.params, sf.hidden, xs, ts)
    single, _ = etrax.online_grad(gf, algo, sf, algo.init(gf, sf), xs, ts, mse)
    assert rel_err(parallel, single) <= 1e-12


def test_bad_inputs() -> None:
    case = next(c for c in CATALOGUE if c.name == "gru")
    graph, state, xs, ts = _problem(case, 5)
    algo = etrax.DRTRL()
    traces = algo.init(graph, state)
    with pytest.raises(etrax.StepInputError, match="leading time axis"):
        etrax.online_grad(graph, algo, state, traces, xs, ts[:3], mse)
    with pytest.raises(etrax.StepInputError, match="fit loss_fn"):
        etrax.online_grad(graph, algo, state, traces, xs, jnp.ones((5, 7)), mse)
    with pytest.raises(etrax.StepInputError, match="scalar"):
        etrax.online_grad(graph, algo, state, traces, xs, ts, lambda y, t: (y - t) ** 2)
    with pytest.raises(etrax.StepInputError, match="traces do not match"):
        etrax.online_grad(graph, etrax.PPProp(0.5), state, traces, xs, ts, mse)  # type: ignore[misc]  # D-RTRL's traces for pp-prop: the error under test
    with pytest.raises(ValueError, match="window"):
        etrax.online_grad(graph, algo, state, traces, xs, ts, mse, window=9)
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        etrax.PPProp(1.0)
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        etrax.PPProp(-0.1)
    with pytest.raises(ValueError, match="rank"):
        etrax.PPProp(0)
    with pytest.raises(ValueError, match="key"):
        etrax.EProp(feedback="random")
    with pytest.raises(ValueError, match="kappa"):
        etrax.EProp(kappa=1.5)


def test_graph_without_relations_is_refused() -> None:
    import brainstate

    class Plain(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(jnp.ones((3, 4)))

        def init_state(self, batch_size: int | None = None, **kw: object) -> None:
            self.h = brainstate.HiddenState(jnp.zeros(4))

        def update(self, x: Array) -> Array:
            h = 0.5 * self.h.value + x @ self.w.value
            self.h.value = h
            return h

    model = Plain()
    brainstate.nn.init_all_states(model)
    # recognised by default; with recognition off the plain matmul is not traced
    assert etrax.compile_etrace_graph(model, jnp.ones(3)).hidden_param_op_relations
    off = etrax.CompilePolicy(recognise_weight_ops=False)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3), policy=off)
    state = etrax.state_of(graph)
    with pytest.raises(etrax.CompilationError, match="no relations"):
        etrax.DRTRL().init(graph, state)
    with pytest.raises(etrax.CompilationError, match="bptt_grad"):
        etrax.online_grad(graph, etrax.DRTRL(), state, (), jnp.ones((2, 3)), jnp.ones((2, 4)), mse)  # type: ignore[misc]  # no traces: the error under test


def test_online_grad_compiles_once() -> None:
    from .test_executor import count_traces

    case = next(c for c in CATALOGUE if c.name == "lstm")
    graph, state, xs, ts = _problem(case, 6)
    algo = etrax.DRTRL()
    traces = algo.init(graph, state)
    _, aux = etrax.online_grad(graph, algo, state, traces, xs, ts, mse)
    xs2, ts2 = xs * 2.0, ts + 1.0
    with count_traces() as traced:
        _, aux = etrax.online_grad(graph, algo, aux["state"], aux["traces"], xs2, ts2, mse)
        np.asarray(aux["losses"])
    assert traced == []


Fn = Callable[..., Any]


@pytest.mark.parametrize("nb", [1, 4, 9])
def test_trace_contraction_is_the_same_on_every_backend(
    nb: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The D-RTRL contraction ``Σ_{n,a} A[n,o,a] ε[n,(i,)o,a]``, summed over each
    group's terms, equals an einsum on every path: additions of the batch slices
    (``NB ≤ SHORT_AXIS``) or one slice loop for every group (beyond) on CPU, and one
    contraction per term on accelerators."""
    from etrax.algorithms import _kernels

    def normal(k: int, *shape: int) -> Array:
        return jax.random.normal(jax.random.PRNGKey(k), shape)

    groups = [  # a weight with an input axis (two terms, as e-prop's), one without
        [
            (normal(0, nb, 5, 2), normal(1, nb, 3, 5, 2), True),
            (normal(2, nb, 5, 2), normal(3, nb, 3, 5, 2), True),
        ],
        [(normal(4, nb, 5, 2), normal(5, nb, 5, 2), False)],
    ]
    expected = [
        sum(jnp.einsum("noa,nioa->io" if h else "noa,noa->o", A, e) for A, e, h in group)
        for group in groups
    ]
    eqns = jax.make_jaxpr(lambda: _kernels.weigh_many(groups))().jaxpr.eqns
    loops = [e for e in eqns if e.primitive.name in ("scan", "while")]
    assert len(loops) == (1 if nb > _kernels.SHORT_AXIS else 0)  # one loop for all groups
    on_cpu = _kernels.weigh_many(groups)
    monkeypatch.setattr(_kernels, "SLICE_LOOP_BACKENDS", ())
    contracted = _kernels.weigh_many(groups)
    for got in (on_cpu, contracted):
        for g, want in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, want, rtol=1e-12)


def _loops(jaxpr: Any) -> int:
    """Loops (``scan`` / ``while``) in a jaxpr, nested ones included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in ("scan", "while")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _loops(sub)
    return count


@pytest.mark.parametrize("kappa", [None, 0.6])
def test_a_chunk_weighs_every_slot_in_one_loop(kappa: float | None) -> None:
    """A D-RTRL (or filtered e-prop) chunk of a GRU at batch 16 (beyond `SHORT_AXIS`,
    so the traces are weighed slice by slice on CPU): one backward pass over the chunk
    for the hidden group and one slice loop for the traces of every slot of the group
    (not one per slot), with the per-step form's gradients."""
    model, x = build(etrax.nn.GRUCell, 3, 4, batch=16)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    weights = etrax.algorithms.operand_values(graph, state.params)
    assert len(etrax.algorithms._plan.plan_of(graph).slots) >= 2
    steps, s = [], state
    for t in range(5):
        xt = jax.random.normal(jax.random.PRNGKey(t), x.shape)
        y, s, jac, pullback = etrax.step_vjp(graph, s, xt)
        sig = tuple(pullback(jnp.ones_like(y)))
        steps.append((jac, sig, tuple(jnp.zeros_like(g) for g in sig)))
    jacs, sigs = (_stack([st[n] for st in steps]) for n in range(2))
    rule = etrax.DRTRL() if kappa is None else etrax.EProp(kappa)
    traces = rule.init(graph, state)
    program = jax.make_jaxpr(lambda tr: rule.chunk(graph, tr, jacs, sigs, weights))(traces)
    if jax.default_backend() in etrax.algorithms._kernels.SLICE_LOOP_BACKENDS:
        assert _loops(program.jaxpr) == 2
    new, grads = rule.chunk(graph, traces, jacs, sigs, weights)
    tr, expected = _per_step(rule, graph, steps, weights)
    assert rel_err(grads, expected) <= 1e-12 and rel_err(new, tr) <= 1e-12


def test_a_chunk_stacks_an_input_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GRU's reset-gate product reads ``[x, h]``, the input of the update gate's
    traced product too: a D-RTRL chunk stacks it once, with the Jacobians, for both
    the trace recursion and the reset gate's deferred instantaneous gradient (and
    the gradient is the per-step one). Packing is off, so each stacked value is its
    own output."""
    monkeypatch.setattr(etrax.algorithms._drivers, "PACK_MAX_BYTES", 0)
    model, x = build(etrax.nn.GRUCell, 3, 4, batch=2)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    plan = etrax.algorithms._plan.plan_of(graph)
    assert any(r is not None for r in plan.operand_inputs)
    xs = jax.random.normal(jax.random.PRNGKey(0), (6, *x.shape))
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(1), (6, *y0.shape))
    algo = etrax.DRTRL(chunk_steps=6)
    traces = algo.init(graph, state)

    def loss(y: Array, target: Array) -> Array:  # a new static argument: a fresh trace
        return mse(y, target)

    program = jax.make_jaxpr(lambda s: etrax.online_grad(graph, algo, s, traces, xs, ts, loss))(
        state
    )
    stacked = scan_outputs(program.jaxpr, 6)
    assert stacked.count((6, 2, 3 + 4)) == 2  # [x, h] once, and the candidate's [x, r h]
    per_step = _online(etrax.DRTRL(chunk_steps=1), graph, state, xs, ts)
    assert rel_err(_online(algo, graph, state, xs, ts), per_step) <= 1e-12


@pytest.mark.parametrize("rule", ["drtrl", "pp", "eprop"])
def test_small_step_outputs_are_stacked_as_one_array(
    rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's small per-step outputs (`PACK_MAX_BYTES`) leave the step as one
    vector, stacked once per step; the gradient and the carried traces are those of
    the unpacked program. Negative control: with packing off, the same chunk stacks
    several outputs of the step's size."""
    model, x = build(etrax.nn.GRUCell, 3, 4, batch=2)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(0), (6, *x.shape))
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(1), (6, *y0.shape))
    algo = _RULES[rule](6)
    traces = algo.init(graph, state)

    def programs() -> tuple[list[tuple[int, ...]], Any]:
        """The stacked arrays of a fresh trace (a new loss function is a new static
        argument, so nothing cached is reused) and its result."""

        def loss(y: Array, target: Array) -> Array:
            return mse(y, target)

        def run() -> Any:
            return etrax.online_grad(graph, algo, state, traces, xs, ts, loss)

        shapes = scan_outputs(jax.make_jaxpr(run)().jaxpr, 6)
        return [s for s in shapes if len(s) > 1], run()  # stacked arrays, not the losses

    packed, (packed_grads, packed_aux) = programs()
    monkeypatch.setattr(etrax.algorithms._drivers, "PACK_MAX_BYTES", 0)
    apart, (grads, aux) = programs()
    assert sum(len(s) == 2 for s in packed) >= 1  # one (K, n) vector per step
    assert len(apart) > len(packed)
    assert rel_err(packed_grads, grads) <= 1e-12
    assert rel_err(packed_aux["traces"], aux["traces"]) <= 1e-12


def test_packing_keeps_large_outputs_apart() -> None:
    """`_pack_plan` takes the smallest leaves first while they fit, leaves weakly typed
    ones, PRNG keys and a lone leaf alone, and groups by dtype."""
    plan_of_leaves = etrax.algorithms._drivers._pack_plan
    limit = etrax.algorithms._drivers.PACK_MAX_BYTES
    big = jnp.zeros((limit // 4,), jnp.float32)  # fills the limit alone
    small = [jnp.zeros((3,), jnp.float32), jnp.zeros((2, 2), jnp.float32)]
    weak = jnp.asarray(1.0)  # a weakly typed scalar
    assert etrax._compat.aval_of(weak).weak_type
    partner = jnp.zeros((2,), weak.dtype)  # with it, the weak one would make a pair
    ints = [jnp.zeros((2,), jnp.int32), jnp.zeros((), jnp.int32)]
    plan = plan_of_leaves([big, *small, weak, partner, *ints])
    assert plan[jnp.dtype(jnp.int32)] == [5, 6]
    assert plan[jnp.dtype(jnp.float32)] == ([1, 2, 4] if weak.dtype == jnp.float32 else [1, 2])
    assert all(3 not in idx for idx in plan.values())
    assert len(plan) == 2
    assert plan_of_leaves([big, small[0]]) == {}  # the small one is alone: nothing to pack
    keys = [jax.random.key(0), jax.random.key(1)]
    assert plan_of_leaves([*keys, *small]) == {jnp.dtype(jnp.float32): [2, 3]}


def _products_with(jaxpr: Any, shape: tuple[int, ...], length: int, inside: bool = False) -> int:
    """Products (``dot_general``, ETP matmuls) with an operand of `shape` inside the
    ``scan`` loops of `length` steps (in nested programs too)."""
    count = 0
    for eqn in jaxpr.eqns:
        here = inside or (eqn.primitive.name == "scan" and eqn.params["length"] == length)
        subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
        if inside and eqn.primitive.name in ("dot_general", "etp_matmul"):
            count += any(tuple(getattr(v.aval, "shape", ())) == shape for v in eqn.invars)
        for sub in subs:
            count += _products_with(sub, shape, length, here)
    return count


class GatedOut(brainstate.nn.Module):
    """A gated cell whose gate reaches the candidate through the candidate's weight and,
    with `gate_out`, also the output directly (no product with a weight on that route)."""

    def __init__(self, n_in: int, n: int, gate_out: bool) -> None:
        super().__init__()
        self.gate_out = gate_out
        self.Wg = etrax.nn.Linear(n_in, n)
        self.Wh = etrax.nn.Linear(n_in + n, n)
        self.n = n

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.n,) if batch_size is None else (batch_size, self.n)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: Array) -> Array:
        g = jax.nn.sigmoid(self.Wg(x))
        h = self.h.value
        new = 0.5 * h + jnp.tanh(self.Wh(jnp.concatenate([x, g * h], axis=-1)))
        self.h.value = new
        return new + g if self.gate_out else new


_RULES: dict[str, Callable[[int], etrax.OnlineAlgorithm[Any]]] = {
    "pp": lambda k: etrax.PPProp(0.8, chunk_steps=k),
    "drtrl": lambda k: etrax.DRTRL(chunk_steps=k),
    "eprop": lambda k: etrax.EProp(0.6, chunk_steps=k),
}


@pytest.mark.parametrize("rule", sorted(_RULES))
def test_a_region_pulls_the_reset_gate_back_once_per_chunk(rule: str) -> None:
    """The GRU's reset gate reaches the loss only through the candidate's weight: its
    steps keep the candidate product's output cotangent, and the product with that
    weight's transpose runs once per chunk (the steps multiply by the ``(67, 64)``
    weights only in the three forward products), with the per-step form's gradients.
    A GRU of 16 units at batch 1 is too small for a region (`REGION_MIN_MACS`)."""
    model, x = build(etrax.nn.GRUCell, 3, 64, batch=32)  # above `REGION_MIN_MACS`
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    hp = graph.hidden_perturb
    assert hp is not None and sum(r is not None for r in hp.regions) == 1
    region = next(r for r in hp.regions if r is not None)
    # the steps keep the gate's pre-activation; its `x` and `h` are pieces of the
    # `[x, h]` the steps keep for the gate's own product
    assert len(region.values) == 1 and len(region.slices) == 2
    small, _ = build(etrax.nn.GRUCell, 3, 16, batch=1)
    small_hp = etrax.compile_etrace_graph(small, x[:1]).hidden_perturb
    assert small_hp is not None and all(r is None for r in small_hp.regions)
    xs = jax.random.normal(jax.random.PRNGKey(0), (6, *x.shape))
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(1), (6, *y0.shape))
    algo = _RULES[rule](6)
    traces = algo.init(graph, state)
    program = jax.make_jaxpr(lambda s: etrax.online_grad(graph, algo, s, traces, xs, ts, mse))(
        state
    )
    assert _products_with(program.jaxpr, (3 + 64, 64), 6) == 3
    per_step = _online(_RULES[rule](1), graph, state, xs, ts)
    assert rel_err(_online(algo, graph, state, xs, ts), per_step) <= 1e-12


@pytest.mark.parametrize("gate_out", [False, True])
def test_a_region_stops_where_a_route_reaches_the_output(gate_out: bool) -> None:
    """A gate that also reaches the output directly has no region (its output
    cotangent is kept per step); either way a chunk's gradients equal the per-step
    ones and BPTT's at T = 1."""
    model, x = build(GatedOut, 3, 64, gate_out, batch=32)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    hp = graph.hidden_perturb
    assert hp is not None
    assert [r is not None for r in hp.regions].count(True) == (0 if gate_out else 1)
    xs = jax.random.normal(jax.random.PRNGKey(0), (5, *x.shape))
    ts = jax.random.normal(jax.random.PRNGKey(1), (5, 32, 64))
    exact = bptt_grads(model, state, xs[:1], ts[:1], mse)
    for make in _RULES.values():
        chunk, one = make(5), make(1)
        per_step = _online(one, graph, state, xs, ts)
        assert rel_err(_online(chunk, graph, state, xs, ts), per_step) <= 1e-12
        first = _online(chunk, graph, state, xs[:1], ts[:1])
        for p in exact:
            assert rel_err(first[p], exact[p]) <= 1e-12, p


class TwoGRUs(brainstate.nn.Module):
    """Two GRU layers and a plain brainstate readout."""

    def __init__(self, n_in: int, n: int) -> None:
        super().__init__()
        self.l1 = etrax.nn.GRUCell(n_in, n)
        self.l2 = etrax.nn.GRUCell(n, n)
        self.out = brainstate.nn.Linear(n, 2)

    def update(self, x: Array) -> Array:
        out: Array = self.out(self.l2(self.l1(x)))
        return out


@pytest.mark.slow
def test_regions_of_a_stack_equal_the_per_step_gradients() -> None:
    """Each layer's reset gate has its own region (the second layer's reads the first
    layer's new hidden value as its input): chunks equal the per-step form for every
    rule, and BPTT at T = 1."""
    model, x = build(TwoGRUs, 3, 64, batch=32)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    hp = graph.hidden_perturb
    assert hp is not None and sum(r is not None for r in hp.regions) == 2
    xs = jax.random.normal(jax.random.PRNGKey(0), (5, *x.shape))
    ts = jax.random.normal(jax.random.PRNGKey(1), (5, 32, 2))
    exact = bptt_grads(model, state, xs[:1], ts[:1], mse)
    for make in _RULES.values():
        per_step = _online(make(1), graph, state, xs, ts)
        assert rel_err(_online(make(5), graph, state, xs, ts), per_step) <= 1e-12
        first = _online(make(5), graph, state, xs[:1], ts[:1])
        for p in exact:
            assert rel_err(first[p], exact[p]) <= 1e-12, p


_REGION_CASES = [c for c in CATALOGUE if c.name in ("gru", "gru_b2", "stacked_gru", "mgu", "lstm")]


@pytest.mark.slow
@pytest.mark.parametrize("case", _REGION_CASES, ids=[c.name for c in _REGION_CASES])
def test_regions_of_small_models_equal_the_per_step_gradients(
    case: ModelCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no size floor (`REGION_MIN_MACS` = 0), the small catalogue models form
    their regions too, and their chunks still equal the per-step form."""
    monkeypatch.setattr(etrax.compiler._perturb, "REGION_MIN_MACS", 0)
    graph, state, xs, ts = _problem(case, 5)
    hp = graph.hidden_perturb
    assert hp is not None
    # the GRUs' reset gates reach the output only through the candidate's weight; the
    # MGU's forget gate and the LSTM's gates reach the new state (the output) directly
    assert any(r is not None for r in hp.regions) == ("gru" in case.name)
    for make in _RULES.values():
        per_step = _online(make(1), graph, state, xs, ts)
        assert rel_err(_online(make(5), graph, state, xs, ts), per_step) <= 1e-12


def test_the_default_chunk_follows_the_device_and_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``chunk_steps=None`` (the presets' default) chunks by 32 on the CPU, but a model
    of one sample by 64 under the per-parameter rules (D-RTRL, e-prop); on an
    accelerator it runs a model of one sample per step and a batched one in chunks.
    An explicit length is kept everywhere, and the driver runs what `chunk_for` says."""
    one, x1 = build(etrax.nn.GRUCell, 3, 4)
    many, x2 = build(etrax.nn.GRUCell, 3, 4, batch=2)
    g1, g2 = etrax.compile_etrace_graph(one, x1), etrax.compile_etrace_graph(many, x2)
    rules: list[etrax.LearningRule[Any]] = [etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)]
    assert all(r.chunk_steps is None and r.chunk_size == 32 for r in rules)
    assert [r.chunk_for(g) for r in rules for g in (g1, g2)] == [64, 32, 32, 32, 64, 32]
    assert etrax.algorithms.default_chunk_steps(g1) == 32
    assert etrax.algorithms.default_chunk_steps(g1, 64) == 64
    assert etrax.algorithms.default_chunk_steps(g2, 64) == 32
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert [r.chunk_for(g) for r in rules for g in (g1, g2)] == [1, 32] * 3
    assert etrax.DRTRL(chunk_steps=8).chunk_for(g1) == 8
    assert etrax.algorithms.default_chunk_steps(g1) == 1
    state = etrax.state_of(g1)
    xs = jax.random.normal(jax.random.PRNGKey(0), (6, *x1.shape))
    ts = jax.random.normal(jax.random.PRNGKey(1), (6, 4))
    algo = etrax.DRTRL()
    traces = algo.init(g1, state)

    def loops(rule: etrax.OnlineAlgorithm[Any]) -> int:
        run = lambda s: etrax.online_grad(g1, rule, s, traces, xs, ts, mse)  # noqa: E731
        return _loops(jax.make_jaxpr(run)(state).jaxpr)

    assert loops(algo) == loops(etrax.DRTRL(chunk_steps=1)) == 1
    assert loops(etrax.DRTRL(chunk_steps=6)) > 1  # the chunk's backward pass
    grads = _online(algo, g1, state, xs, ts)
    assert rel_err(grads, _online(etrax.DRTRL(chunk_steps=6), g1, state, xs, ts)) <= 1e-12


@pytest.mark.parametrize("n", [0, 1, 2, 3, 8, 9])
@pytest.mark.parametrize("axis", [-1, -2, 0])
def test_short_sum_equals_a_sum(n: int, axis: int) -> None:
    """`short_sum` (slice additions for a short axis, `jnp.sum` beyond `SHORT_AXIS`)
    equals `jnp.sum` over any axis and length, empty included; the small-block
    products of the chunked kernels built on it equal their einsums."""
    from etrax.algorithms import _kernels

    shape = [3, 4, 5]
    shape[axis] = n
    x = jax.random.normal(jax.random.PRNGKey(n), tuple(shape))
    np.testing.assert_allclose(_kernels.short_sum(x, axis), jnp.sum(x, axis=axis), rtol=1e-12)
    if axis == -1 and n:
        M = jax.random.normal(jax.random.PRNGKey(7), (2, 3, n, n))
        N = jax.random.normal(jax.random.PRNGKey(8), (2, 3, n, n))
        v = jax.random.normal(jax.random.PRNGKey(9), (2, 3, n))
        np.testing.assert_allclose(
            _kernels.matvec(M, v), jnp.einsum("noac,noc->noa", M, v), rtol=1e-12
        )
        np.testing.assert_allclose(
            _kernels._matmul(M, N), jnp.einsum("noac,nocb->noab", M, N), rtol=1e-12
        )


def test_one_state_block_products_use_the_trace_as_it_is() -> None:
    """With one state per hidden group (``S = 1``) the small-block products are a
    single element-wise product in which the trace enters with its own shape (no
    reshape, broadcast or squeeze of it), so that XLA can write a loop's new trace
    into the old one's buffer; a reshaped operand made it copy the trace every step.
    Same values as the general form."""
    from etrax.algorithms import _kernels

    M = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 1, 1))
    N = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 1, 1))
    v = jax.random.normal(jax.random.PRNGKey(3), (2, 3, 1))
    for fn, other, general in (
        (_kernels.matvec, v, _kernels.short_sum(M * v[..., None, :])),
        (_kernels._matmul, N, _kernels.short_sum(M[..., :, :, None] * N[..., None, :, :], -2)),
    ):
        np.testing.assert_array_equal(fn(M, other), general)
        jaxpr = jax.make_jaxpr(fn)(M, other).jaxpr
        trace = jaxpr.invars[1]
        users = [e.primitive.name for e in jaxpr.eqns if trace in e.invars]
        assert users == ["mul"], jaxpr


def test_squeezed_scan_is_a_scan_without_axes_of_length_one() -> None:
    """`squeezed_scan` returns exactly what `jax.lax.scan` does (forward and reverse,
    a pytree with axes of length 1, a scalar, an empty array, a weak type and a PRNG
    key), while the loop itself carries and stacks no axis of length 1 (the steps'
    axis aside). `squeezed` keeps the leading axes it is told to, other axes, and a
    PRNG key as they are."""
    from etrax.algorithms import _kernels

    f = jax.random.normal(jax.random.PRNGKey(0), (5, 3, 1, 1), jnp.float64)
    init = {
        "col": jnp.ones((3, 1), jnp.float64),
        "cube": jnp.full((3, 1, 1), 2.0, jnp.float64),
        "empty": jnp.zeros((0, 2), jnp.float64),
        "scalar": jnp.asarray(0.5, jnp.float64),
        "weak": jnp.asarray(1.0),
        "key": jax.random.key(1),
    }

    def body(c: dict[str, Any], x: Array) -> tuple[dict[str, Any], Any]:
        key, sub = jax.random.split(c["key"])
        col = c["col"] * x[..., 0] + c["scalar"]
        new = {**c, "col": col, "cube": c["cube"] * x, "weak": c["weak"] * 0.5, "key": key}
        out = (col[:, None, :], c["empty"] + 1.0, c["weak"], jax.random.normal(sub, (2, 1)))
        return new, out

    for reverse in (False, True):
        want = jax.lax.scan(body, init, f, reverse=reverse)
        got = _kernels.squeezed_scan(body, init, f, reverse=reverse)
        assert str(jax.tree.structure(got)) == str(jax.tree.structure(want))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert etrax._compat.aval_of(a).weak_type == etrax._compat.aval_of(b).weak_type
            if jnp.issubdtype(a.dtype, jax.dtypes.extended):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            np.testing.assert_array_equal(a, b)
    (loop,) = [
        e for e in jax.make_jaxpr(lambda: _kernels.squeezed_scan(body, init, f))().jaxpr.eqns
        if e.primitive.name == "scan"
    ]  # fmt: skip
    n_carry = loop.params["num_carry"]
    assert all(1 not in v.aval.shape for v in loop.outvars[:n_carry])
    assert all(1 not in v.aval.shape[1:] for v in loop.outvars[n_carry:])
    assert all(1 not in v.aval.shape[1:] for v in loop.invars[-1:])  # the steps' inputs
    assert _kernels.squeezed(f, 1).shape == (5, 3)
    assert _kernels.squeezed(jnp.zeros((1, 1, 2)), 1).shape == (1, 2)
    assert _kernels.squeezed(init["key"]) is init["key"]
    block = jnp.zeros((4, 2, 2))
    assert _kernels.squeezed(block) is block


def test_a_vmap_learner_of_a_batch_keeps_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `vmap` learner compiles one sample's graph but runs the whole batch each step:
    with ``chunk_steps=None`` it chunks on an accelerator when the batch has more than
    one sample (and runs per step for one)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    model = etrax.nn.GRUCell(3, 4)
    x0 = jnp.zeros((5, 3))
    learner = etrax.compile(model, etrax.DRTRL(), x0, batch_size=5, vmap=True)
    assert learner._driver_rule.chunk_for(learner.graph) == 32
    assert learner.algorithm.chunk_for(learner.graph) == 1
    single = etrax.compile(etrax.nn.GRUCell(3, 4), etrax.DRTRL(), x0[:1], batch_size=1, vmap=True)
    assert single._driver_rule.chunk_for(single.graph) == 1
    explicit = etrax.compile(etrax.nn.GRUCell(3, 4), etrax.DRTRL(4), x0, batch_size=5, vmap=True)
    assert explicit._driver_rule.chunk_for(explicit.graph) == 4
