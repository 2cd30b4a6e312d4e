"""Readout layers."""

import math

import brainstate
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from ..ops import matmul
from ._common import Initializer, init_param, positive_int

__all__ = ["LeakyRateReadout"]


class LeakyRateReadout(brainstate.nn.Module):
    r"""A leaky rate readout: ``r ← e^{−dt/τ} r + x · W`` (no bias).

    ``r`` is a `HiddenState`, so ``W`` is traced through time.

    **Arguments:**

    - `in_size`, `out_size`: feature sizes.
    - `tau`: time constant; `dt`: step size (same unit as `tau`).
    - `w_init`: brainstate initializer of ``W``.
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        tau: float = 5.0,
        dt: float = 1.0,
        w_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        in_size = positive_int("LeakyRateReadout: in_size", in_size)
        out_size = positive_int("LeakyRateReadout: out_size", out_size)
        if tau <= 0 or dt <= 0:
            raise ValueError(f"tau and dt must be positive, got tau={tau}, dt={dt}")
        self.in_size = (in_size,)
        self.out_size = (out_size,)
        self.decay = math.exp(-dt / tau)
        if w_init is None:
            w_init = brainstate.nn.init.KaimingNormal()
        self.weight = brainstate.ParamState(init_param(w_init, (in_size, out_size)))

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.r = brainstate.HiddenState(
            init_param(brainstate.nn.init.ZeroInit(), self.out_size, batch_size)
        )

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.r.value = init_param(brainstate.nn.init.ZeroInit(), self.out_size, batch_size)

    def update(self, x: ArrayLike) -> Array:
        r = self.decay * self.r.value + matmul(jnp.asarray(x), self.weight.value)
        self.r.value = r
        return r
