"""Spiking neurons: leaky integrate-and-fire with soft reset, with and without adaptation."""

import math

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from ._common import init_param, positive_int
from ._surrogate import ReluGrad, Surrogate, spike

__all__ = ["ALIF", "LIF"]


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} must be positive, got {v}")


def _shape_of(size: int | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(size, tuple | list):
        if not size:
            raise ValueError("size must be a positive int or a tuple of positive ints, got ()")
        return tuple(positive_int(f"size[{i}]", n) for i, n in enumerate(size))
    return (positive_int("size", size),)


class _Leaky(brainstate.nn.Module):
    """Shared plumbing of `LIF` and `ALIF` (not public): validation, the membrane
    update with soft reset, and the resting state."""

    def __init__(
        self,
        size: int | tuple[int, ...],
        tau: float,
        dt: float,
        R: float | None,
        v_th: float,
        v_reset: float,
        surrogate: Surrogate | None,
        detach_reset: bool,
        name: str | None,
    ) -> None:
        super().__init__(name=name)
        _check_positive(tau=tau, dt=dt)
        if not v_th > v_reset:
            raise ValueError(f"v_th ({v_th}) must be above v_reset ({v_reset})")
        self.size = _shape_of(size)
        self.in_size = self.size
        self.out_size = self.size
        self.alpha = math.exp(-dt / tau)
        # default: the current enters unscaled (R = 1/(1 − α)), so inputs of unit scale
        # drive the membrane across a unit threshold
        self.R = 1.0 / (1.0 - self.alpha) if R is None else R
        self.v_th = v_th
        self.v_reset = v_reset
        self.surrogate = ReluGrad() if surrogate is None else surrogate
        self.detach_reset = detach_reset

    def _zeros(self, batch_size: int | None) -> Array:
        return init_param(brainstate.nn.init.ZeroInit(), self.size, batch_size)

    def _rest(self, batch_size: int | None) -> Array:
        """The membrane at ``v_reset``, filled on the host: an eager ``zeros + v_reset``
        would compile an XLA program of its own."""
        zero = self._zeros(batch_size)
        rest: Array = jax.device_put(np.full(zero.shape, self.v_reset, zero.dtype))
        return rest

    def _last(self, s: Array) -> Array:
        """The previous step's spikes as the reset term sees them."""
        return jax.lax.stop_gradient(s) if self.detach_reset else s

    def _integrate(self, v: Array, current: ArrayLike, last: Array) -> Array:
        return (
            self.alpha * v
            + (1.0 - self.alpha) * self.R * jnp.asarray(current)
            - (self.v_th - self.v_reset) * last
        )


class LIF(_Leaky):
    r"""Leaky integrate-and-fire neurons with soft reset.

    ``V ← α V + (1 − α) R I − (V_th − V_reset) s^{t−1}``, ``s^t = H((V − V_th)/(V_th − V_reset))``
    with ``α = e^{−dt/τ}`` and ``H`` a Heaviside step with a surrogate derivative.
    ``update(I)`` returns the spikes ``s^t``; the membrane ``V`` is the hidden state.

    **Arguments:**

    - `size`: number of neurons, or the per-sample shape of the population (e.g.
        ``(positions, channels)`` behind a convolution).
    - `tau`, `dt`: membrane time constant and step (same unit).
    - `R`: the resistance. The input current is scaled by ``(1 − α) R`` with
      ``α = e^{−dt/τ}``; the default ``R = 1/(1 − α)`` adds the current unscaled, so
      a layer fed by a default `etrax.nn.Linear` on inputs of unit scale spikes. A
      classic LIF's ``R = 1`` scales it by ``1 − e^{−dt/τ}`` (``≈ dt/τ``): then the
      input weights must be about ``τ/dt`` times larger, or the layer stays silent.
    - `v_th`, `v_reset`: threshold and reset potential.
    - `surrogate`: the spike's pseudo-derivative (default `ReluGrad()`).
    - `detach_reset`: stop gradients through the reset term.
    """

    def __init__(
        self,
        size: int | tuple[int, ...],
        tau: float = 20.0,
        dt: float = 1.0,
        R: float | None = None,
        v_th: float = 1.0,
        v_reset: float = 0.0,
        surrogate: Surrogate | None = None,
        detach_reset: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(size, tau, dt, R, v_th, v_reset, surrogate, detach_reset, name)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.V = brainstate.HiddenState(self._rest(batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.V.value = self._rest(batch_size)

    def _spike(self, v: Array) -> Array:
        return spike((v - self.v_th) / (self.v_th - self.v_reset), self.surrogate)

    def update(self, current: ArrayLike) -> Array:
        v = self.V.value
        v = self._integrate(v, current, self._last(self._spike(v)))
        self.V.value = v
        return self._spike(v)


class ALIF(_Leaky):
    r"""Adaptive leaky integrate-and-fire neurons (membrane ``V``, adaptation ``a``).

    ``V ← α V + (1 − α) R I − (V_th − V_reset) s^{t−1}``, ``a ← ρ a + s^{t−1}``,
    ``s^t = H((V − V_th − β a)/(V_th − V_reset))`` with ``ρ = e^{−dt/τ_a}``. ``V`` and
    ``a`` form one hidden group with two states per neuron. Arguments as `LIF`, plus
    `tau_a` (adaptation time constant) and `beta` (adaptation strength).
    """

    def __init__(
        self,
        size: int | tuple[int, ...],
        tau: float = 20.0,
        tau_a: float = 200.0,
        beta: float = 0.1,
        dt: float = 1.0,
        R: float | None = None,
        v_th: float = 1.0,
        v_reset: float = 0.0,
        surrogate: Surrogate | None = None,
        detach_reset: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(size, tau, dt, R, v_th, v_reset, surrogate, detach_reset, name)
        _check_positive(tau_a=tau_a)
        self.rho = math.exp(-dt / tau_a)
        self.beta = beta

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.V = brainstate.HiddenState(self._rest(batch_size))
        self.a = brainstate.HiddenState(self._zeros(batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.V.value = self._rest(batch_size)
        self.a.value = self._zeros(batch_size)

    def _spike(self, v: Array, a: Array) -> Array:
        return spike((v - self.v_th - self.beta * a) / (self.v_th - self.v_reset), self.surrogate)

    def update(self, current: ArrayLike) -> Array:
        v = self.V.value
        a = self.a.value
        last = self._last(self._spike(v, a))
        v = self._integrate(v, current, last)
        a = self.rho * a + last
        self.V.value = v
        self.a.value = a
        return self._spike(v, a)
