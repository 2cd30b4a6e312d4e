"""`check_gradients` (float64): the T = 1 invariant holds on catalogue models, exact
D-RTRL shows no deviation, pp-prop shows one (negative control), and a fabricated
wrong gradient is flagged."""

import functools
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax
from etrax.algorithms import compare_gradients

from .models import CATALOGUE, LeakyTanhReadout, ModelCase, TwoStateNeuron, build

T = 5


class GRUReadout(brainstate.nn.Module):
    """`etrax.nn.GRUCell(3, 4)` followed by a linear readout."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = etrax.nn.GRUCell(3, 4)
        self.readout = etrax.nn.Linear(4, 2)

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.readout(self.rnn(x))
        return out


class DirectLeak(brainstate.nn.Module):
    """``h ← 0.5 h + tanh(x W + b)`` whose readout also reads ``x W + b`` directly: the
    weight is partly traced (its direct route learns instantaneously)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)
        self.readout = etrax.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        pre = self.fc(x)
        self.h.value = 0.5 * self.h.value + jnp.tanh(pre)
        out: Array = self.readout(self.h.value + 0.3 * pre)
        return out


MODELS: dict[str, Any] = {
    "direct_leak": lambda: build(DirectLeak),
    "leaky_tanh_readout": lambda: build(LeakyTanhReadout, 3, 5),
    "two_state": lambda: build(TwoStateNeuron, 3, 4),
    "gru_readout": lambda: build(GRUReadout),
}


def mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


@functools.cache
def problem(name: str) -> tuple[etrax.ETraceGraph, etrax.ModelState, Array, Array]:
    """One compiled graph, state and T-step sequence per model (compiled once)."""
    brainstate.environ.set(precision=64)
    model, x = MODELS[name]()
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(3), (T, *x.shape))
    y0, _ = etrax.forward(graph, state, x)
    targets = jax.random.normal(jax.random.PRNGKey(4), (T, *y0.shape))
    return graph, state, xs, targets


@functools.cache
def checked(name: str, algo: etrax.OnlineAlgorithm[Any]) -> etrax.GradientCheck:
    graph, state, xs, ts = problem(name)
    return etrax.check_gradients(graph, algo, state, xs, ts, mse)


def _leaf_count(state: etrax.ModelState) -> int:
    return sum(len(jax.tree.leaves(v)) for v in state.params.values())


@pytest.mark.parametrize("algo", [etrax.DRTRL(), etrax.PPProp(0.9)], ids=["drtrl", "pp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_first_step_equals_bptt(name: str, algo: etrax.OnlineAlgorithm[Any]) -> None:
    graph, state, _, _ = problem(name)
    check = checked(name, algo)
    assert check.ok, check
    assert check.T == T and not check.broken
    assert len(check.rows) == _leaf_count(state)
    rules = graph.weight_rules()
    for row in check.rows:
        assert row.deviation_t1 < 1e-9, row
        assert row.t1_exact and row.rule is rules[row.path].rule
        assert row.reference_norm > 0.0
    text = str(check)
    assert text == check.table()
    for path in state.params:
        assert ".".join(map(str, path)) in text
    assert "please report" not in text


@pytest.mark.parametrize("name", ["leaky_tanh_readout", "two_state"])
def test_drtrl_is_exact_on_diagonal_models(name: str) -> None:
    check = checked(name, etrax.DRTRL())
    worst = check.worst
    assert worst is not None and worst.deviation < 1e-9, check
    assert all(r.flag == "exact" for r in check.rows)


@pytest.mark.parametrize("name", ["leaky_tanh_readout", "two_state"])
def test_pp_prop_deviation_shows(name: str) -> None:
    """Negative control: the check does see an approximation over the sequence."""
    check = checked(name, etrax.PPProp(0.9))
    worst = check.worst
    assert worst is not None and worst.deviation > 1e-4, check
    assert worst.flag == "approx" and check.ok
    assert worst.rule is etrax.WeightRule.TRACED


def test_windows() -> None:
    graph, state, xs, ts = problem("two_state")
    check = etrax.check_gradients(graph, etrax.DRTRL(), state, xs, ts, mse, window=2)
    assert check.ok and check.window == 2, check
    assert "window=2" in str(check)
    worst = check.worst
    assert worst is not None and worst.deviation < 1e-9  # windows keep a diagonal model exact


def test_non_diagonal_model_deviates_but_keeps_the_invariant() -> None:
    check = checked("gru_readout", etrax.DRTRL())
    worst = check.worst
    assert worst is not None and worst.deviation > 1e-6, check  # GRU's weights mix units
    assert worst.flag == "approx" and check.ok


@pytest.mark.parametrize("name", ["leaky_tanh_readout", "direct_leak"])
def test_random_feedback_is_not_a_bug(name: str) -> None:
    """Random feedback promises no T = 1 equality for the weights its traces learn,
    partly traced ones included (it flagged those as an etrax bug)."""
    graph, state, xs, ts = problem(name)
    algo = etrax.EProp(feedback="random", key=jax.random.key(0))
    check = etrax.check_gradients(graph, algo, state, xs, ts, mse)
    assert check.ok, check
    traced = (etrax.WeightRule.TRACED, etrax.WeightRule.PARTLY_TRACED)
    assert any(row.rule is etrax.WeightRule.PARTLY_TRACED for row in check.rows) == (
        name == "direct_leak"
    )
    for row in check.rows:
        assert row.t1_promised is (row.rule not in traced)
        if row.t1_promised:
            assert row.deviation_t1 < 1e-9


def _grads(scale: float = 1.0) -> dict[tuple[str | int, ...], Any]:
    return {
        ("rnn", "fc", "weight"): {
            "weight": jnp.arange(1.0, 7.0).reshape(2, 3),
            "bias": jnp.array([1.0, -2.0]),
        },
        ("readout", 0): scale * jnp.array([3.0, 4.0]),
    }


def test_a_wrong_first_step_gradient_is_flagged() -> None:
    good = _grads()
    rows = compare_gradients(
        _grads(1.02), good, _grads(1.01), good, rules={("readout", 0): etrax.WeightRule.TRACED}
    )
    assert [(r.path, r.leaf) for r in rows] == [
        (("rnn", "fc", "weight"), "bias"),  # JAX flattens dicts in key order
        (("rnn", "fc", "weight"), "weight"),
        (("readout", 0), ""),
    ]
    bad = rows[2]
    assert np.isclose(bad.deviation_t1, 0.01) and np.isclose(bad.deviation, 0.02)
    assert np.isclose(bad.reference_norm, 5.0) and np.isclose(bad.online_norm, 5.0 * 1.02)
    assert not bad.t1_exact and bad.flag == "T=1 BUG" and bad.name == "readout.0"
    assert bad.rule is etrax.WeightRule.TRACED and rows[0].rule is None
    assert all(r.t1_exact and r.deviation == 0.0 for r in rows[:2])
    assert rows[0].name == "rnn.fc.weight[bias]"
    check = etrax.GradientCheck(algorithm="Fake()", T=3, window=None, rtol=1e-6, rows=rows)
    assert not check.ok and check.broken == (bad,) and check.worst is bad
    text = str(check)
    assert "T = 1 MISMATCH" in text and "please report" in text and "readout.0" in text
    assert len(text.splitlines()) == 2 + 1 + len(rows) + 1  # title, header, rule, rows, verdict
    # the same deviation where the algorithm does not promise T = 1 equality
    allowed = compare_gradients(
        _grads(1.02), good, _grads(1.01), good, t1_unpromised=[("readout", 0)]
    )
    assert allowed[2].flag == "T=1 differs"
    assert etrax.GradientCheck(algorithm="Fake()", T=3, window=None, rtol=1e-6, rows=allowed).ok
    # float32 gradients get a float32 tolerance: a 1e-6 rounding difference is equal
    f32: dict[tuple[str | int, ...], Array] = {("w",): jnp.ones(3, jnp.float32)}
    near: dict[tuple[str | int, ...], Array] = {("w",): jnp.full(3, 1.0 + 1e-6, jnp.float32)}
    (row,) = compare_gradients(near, f32, near, f32)
    assert row.t1_exact and 1e-5 < row.t1_tolerance < 1e-3
    tol64 = etrax.algorithms.t1_tolerance(jnp.float64)
    assert tol64 > 1e-10 and tol64 < 1e-9, tol64
    # comparisons are plain values
    assert compare_gradients(good, good, good, good) == compare_gradients(good, good, good, good)


def test_bad_arguments() -> None:
    graph, state, xs, ts = problem("two_state")
    algo = etrax.DRTRL()
    with pytest.raises(etrax.StepInputError, match="T = 0"):
        etrax.check_gradients(graph, algo, state, xs[:0], ts[:0], mse)
    with pytest.raises(etrax.StepInputError, match="targets"):
        etrax.check_gradients(graph, algo, state, xs, ts[:3], mse)
    with pytest.raises(ValueError, match="window"):
        etrax.check_gradients(graph, algo, state, xs, ts, mse, window=T + 1)
    with pytest.raises(ValueError, match="rtol"):
        etrax.check_gradients(graph, algo, state, xs, ts, mse, rtol=-1.0)
    with pytest.raises(TypeError, match="OnlineAlgorithm"):
        etrax.check_gradients(graph, "drtrl", state, xs, ts, mse)  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(ValueError, match="paths"):
        compare_gradients(_grads(), {}, _grads(), _grads())
    with pytest.raises(ValueError, match="shape"):
        compare_gradients({("w",): jnp.ones(2)}, {("w",): jnp.ones(3)}, {}, {})


@pytest.mark.slow
@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.name)
def test_check_on_the_catalogue(case: ModelCase) -> None:
    """The check runs on every catalogue model with chunked D-RTRL over 7 steps (two
    chunks and a remainder), prints a row per parameter leaf and finds every T = 1
    gradient exact; on the models whose recurrence is diagonal the whole sequence is
    exact too (D-RTRL = BPTT)."""
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(5), (7, *x.shape))
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(6), (7, *y0.shape))
    check = etrax.check_gradients(graph, etrax.DRTRL(chunk_steps=3), state, xs, ts, mse)
    assert check.ok, str(check)
    assert len(check.rows) == _leaf_count(state)
    text = check.table()
    for p in state.params:
        assert str(p) in text or ".".join(map(str, p)) in text, p
    if case.exact_online:
        assert check.worst is not None and check.worst.deviation < 1e-10, str(check)
    else:  # a recurrent weight between hidden values: approximate over time
        assert check.worst is not None and check.worst.deviation > 1e-8, str(check)
