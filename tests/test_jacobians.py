"""Jacobian oracles (float64): the compiler's transitions and tails against
`jax.jacrev` of brainstate's own one-step map, and the perturbation against
`jax.grad` of a loss on the step's outputs."""

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax

from .models import (
    CATALOGUE,
    LeakyFeedForwardStack,
    MeanMixing,
    ModelCase,
    RollMixing,
    StackedGRU,
    TwoStateNeuron,
    build,
)
from .oracles import OracleJacobians, graph_env, pure_call, random_state_values

TOL = 1e-10

MIXING = (
    ModelCase("mean_mixing", lambda: build(MeanMixing, 3, 4), False),
    ModelCase("roll_mixing", lambda: build(RollMixing, 3, 4), False),
)


@pytest.mark.parametrize("case", CATALOGUE + MIXING, ids=lambda c: c.name)
def test_programs_match_jacrev(case: ModelCase) -> None:
    """Each group transition reproduces the block diagonal of the one-step Jacobian
    and each relation tail the diagonal of ``∂h/∂y``."""
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    values = random_state_values(graph)
    env = graph_env(graph, (x,), values)
    oracle = OracleJacobians(graph, model, x, values, case.diagonal)
    for grp, expected, off in zip(graph.hidden_groups, oracle.D, oracle.off_diagonal, strict=True):
        hidden = [values[p] for p in grp.hidden_paths]
        consts = [env[c] for c in grp.transition_consts]
        D = np.asarray(grp.diagonal_jacobian(hidden, consts))
        np.testing.assert_allclose(D, expected, rtol=0, atol=TOL)
        if case.diagonal:
            assert off < TOL, "a diagonal model has cross-position terms"
            assert grp.is_diagonal_recurrence
    for rel, dfs, offs in zip(
        graph.hidden_param_op_relations, oracle.df, oracle.tail_off, strict=True
    ):
        y = env[rel.y_var]
        for tail, expected_df, off in zip(rel.tails, dfs, offs, strict=True):
            grp = graph.hidden_groups[tail.group_index]
            df = np.asarray(tail.diagonal_jacobian(y, [env[c] for c in tail.consts], grp))
            np.testing.assert_allclose(df, expected_df, rtol=0, atol=TOL)
            if tail.is_diagonal:
                assert off < TOL


def test_position_mixing_is_flagged() -> None:
    model, x = build(MeanMixing, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    (grp,) = graph.hidden_groups
    assert not grp.is_diagonal_recurrence
    assert grp.mixing_reason is not None and "reduce_sum" in grp.mixing_reason
    (rec,) = graph.explain(kind=etrax.DiagnosticKind.TRANSITION_MIXES_POSITIONS)
    assert rec.level is etrax.DiagnosticLevel.WARNING
    model, x = build(RollMixing, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    assert not graph.hidden_groups[0].is_diagonal_recurrence
    (rel,) = graph.hidden_param_op_relations
    assert not rel.tails[0].is_diagonal
    assert graph.explain(kind=etrax.DiagnosticKind.TAIL_MIXES_POSITIONS)


# --- perturbation: ∂L/∂h^t ------------------------------------------------------------


def _perturbation_grads(
    graph: etrax.ETraceGraph, x: Any, values: dict[Any, Any], cot: Array
) -> dict[Any, Array]:
    hp = graph.hidden_perturb
    assert hp is not None

    def loss(perturbs: list[Array]) -> Array:
        out, _, _, _ = graph.call_hidden_perturb((x,), perturbs, values)
        return jnp.sum(out * cot)

    grads = jax.grad(loss)(hp.init_perturb_data())
    return dict(zip(hp.perturb_hidden_paths, grads, strict=True))


def _out_cotangent(graph: etrax.ETraceGraph, values: dict[Any, Any], x: Any) -> Array:
    out, _, _, _ = graph.module_info.jaxpr_call(x, old_state_vals=values)
    return jax.random.normal(jax.random.PRNGKey(3), jnp.shape(out), jnp.result_type(out))


def test_perturbation_gru_lstm_two_state() -> None:
    for cls in (etrax.nn.GRUCell, etrax.nn.LSTMCell, TwoStateNeuron):
        model, x = build(cls, 3, 4)
        graph = etrax.compile_etrace_graph(model, x)
        values = random_state_values(graph)
        cot = _out_cotangent(graph, values, x)
        grads = _perturbation_grads(graph, x, values, cot)
        # The output is the first hidden state's new value itself.
        first = graph.module_info.hidden_paths[0]
        np.testing.assert_allclose(grads[first], cot, rtol=0, atol=TOL)
        # Other members feed the output only through the traced transition.
        for p in graph.module_info.hidden_paths[1:]:
            np.testing.assert_allclose(grads[p], 0.0, atol=TOL)


@pytest.mark.parametrize(
    ("cls", "args"), [(StackedGRU, ()), (LeakyFeedForwardStack, (3, 4, 5))], ids=["gru", "leaky"]
)
def test_perturbation_stacked_layers_through_weights(
    cls: type[brainstate.nn.Module], args: tuple[int, ...]
) -> None:
    model, x = build(cls, *args)
    graph = etrax.compile_etrace_graph(model, x)
    values = random_state_values(graph)
    cot = _out_cotangent(graph, values, x)
    grads = _perturbation_grads(graph, x, values, cot)
    l1, l2 = graph.module_info.hidden_paths
    m: Any = model
    readout = m.out if hasattr(m, "out") else m.readout

    def from_h2(h2: Array) -> Array:
        return jnp.sum(readout(h2) * cot)

    new_vals = graph.module_info.jaxpr_call(x, old_state_vals=values)[1]
    # layer 2 reads h1 through its weights: that whole route counts
    from_h1 = pure_call(model, lambda h1: jnp.sum(readout(m.l2(h1)) * cot), values, new_vals[l1])
    np.testing.assert_allclose(grads[l2], jax.grad(from_h2)(new_vals[l2]), rtol=0, atol=TOL)
    np.testing.assert_allclose(grads[l1], jax.grad(from_h1)(new_vals[l1]), rtol=0, atol=TOL)


def test_perturbation_is_a_no_op_at_zero() -> None:
    for case in CATALOGUE:
        model, x = case.make()
        graph = etrax.compile_etrace_graph(model, x)
        values = random_state_values(graph)
        hp = graph.hidden_perturb
        assert hp is not None
        a = graph.call_hidden_perturb((x,), hp.init_perturb_data(), values)
        b = graph.module_info.jaxpr_call(x, old_state_vals=values)
        for u, v in zip(jax.tree.leaves(a[:3]), jax.tree.leaves(b[:3]), strict=True):
            np.testing.assert_array_equal(u, v)
