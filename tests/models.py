"""The model catalogue shared by the tests.

Each entry builds an initialised brainstate model and an example input. Models
flagged ``diagonal`` have a truly position-diagonal recurrence (no recurrent
weight), so the whole one-step Jacobian is block diagonal and equals the
compiler's ``D`` exactly.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

import etrax

__all__ = ["CATALOGUE", "ModelCase", "build"]


def _w(key: int, shape: tuple[int, ...], scale: float = 0.5) -> Array:
    return scale * jax.random.normal(
        jax.random.PRNGKey(key), shape, dtype=brainstate.environ.dftype()
    )


class LeakyLinear(brainstate.nn.Module):
    """``h ← 0.5 h + x W + b``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = etrax.nn.Linear(n_in, n_out)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n_out,) if batch_size is None else (batch_size, self.n_out)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        h = 0.5 * self.h.value + self.fc(x)
        self.h.value = h
        return h


class LeakyTanh(brainstate.nn.Module):
    """``h ← α ⊙ h + tanh(x W + b)`` with a fixed per-unit leak ``α``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = etrax.nn.Linear(n_in, n_out)
        self.alpha = jnp.linspace(0.5, 0.95, n_out, dtype=brainstate.environ.dftype())

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n_out,) if batch_size is None else (batch_size, self.n_out)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        h = self.alpha * self.h.value + jnp.tanh(self.fc(x))
        self.h.value = h
        return h


class TwoStateNeuron(brainstate.nn.Module):
    """A leaky neuron with adaptation: ``V ← αV − βa + x W``; ``a ← ρa + γ·tanh(V_new)``.

    ``a`` reads the *new* ``V`` within the step; both form one group with S = 2.
    """

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = etrax.nn.Linear(n_in, n_out)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n_out,) if batch_size is None else (batch_size, self.n_out)
        self.V = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))
        self.a = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        v = 0.9 * self.V.value - 0.2 * self.a.value + self.fc(x)
        a = 0.8 * self.a.value + 0.3 * jnp.tanh(v)
        self.V.value = v
        self.a.value = a
        return v


class StackedStateNeuron(brainstate.nn.Module):
    """The two-state neuron stored as one ``HiddenGroupState`` ``(..., n, 2)``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = etrax.nn.Linear(n_in, n_out)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n_out, 2) if batch_size is None else (batch_size, self.n_out, 2)
        self.st = brainstate.HiddenGroupState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        st = self.st.value
        v_old, a_old = st[..., 0], st[..., 1]
        v = 0.9 * v_old - 0.2 * a_old + self.fc(x)
        a = 0.8 * a_old + 0.3 * jnp.tanh(v)
        self.st.value = jnp.stack([v, a], axis=-1)
        return v


class LeakyFeedForwardStack(brainstate.nn.Module):
    """Two leaky tanh layers; layer 2 reads layer 1's new state through a weight."""

    def __init__(self, n_in: int, n_hid: int, n_out: int) -> None:
        super().__init__()
        self.l1 = LeakyTanh(n_in, n_hid)
        self.l2 = LeakyTanh(n_hid, n_out)
        self.readout = etrax.nn.Linear(n_out, 2)

    def update(self, x: ArrayLike) -> Array:
        return self.readout(self.l2(self.l1(x)))


class ElementwiseDecay(brainstate.nn.Module):
    """``h ← σ(τ) ⊙ h + x W`` with a learnable per-unit decay via `element_wise`."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = etrax.nn.Linear(n_in, n_out)
        self.tau = brainstate.ParamState(_w(7, (n_out,)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n_out,) if batch_size is None else (batch_size, self.n_out)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        decay = etrax.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        h = decay * self.h.value + self.fc(x)
        self.h.value = h
        return h


class MeanMixing(brainstate.nn.Module):
    """Position-mixing transition: ``h ← 0.9 h − 0.3 mean(h) + x W``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = etrax.nn.Linear(n_in, n_out)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((self.n_out,), brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        new = 0.9 * h - 0.3 * jnp.mean(h) * jnp.tanh(h) + self.fc(x)
        self.h.value = new
        return new


class RollMixing(brainstate.nn.Module):
    """Position-mixing transition and tail: ``h ← 0.5 roll(h) + roll(x W)``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = etrax.nn.Linear(n_in, n_out)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((self.n_out,), brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        new = 0.5 * jnp.roll(self.h.value, 1) + jnp.roll(jnp.tanh(self.fc(x)), 1)
        self.h.value = new
        return new


class StackedGRU(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = etrax.nn.GRUCell(3, 4)
        self.l2 = etrax.nn.GRUCell(4, 5)
        self.out = etrax.nn.Linear(5, 2)

    def update(self, x: ArrayLike) -> Array:
        return self.out(self.l2(self.l1(x)))


class TanhRNN(brainstate.nn.Module):
    """``h ← tanh(x W_in + h U + b)``: the recurrence runs through a traced weight."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.win = etrax.nn.Linear(n_in, n_out)
        self.rec = etrax.nn.Linear(n_out, n_out, b_init=None)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (self.n_out,) if batch_size is None else (batch_size, self.n_out)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        h = jnp.tanh(self.win(x) + self.rec(self.h.value))
        self.h.value = h
        return h


class SpikingFF(brainstate.nn.Module):
    """``Linear → LIF/ALIF`` driven by feed-forward input (diagonal recurrence)."""

    def __init__(self, n_in: int, n_out: int, adaptive: bool = False) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(n_in, n_out, w_init=brainstate.nn.init.KaimingNormal(scale=8.0))
        self.neu: brainstate.nn.Module = (
            etrax.nn.ALIF(n_out, tau=10.0, tau_a=50.0, beta=0.5)
            if adaptive
            else etrax.nn.LIF(n_out, tau=10.0)
        )

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.neu(self.fc(x))
        return out


class LeakyTanhReadout(brainstate.nn.Module):
    """A leaky tanh layer followed by a linear readout (a non-temporal weight)."""

    def __init__(self, n_in: int, n_hid: int) -> None:
        super().__init__()
        self.rnn = LeakyTanh(n_in, n_hid)
        self.readout = etrax.nn.Linear(n_hid, 2)

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.readout(self.rnn(x))
        return out


@dataclass(frozen=True)
class ModelCase:
    """One catalogue entry: ``make()`` returns an initialised model and an input."""

    name: str
    make: Callable[[], tuple[brainstate.nn.Module, Any]]
    diagonal: bool
    """Whether every group's transition is truly position-diagonal (D equals the
    exact Jacobian's block diagonal)."""
    exact_online: bool = False
    """Whether the whole step's recurrence is diagonal (no weight between hidden
    values across steps), so D-RTRL equals BPTT."""


def build(
    cls: Callable[..., brainstate.nn.Module], *args: Any, batch: int | None = None, n_in: int = 3
) -> tuple[brainstate.nn.Module, Any]:
    brainstate.random.seed(0)  # the same weights whatever ran before in this process
    model = cls(*args)
    brainstate.nn.init_all_states(model, batch_size=batch)
    x_shape = (n_in,) if batch is None else (batch, n_in)
    x = jax.random.normal(jax.random.PRNGKey(0), x_shape, dtype=brainstate.environ.dftype())
    return model, x


CATALOGUE: tuple[ModelCase, ...] = (
    ModelCase("leaky_linear", lambda: build(LeakyLinear, 3, 4), True, True),
    ModelCase("leaky_linear_b2", lambda: build(LeakyLinear, 3, 4, batch=2), True, True),
    ModelCase("leaky_tanh", lambda: build(LeakyTanh, 3, 5), True, True),
    ModelCase("leaky_tanh_readout", lambda: build(LeakyTanhReadout, 3, 5), True, True),
    ModelCase("two_state", lambda: build(TwoStateNeuron, 3, 4), True, True),
    ModelCase("two_state_b2", lambda: build(TwoStateNeuron, 3, 4, batch=2), True, True),
    ModelCase("stacked_state", lambda: build(StackedStateNeuron, 3, 4), True, True),
    ModelCase("ff_stack", lambda: build(LeakyFeedForwardStack, 3, 4, 5), True),
    ModelCase("elementwise_decay_b2", lambda: build(ElementwiseDecay, 3, 4, batch=2), True, True),
    ModelCase("lif_ff", lambda: build(SpikingFF, 3, 5), True, True),
    ModelCase("alif_ff_b2", lambda: build(SpikingFF, 3, 5, True, batch=2), True, True),
    ModelCase("gru", lambda: build(etrax.nn.GRUCell, 3, 4), False),
    ModelCase("gru_b2", lambda: build(etrax.nn.GRUCell, 3, 4, batch=2), False),
    ModelCase("lstm", lambda: build(etrax.nn.LSTMCell, 3, 4), False),
    ModelCase("mgu", lambda: build(etrax.nn.MGUCell, 3, 4), False),
    ModelCase("minigru", lambda: build(etrax.nn.MiniGRU, 3, 4), False),
    ModelCase("vanilla", lambda: build(etrax.nn.ValinaRNNCell, 3, 4), False),
    ModelCase("stacked_gru", lambda: build(StackedGRU), False),
    ModelCase("tanh_rnn", lambda: build(TanhRNN, 3, 4), False),
)
