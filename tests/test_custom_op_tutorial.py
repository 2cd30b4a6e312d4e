"""The custom-op tutorial (`examples/custom_op.py`, shown in docs/tutorials/custom-op.md)
runs as written: its rules match `jax.vjp` and its model learns online."""

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import pytest

import etrax

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_op.py"


@pytest.fixture(scope="module")
def tutorial() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("etrax_custom_op_tutorial", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_tutorial_op_is_registered_with_rules(tutorial: ModuleType) -> None:
    spec = etrax.etp_spec(tutorial.scaled_matmul_p)
    assert spec is not None and spec.rules is tutorial.SCALED_MATMUL_RULES
    assert tutorial.check_rules() <= 1e-12


@pytest.mark.parametrize(
    "algorithm", [etrax.DRTRL(), etrax.PPProp(decay=0.9)], ids=["d_rtrl", "pp_prop"]
)
def test_tutorial_model_learns_online(
    tutorial: ModuleType, algorithm: etrax.OnlineAlgorithm[Any]
) -> None:
    losses: list[float] = tutorial.train(algorithm, iterations=40, T=20, batch=8)
    first = sum(losses[:5]) / 5
    last = sum(losses[-5:]) / 5
    assert last < 0.25 * first, (first, last)


def test_tutorial_gradient_matches_bptt_for_one_step(tutorial: ModuleType) -> None:
    """At T = 1 every online algorithm is exact: a check that the registered rules
    are wired correctly, not only that training happens to make progress."""
    brainstate.random.seed(1)
    model = tutorial.LeakyRNN(2, 3)
    brainstate.nn.init_all_states(model, batch_size=2)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 2), brainstate.environ.dftype())
    t = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 1), brainstate.environ.dftype())
    graph = etrax.compile_etrace_graph(model, x[0])
    state = etrax.state_of(graph)
    expected, _ = etrax.bptt_grad(graph, state, x, t, tutorial.mse)
    rules: tuple[etrax.OnlineAlgorithm[Any], ...] = (etrax.DRTRL(), etrax.PPProp(decay=0.5))
    for algo in rules:
        got, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), x, t, tutorial.mse)
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            assert float(jnp.max(jnp.abs(u - v))) <= 1e-12
