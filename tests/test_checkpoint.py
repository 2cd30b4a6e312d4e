"""Save and resume: an interrupted run, saved and loaded into a model rebuilt from
scratch, continues bit for bit (float32, the common training precision)."""

import pathlib
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array

import etrax

B, T, STEPS, SAVE_AT = 4, 12, 6, 3


class Net(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = etrax.nn.GRUCell(2, 8)
        self.out = etrax.nn.Linear(8, 1)

    def update(self, x: Array) -> Array:
        out: Array = self.out(self.rnn(x))
        return out


def loss_fn(y: Array, target: Array) -> Array:
    return jnp.mean((y - target) ** 2)


def batch(k: int) -> tuple[Array, Array]:
    xs = jax.random.normal(jax.random.key(k), (T, B, 2), jnp.float32)
    return xs, 0.1 * jnp.cumsum(xs[..., :1], axis=0)


def learner() -> etrax.OnlineLearner:
    brainstate.environ.set(precision=32)
    brainstate.random.seed(0)  # the same initial weights every time
    return etrax.compile(Net(), etrax.PPProp(0.9), jnp.zeros((B, 2), jnp.float32), batch_size=B)


def train(lrn: etrax.OnlineLearner, opt_state: Any, steps: range) -> Any:
    opt = optax.adam(1e-2)
    for k in steps:
        xs, ys = batch(k)  # hidden states and traces carry over between calls
        grads = lrn.etrace_grad(xs, ys, loss_fn)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 scalars
            updates, opt_state = opt.update(grads, opt_state, lrn.params)
            lrn.params = optax.apply_updates(lrn.params, updates)
    return opt_state


def test_a_resumed_run_continues_bit_for_bit(tmp_path: pathlib.Path) -> None:
    opt = optax.adam(1e-2)
    straight = learner()
    train(straight, opt.init(straight.params), range(STEPS))

    first = learner()
    opt_state = train(first, opt.init(first.params), range(SAVE_AT))
    first.save(tmp_path / "run.eqx", opt_state)

    resumed = learner()  # a fresh model: the graph is rebuilt, not pickled
    restored = resumed.load(tmp_path / "run.eqx", opt.init(resumed.params))
    train(resumed, restored, range(SAVE_AT, STEPS))

    for p in straight.params:
        for a, b in zip(
            jax.tree.leaves(straight.params[p]), jax.tree.leaves(resumed.params[p]), strict=True
        ):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(straight.traces), jax.tree.leaves(resumed.traces), strict=True):
        np.testing.assert_array_equal(a, b)
    # negative control: not loading gives another run
    fresh = learner()
    train(fresh, opt.init(fresh.params), range(SAVE_AT, STEPS))
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(fresh.params), jax.tree.leaves(straight.params), strict=True
        )
    )


def test_pure_checkpoint_round_trip_and_mismatch(tmp_path: pathlib.Path) -> None:
    lrn = learner()
    state = etrax.state_of(lrn.graph)
    ckpt = etrax.Checkpoint(state, lrn.traces, None)
    etrax.save_checkpoint(tmp_path / "c.eqx", ckpt)
    back = etrax.load_checkpoint(tmp_path / "c.eqx", ckpt)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ckpt), strict=True):
        np.testing.assert_array_equal(a, b)
    other = etrax.compile(Net(), etrax.DRTRL(), jnp.zeros((B, 2), jnp.float32), batch_size=B)
    like = etrax.Checkpoint(etrax.state_of(other.graph), other.traces, None)
    with pytest.raises(etrax.StepInputError, match="does not fit the template") as info:
        etrax.load_checkpoint(tmp_path / "c.eqx", like)
    assert ".." not in str(info.value)
    # a file that is not a checkpoint at all says so (and names its first bytes)
    (tmp_path / "notes.txt").write_text("not arrays")
    for path in (tmp_path / "notes.txt", str(tmp_path / "notes.txt")):
        with pytest.raises(etrax.StepInputError, match=r"not a checkpoint.*b'not ar"):
            etrax.load_checkpoint(path, ckpt)
    with pytest.raises(etrax.StepInputError, match="not a checkpoint"):
        lrn.load(tmp_path / "notes.txt")


def test_a_checkpoint_of_another_dtype_is_refused(tmp_path: pathlib.Path) -> None:
    """A float64 checkpoint does not load into a float32 template (no silent cast);
    the error names the leaf and both dtypes."""
    lrn = learner()  # float32
    ckpt = etrax.Checkpoint(etrax.state_of(lrn.graph), lrn.traces, None)
    wide = jax.tree.map(  # NumPy: this module runs JAX in float32
        lambda a: np.asarray(a, np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, ckpt
    )
    etrax.save_checkpoint(tmp_path / "c.eqx", wide)
    with pytest.raises(etrax.StepInputError, match="dtype float64 where the template"):
        etrax.load_checkpoint(tmp_path / "c.eqx", ckpt)
    etrax.save_checkpoint(tmp_path / "c.eqx", ckpt)
    etrax.load_checkpoint(tmp_path / "c.eqx", ckpt)  # the same dtypes load


def test_a_checkpoint_of_another_optimiser_is_refused(tmp_path: pathlib.Path) -> None:
    """An Adam checkpoint does not load into an SGD template (whose state is empty:
    the saved moments would be dropped without a word); a learner loading without an
    optimiser template reads the model and traces and leaves the optimiser state."""
    adam = optax.adam(1e-2)
    saved = learner()
    opt_state = train(saved, adam.init(saved.params), range(1))
    saved.save(tmp_path / "adam.eqx", opt_state)
    other = learner()
    with pytest.raises(etrax.StepInputError, match="more arrays than the template"):
        other.load(tmp_path / "adam.eqx", optax.sgd(0.1).init(other.params))
    other.load(tmp_path / "adam.eqx")  # the optimiser state is not read
    for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(saved.params), strict=True):
        np.testing.assert_array_equal(a, b)
    like = etrax.Checkpoint(etrax.state_of(other.graph), other.traces, None)
    with pytest.raises(etrax.StepInputError, match="more arrays"):
        etrax.load_checkpoint(tmp_path / "adam.eqx", like)
    etrax.load_checkpoint(tmp_path / "adam.eqx", like, partial=True)
