"""Purity and determinism of the compiler pipeline."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import etrax

from .models import CATALOGUE, ModelCase


def _frozen(obj: object) -> bool:
    if not isinstance(obj, eqx.Module):
        return False
    field = dataclasses.fields(obj)[0].name
    try:
        setattr(obj, field, None)
    except dataclasses.FrozenInstanceError:
        return True
    return False


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.name)
def test_stage_outputs_are_frozen_modules(case: ModelCase) -> None:
    model, x = case.make()
    minfo = etrax.extract(model, x)
    grouped = etrax.group(minfo)
    related = etrax.relate(grouped)
    rewritten = etrax.rewrite(related)
    graph = etrax.perturb(rewritten)
    for artifact in (minfo, grouped, related, rewritten, graph):
        assert _frozen(artifact), type(artifact).__name__
        assert jax.tree.leaves(artifact) == []  # everything is static metadata
    for g in graph.hidden_groups:
        assert _frozen(g)
    for r in graph.hidden_param_op_relations:
        assert _frozen(r)
    assert hash(graph) == hash(graph)


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.name)
def test_compiling_twice_is_identical(case: ModelCase) -> None:
    model, x = case.make()
    a = etrax.compile_etrace_graph(model, x)
    b = etrax.compile_etrace_graph(model, x)
    assert a.hidden_groups == b.hidden_groups
    assert a.hidden_param_op_relations == b.hidden_param_op_relations
    assert a.diagnostics == b.diagnostics
    assert [r.weight_path for r in a.hidden_param_op_relations] == [
        r.weight_path for r in b.hidden_param_op_relations
    ]
    assert a == b


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.name)
def test_compilation_does_not_change_state_values(case: ModelCase) -> None:
    model, x = case.make()
    before = {p: jax.tree.map(np.asarray, s.value) for p, s in model.states().items()}
    etrax.compile_etrace_graph(model, x)
    after = {p: jax.tree.map(np.asarray, s.value) for p, s in model.states().items()}
    assert before.keys() == after.keys()
    for p in before:
        for u, v in zip(jax.tree.leaves(before[p]), jax.tree.leaves(after[p]), strict=True):
            np.testing.assert_array_equal(u, v)
            assert not isinstance(v, jax.core.Tracer)


def test_compose_is_the_pipeline() -> None:
    model, x = CATALOGUE[0].make()
    pipeline = etrax.compose(etrax.extract, etrax.group, etrax.relate, etrax.rewrite, etrax.perturb)
    assert pipeline(model, x) == etrax.compile_etrace_graph(model, x)
    no_perturb = etrax.compile_etrace_graph(model, x, include_hidden_perturb=False)
    assert no_perturb.hidden_perturb is None
    with pytest.raises(ValueError, match="include_hidden_perturb"):
        no_perturb.call_hidden_perturb((x,), [jnp.zeros(4)])
    with pytest.raises(ValueError, match="at least one stage"):
        etrax.compose()  # type: ignore[call-overload]  # the error under test
