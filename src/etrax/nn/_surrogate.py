"""Spike functions with surrogate gradients (Heaviside forward, smooth backward)."""

import abc
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

__all__ = ["ReluGrad", "SigmoidGrad", "Surrogate", "spike"]


class Surrogate(eqx.Module):
    """The pseudo-derivative used in place of the Heaviside step's derivative."""

    @abc.abstractmethod
    def derivative(self, x: Array) -> Array:
        """``dH/dx`` surrogate at the scaled membrane distance ``x``."""


class ReluGrad(Surrogate):
    """Triangular surrogate ``α · max(0, 1 − |x| / width)``."""

    alpha: float = eqx.field(static=True, default=0.3)
    width: float = eqx.field(static=True, default=1.0)

    def derivative(self, x: Array) -> Array:
        return self.alpha * jnp.maximum(0.0, 1.0 - jnp.abs(x) / self.width)


class SigmoidGrad(Surrogate):
    """Sigmoid surrogate ``α σ(αx)(1 − σ(αx))``."""

    alpha: float = eqx.field(static=True, default=4.0)

    def derivative(self, x: Array) -> Array:
        s = jax.nn.sigmoid(self.alpha * x)
        return self.alpha * s * (1.0 - s)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _spike(x: Array, surrogate: Surrogate) -> Array:
    return (x >= 0).astype(x.dtype)


@_spike.defjvp
def _spike_jvp(
    surrogate: Surrogate, primals: tuple[Array], tangents: tuple[Array]
) -> tuple[Array, Array]:
    (x,) = primals
    (dx,) = tangents
    return _spike(x, surrogate), surrogate.derivative(x) * dx


def spike(x: ArrayLike, surrogate: Surrogate | None = None) -> Array:
    """Heaviside ``x ≥ 0`` whose derivative is `surrogate` (default `ReluGrad()`)."""
    return _spike(jnp.asarray(x), ReluGrad() if surrogate is None else surrogate)
