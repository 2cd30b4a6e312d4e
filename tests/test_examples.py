"""The end-to-end examples run in their short modes (`examples/digits.py`,
`examples/memory.py`), and `etrax.evaluate` runs a model forward over a sequence."""

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import etrax

from .models import LeakyTanhReadout

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"etrax_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def float32() -> Iterator[None]:
    # The examples run in float32 as a user runs them; optax's Adam mixes Python floats
    # with int32 step counts, which strict dtype promotion rejects.
    brainstate.environ.set(precision=32)
    try:
        with jax.numpy_dtype_promotion("standard"):
            yield
    finally:
        brainstate.environ.set(precision=64)


# --- etrax.evaluate ------------------------------------------------------------------------


def _graph() -> tuple[etrax.ETraceGraph, etrax.ModelState]:
    brainstate.random.seed(1)
    net = LeakyTanhReadout(3, 5)
    brainstate.nn.init_all_states(net, batch_size=2)
    graph = etrax.compile_etrace_graph(net, jnp.zeros((2, 3)))
    return graph, etrax.state_of(graph)


def test_evaluate_matches_step_by_step_forward() -> None:
    graph, state = _graph()
    xs = jax.random.normal(jax.random.key(0), (6, 2, 3))
    ys, final = etrax.evaluate(graph, state, xs)
    assert isinstance(ys, jax.Array) and ys.shape == (6, 2, 2)
    # oracle: the one-step forward, applied in a Python loop
    s = state
    expected = []
    for t in range(6):
        y, s = etrax.forward(graph, s, xs[t])
        expected.append(y)
    np.testing.assert_allclose(ys, jnp.stack(expected), rtol=1e-12, atol=1e-12)
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(s), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # and the same outputs as the Jacobian-computing multi_step
    outs, _, _ = etrax.multi_step(graph, state, xs)
    np.testing.assert_allclose(ys, outs, rtol=1e-12, atol=1e-12)


def test_evaluate_continues_from_its_final_state() -> None:
    graph, state = _graph()
    xs = jax.random.normal(jax.random.key(1), (6, 2, 3))
    whole, _ = etrax.evaluate(graph, state, xs)
    first, mid = etrax.evaluate(graph, state, xs[:4])
    rest, _ = etrax.evaluate(graph, mid, xs[4:])
    assert isinstance(first, jax.Array) and isinstance(rest, jax.Array)
    assert isinstance(whole, jax.Array)
    np.testing.assert_allclose(jnp.concatenate([first, rest]), whole, rtol=1e-12, atol=1e-12)


def test_evaluate_refuses_bad_inputs() -> None:
    graph, state = _graph()
    with pytest.raises(etrax.StepInputError, match="time-major"):
        etrax.evaluate(graph, state, jnp.zeros((2, 6, 3)))  # batch-first
    with pytest.raises(etrax.StepInputError, match="T = 0"):
        etrax.evaluate(graph, state, jnp.zeros((0, 2, 3)))
    with pytest.raises(TypeError):  # a graph is required (the runtime checker says so first)
        etrax.evaluate(LeakyTanhReadout(3, 5), state, jnp.zeros((6, 2, 3)))  # type: ignore[arg-type]  # the model, not its graph


# --- the examples --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> Iterator[ModuleType]:
    module = _load("digits")
    yield module
    del sys.modules[module.__name__]


@pytest.fixture(scope="module")
def memory() -> Iterator[ModuleType]:
    module = _load("memory")
    yield module
    del sys.modules[module.__name__]


def test_digits_data_are_row_sequences(digits: ModuleType) -> None:
    train, test = digits.load_digits()
    assert train.xs.shape[0] == 8 and train.xs.shape[2] == 8
    assert train.xs.shape[1] + test.xs.shape[1] == 1797
    assert train.xs.min() >= 0.0 and train.xs.max() <= 1.0
    assert set(np.unique(test.labels)) == set(range(10))
    again, _ = digits.load_digits()
    np.testing.assert_array_equal(again.labels, train.labels)  # a fixed split


@pytest.mark.slow
def test_digits_short_mode_trains_every_method(digits: ModuleType, float32: None) -> None:
    results = digits.main(["--short", "--neurons", "ALIF"])
    assert [r.method for r in results] == ["e-prop", "D-RTRL", "BPTT"]
    for r in results:
        assert all(np.isfinite(r.losses)) and 0.0 <= r.test_accuracy <= 1.0


@pytest.mark.slow
def test_memory_online_is_flat_and_bptt_grows(memory: ModuleType, float32: None) -> None:
    results = memory.run((100, 3000), methods=("pp-prop", "BPTT"))
    by = {(r.method, r.T): r for r in results}
    # pp-prop's chunk holds its steps' stacked operands; the chunk is 25 steps at T = 100
    # and 30 at T = 3,000 (the divisor of T nearest 32), so its scratch moves a little
    # but does not grow with T
    online = by["pp-prop", 100].scratch_mib, by["pp-prop", 3000].scratch_mib
    assert max(online) <= 1.25 * min(online)
    assert by["BPTT", 3000].scratch_mib > 5 * by["BPTT", 100].scratch_mib
    assert "| pp-prop |" in memory.table(results)


@pytest.mark.slow
def test_memory_short_mode_writes_its_plot(
    memory: ModuleType, float32: None, tmp_path: Path
) -> None:
    memory.main(["--short", "--out", str(tmp_path)])
    assert (tmp_path / "etrax_memory.png").stat().st_size > 10_000


# --- the demo's verdicts -------------------------------------------------------------------


def test_demo_verdicts_follow_the_plotted_curves() -> None:
    from etrax._demo import SMOOTH, Result, _verdicts

    falling = Result(losses=[1.0] * SMOOTH + [0.1] * 100)
    climbing = Result(losses=[1.0] * SMOOTH + [0.01] * 50 + [0.3] * 50)
    flat = Result(losses=[1.0] * (SMOOTH + 100))
    bad = Result(losses=[1.0] * SMOOTH, accuracy=0.3)
    good = Result(losses=[1.0] * SMOOTH, accuracy=0.9)
    # the curve's first and last points are the means of the first and last SMOOTH losses
    its, values = climbing.curve()
    assert its[0] == SMOOTH - 1 and values[0] == 1.0 and values[-1] == pytest.approx(0.3)
    lines = _verdicts(
        {
            "regression": {"falling": falling, "climbing": climbing, "flat": flat},
            "classifier": {"bad": bad, "BPTT": good},
        }
    )
    by = {line.split()[0]: line for line in lines}
    assert "falling  learned" in by["falling"] and "rose again" not in by["falling"]
    assert " learned" in by["climbing"] and "rose again at the end (30.0×" in by["climbing"]
    assert "did NOT learn" in by["flat"] and "100% of the initial" in by["flat"]
    assert (
        "did NOT learn" in by["bad"] and "30.0%" in by["bad"] and "60.0 points below" in by["bad"]
    )
    assert " learned" in by["BPTT"] and "90.0%" in by["BPTT"]


@pytest.mark.slow
def test_memory_rss_of_an_online_stream_is_flat(memory: ModuleType) -> None:
    # each measurement runs in a fresh process (float32, as a user runs it)
    rss = memory.peak_rss((100, 1_000), methods=("pp-prop",))
    assert rss["pp-prop", 100] > 0 and abs(rss["pp-prop", 1_000] - rss["pp-prop", 100]) < 50
    assert "| pp-prop |" in memory.rss_table(rss)
