"""Loss functions of every kind a user writes: unhashable callables (an equinox
Module holding arrays, a plain dataclass) and losses or aux values that are Python
or NumPy numbers."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax

from .models import build


class WeightedMSE(eqx.Module):
    w: Array

    def __call__(self, y: Array, t: Array) -> Array:
        return jnp.sum(self.w * (y - t) ** 2)


@dataclasses.dataclass
class ScaledMSE:  # eq=True without frozen: not hashable
    scale: float

    def __call__(self, y: Array, t: Array) -> Array:
        return self.scale * jnp.sum((y - t) ** 2)


def _mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def _setup() -> tuple[etrax.ETraceGraph, etrax.ModelState, Array, Array]:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    xs = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    ts = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    return graph, etrax.state_of(graph), xs, ts


@pytest.mark.parametrize("make", [lambda: WeightedMSE(jnp.ones(4)), lambda: ScaledMSE(1.0)])
def test_unhashable_losses_equal_their_hashable_twin(make: Any) -> None:
    """An unhashable loss is keyed by identity: online_grad, bptt_grad and the
    learner run it, with the gradients of the same loss written as a function."""
    loss = make()
    with pytest.raises(TypeError):
        hash(loss)
    graph, state, xs, ts = _setup()
    algo = etrax.DRTRL()
    got = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, loss).grads
    want = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, _mse).grads
    exact = etrax.bptt_grad(graph, state, xs, ts, loss).grads
    exact_want = etrax.bptt_grad(graph, state, xs, ts, _mse).grads
    for a, b in ((got, want), (exact, exact_want)):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(u, v, rtol=0, atol=1e-12)
    model, x = build(etrax.nn.GRUCell, 3, 4)
    learner = etrax.compile(model, etrax.DRTRL(), x)
    learner.etrace_grad(xs, ts, loss)
    learner.etrace_grad(xs, ts, loss)  # the same object: the same program
    learner.bptt_grad(xs, ts, loss)


def test_an_unhashable_losss_values_are_traced_once_per_object() -> None:
    """Two unhashable losses with different values are two programs: the second
    object's values count, not the first's."""
    graph, state, xs, ts = _setup()
    one = etrax.bptt_grad(graph, state, xs, ts, ScaledMSE(1.0)).grads
    three = etrax.bptt_grad(graph, state, xs, ts, ScaledMSE(3.0)).grads
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(three), strict=True):
        np.testing.assert_allclose(3 * a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rule", [etrax.DRTRL(), etrax.PPProp(0.9), etrax.DRTRL(chunk_steps=1)])
def test_python_and_numpy_numbers_from_a_loss(rule: Any) -> None:
    """A loss returning a Python or NumPy number, or an aux of Python numbers, runs
    (as 0-d arrays), in chunks and per step."""
    graph, state, xs, ts = _setup()
    tr = rule.init(graph, state)
    res = etrax.online_grad(
        graph, rule, state, tr, xs, ts, lambda y, t: (_mse(y, t), {"n": 1.0}), has_aux=True
    )
    aux = res.loss_aux
    assert isinstance(aux, dict)
    np.testing.assert_array_equal(aux["n"], np.ones(5))
    for constant in (np.float64(0.5), 0.5):
        res = etrax.online_grad(graph, rule, state, tr, xs, ts, lambda y, t, c=constant: c)
        np.testing.assert_array_equal(res.losses, np.full(5, 0.5))
        assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(res.grads))


def test_bptt_grad_takes_a_loss_with_aux_data_as_online_grad_does() -> None:
    """`bptt_grad(..., has_aux=True)`: the loss returns ``(loss, aux)``; the gradient is
    the plain loss's and the per-step aux comes back stacked, as from `online_grad`."""
    graph, state, xs, ts = _setup()

    def with_aux(y: Any, t: Any) -> Any:
        return _mse(y, t), {"peak": jnp.max(y)}

    plain = etrax.bptt_grad(graph, state, xs, ts, _mse)
    res = etrax.bptt_grad(graph, state, xs, ts, with_aux, has_aux=True)
    for a, b in zip(jax.tree.leaves(res.grads), jax.tree.leaves(plain.grads), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(res.losses, plain.losses)
    rule = etrax.DRTRL()
    online = etrax.online_grad(
        graph, rule, state, rule.init(graph, state), xs, ts, with_aux, has_aux=True
    )
    assert isinstance(res.loss_aux, dict) and isinstance(online.loss_aux, dict)
    np.testing.assert_allclose(res.loss_aux["peak"], online.loss_aux["peak"], rtol=1e-12)
    assert plain.loss_aux is None
    with pytest.raises(TypeError, match="has_aux"):
        etrax.bptt_grad(graph, state, xs, ts, _mse, has_aux=1)  # type: ignore[arg-type]
