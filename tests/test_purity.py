"""Purity and determinism of the compiler pipeline."""

import dataclasses
from collections.abc import Callable
from typing import Any

import brainstate
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax
from etrax._compat import derivative_rules_key

from .models import CATALOGUE, ModelCase
from .oracles import bptt_grads


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


class SurrogateLIF(brainstate.nn.Module):
    """A leaky integrate-and-fire layer whose spike's pseudo-derivative has a width
    `alpha` read when the step is traced (a plain `jax.custom_jvp` closure)."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha
        self.fc = etrax.nn.Linear(3, 4)
        self.out = etrax.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(4, brainstate.environ.dftype()))

    def update(self, x: Array) -> Array:
        alpha = self.alpha

        @jax.custom_jvp
        def spike(u: Array) -> Array:
            return (u > 0).astype(u.dtype)

        @spike.defjvp
        def _(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
            (u,), (du,) = primals, tangents
            return spike(u), du * alpha * jnp.maximum(0.0, 1.0 - jnp.abs(u))

        v = 0.8 * self.v.value + self.fc(x)
        s = spike(v - 0.5)
        self.v.value = v - s
        return self.out(s)


def _mse(y: Array, target: Array) -> Array:
    return jnp.sum((y - target) ** 2)


def test_a_changed_derivative_rule_gives_another_graph() -> None:
    """The printed jaxpr names a custom JVP rule but does not show it: a surrogate whose
    width changed between two compiles of one model must give unequal graphs, so that
    no compiled program of the first is reused for the second (it was: the second graph
    learned with the first surrogate). D-RTRL is exact on this diagonal model, so each
    graph's online gradient equals BPTT through the model's own update."""
    model = SurrogateLIF(alpha=0.3)
    brainstate.nn.init_all_states(model)
    x = jnp.zeros(3)
    xs = 2.0 * jax.random.normal(jax.random.key(1), (6, 3))
    targets = jax.random.normal(jax.random.key(2), (6, 2))
    a = etrax.compile_etrace_graph(model, x)
    assert a == etrax.compile_etrace_graph(model, x)  # the same rule: equal, reused
    model.alpha = 0.9
    b = etrax.compile_etrace_graph(model, x)
    assert a != b
    grads: dict[str, Any] = {}
    for name, graph in (("a", a), ("b", b)):
        state = etrax.state_of(graph)
        algo = etrax.DRTRL()
        grads[name], _ = etrax.online_grad(
            graph, algo, state, algo.init(graph, state), xs, targets, _mse
        )
        model.alpha = 0.3 if name == "a" else 0.9
        expected = bptt_grads(model, state, xs, targets, _mse)
        for path, g in expected.items():
            for u, v in zip(jax.tree.leaves(grads[name][path]), jax.tree.leaves(g), strict=True):
                np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12)
    w = ("fc", "weight")
    flat = {
        k: np.concatenate([np.ravel(v) for v in jax.tree.leaves(g[w])]) for k, g in grads.items()
    }
    assert not np.allclose(flat["a"], flat["b"])


def _clipped(bound: float) -> Callable[[Array], Array]:
    @jax.custom_vjp
    def f(x: Array) -> Array:
        return x

    def fwd(x: Array) -> tuple[Array, None]:
        return x, None

    def bwd(_: None, g: Array) -> tuple[Array]:
        return (jnp.clip(g, -bound, bound),)

    f.defvjp(fwd, bwd)
    return f


def test_derivative_rules_key_sees_custom_vjp_constants() -> None:
    x = jnp.ones(3)
    one = jax.make_jaxpr(_clipped(1.0))(x).jaxpr
    again = jax.make_jaxpr(_clipped(1.0))(x).jaxpr
    two = jax.make_jaxpr(_clipped(2.0))(x).jaxpr
    assert str(one) == str(two)  # what the printed jaxpr alone cannot tell apart
    assert derivative_rules_key(one) == derivative_rules_key(again)
    assert derivative_rules_key(one) != derivative_rules_key(two)
    nested = jax.make_jaxpr(jax.jit(lambda y: jnp.sin(_clipped(2.0)(y))))(x).jaxpr
    assert derivative_rules_key(nested) == (derivative_rules_key(two),)


class FixedNoise(brainstate.nn.Module):
    """A leaky layer with a fixed noise pattern drawn from a typed PRNG key that the
    module holds as a plain attribute: the key is a constant of the traced step."""

    def __init__(self, key: Array) -> None:
        super().__init__()
        self.key = key
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4, brainstate.environ.dftype()))

    def update(self, x: Array) -> Array:
        noise = jax.random.normal(self.key, (4,), brainstate.environ.dftype())
        self.h.value = 0.8 * self.h.value + jnp.tanh(self.fc(x) + 0.3 * noise)
        return self.h.value


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_a_prng_key_constant_in_the_step_is_hashed_and_learned_through(
    make_key: Callable[[int], Array],
) -> None:
    """A typed key constant made the graph unhashable (NumPy cannot hold key data), so
    every driver failed with JAX's "non-hashable static arguments"."""
    model = FixedNoise(make_key(42))
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert graph == etrax.compile_etrace_graph(model, jnp.zeros(3))
    assert hash(graph) == hash(etrax.compile_etrace_graph(model, jnp.zeros(3)))
    other = FixedNoise(make_key(7))
    brainstate.nn.init_all_states(other)
    assert graph != etrax.compile_etrace_graph(other, jnp.zeros(3))  # other noise, other step
    xs = jax.random.normal(jax.random.key(1), (5, 3))
    targets = jax.random.normal(jax.random.key(2), (5, 4))
    state = etrax.state_of(graph)
    algo = etrax.DRTRL()
    got, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, targets, _mse)
    expected = bptt_grads(model, state, xs, targets, _mse)  # D-RTRL is exact here
    for path, g in expected.items():
        for u, v in zip(jax.tree.leaves(got[path]), jax.tree.leaves(g), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12)
