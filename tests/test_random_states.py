"""Steps that draw random numbers: a typed PRNG key held in a model's state, and
brainstate's global random state (noise injection, dropout in training mode)."""

import pathlib
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax

from .oracles import bptt_grads


class OwnKey(brainstate.nn.Module):
    """A leaky tanh unit with input noise from a typed key in its own state."""

    def __init__(self) -> None:
        super().__init__()
        self.W = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(1), (3, 4)))

    def init_state(self, batch_size: Any = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))
        self.key = brainstate.ShortTermState(jax.random.key(0))

    def update(self, x: Array) -> Array:
        key, sub = jax.random.split(self.key.value)
        self.key.value = key
        noise = 0.1 * jax.random.normal(sub, (4,))
        h = 0.5 * self.h.value + jnp.tanh(x @ self.W.value) + noise
        self.h.value = h
        return h


class GlobalNoise(OwnKey):
    """The same unit drawing its noise from brainstate's global random state."""

    def update(self, x: Array) -> Array:
        noise = 0.1 * brainstate.random.normal(size=(4,))
        h = 0.5 * self.h.value + jnp.tanh(x @ self.W.value) + noise
        self.h.value = h
        return h


def _array(value: Any) -> Array:
    assert isinstance(value, jax.Array)
    return value


def _mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def _data(T: int) -> tuple[Array, Array]:
    xs = jax.random.normal(jax.random.PRNGKey(2), (T, 3))
    return xs, jax.random.normal(jax.random.PRNGKey(3), (T, 4))


@pytest.mark.parametrize("rule", [etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5)])
def test_a_typed_key_in_a_state_is_carried(rule: Any) -> None:
    """A model that keeps a typed PRNG key (``key<fry>``) in a state compiles; the
    key is carried between steps, and at T = 1 every rule equals BPTT through
    brainstate's own ``update``; at T = 3 the key advances (different noise)."""
    model = OwnKey()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    state = etrax.state_of(graph)
    key0 = state.other[("key",)]
    assert isinstance(key0, jax.Array) and jnp.issubdtype(key0.dtype, jax.dtypes.extended)
    xs, ts = _data(1)
    got = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _mse)
    want = bptt_grads(model, state, xs, ts, _mse)
    np.testing.assert_allclose(_array(got.grads[("W",)]), want[("W",)], rtol=1e-12, atol=1e-14)
    xs, ts = _data(3)
    res = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _mse)
    key = res.state.other[("key",)]
    assert isinstance(key, jax.Array)
    assert not np.array_equal(jax.random.key_data(key), jax.random.key_data(key0))


def test_brainstate_global_random_state_is_carried_and_reported() -> None:
    """A step drawing from brainstate's global random state compiles; the report
    names that state as carried (information, not a weight)."""
    model = GlobalNoise()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.zeros(3))
    records = graph.explain(kind=etrax.DiagnosticKind.STATE_MISMATCH)
    assert records and all(r.weight_path is None for r in records)
    assert all(r.level is etrax.DiagnosticLevel.INFO for r in records)
    assert set(graph.weight_rules()) == {("W",)}
    state = etrax.state_of(graph)
    xs, ts = _data(1)
    rule = etrax.DRTRL()
    online = etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, _mse).grads
    exact = etrax.bptt_grad(graph, state, xs, ts, _mse).grads
    np.testing.assert_allclose(
        _array(online[("W",)]), _array(exact[("W",)]), rtol=1e-12, atol=1e-14
    )


def test_a_checkpoint_keeps_a_typed_key_state(tmp_path: pathlib.Path) -> None:
    """A learner whose model keeps a typed PRNG key saves and resumes: the key is
    stored as its key data and wrapped back, and the resumed run draws what the
    saved one does."""

    def learner() -> etrax.OnlineLearner:
        return etrax.compile(OwnKey(), etrax.DRTRL(), jnp.zeros(3))

    xs, ts = _data(3)
    saved = learner()
    saved.etrace_grad(xs, ts, _mse)
    saved.save(tmp_path / "key.eqx")
    resumed = learner()
    resumed.load(tmp_path / "key.eqx")
    key = etrax.state_of(resumed.graph).other[("key",)]
    assert isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    want, got = saved.etrace_grad(xs, ts, _mse), resumed.etrace_grad(xs, ts, _mse)
    np.testing.assert_array_equal(_array(got[("W",)]), _array(want[("W",)]))
    fresh = learner()  # negative control: another key draws other noise
    other = fresh.etrace_grad(xs, ts, _mse)
    assert not np.array_equal(_array(other[("W",)]), _array(want[("W",)]))
