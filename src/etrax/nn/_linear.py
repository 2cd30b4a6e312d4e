"""Linear layers whose weights are traced by etrax."""

import functools

import brainstate
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from ..ops import matmul
from ..ops._conv import shared_product
from ._common import Initializer, feature_size, init_param

__all__ = ["Linear"]


def _masked(mask: Array, w: Array) -> Array:
    return w * mask


class Linear(brainstate.nn.Module):
    """``y = x · W + b`` through the ETP op `etrax.matmul`.

    The weight and bias live in one `ParamState` at attribute ``weight`` holding
    ``{'weight': W, 'bias': b}`` (no ``'bias'`` key when ``b_init=None``).

    **Arguments:**

    - `in_size`, `out_size`: feature sizes (an int or a tuple whose last entry is used).
    - `w_init`, `b_init`: brainstate initializers; ``b_init=None`` for no bias.
    - `w_mask`: optional fixed mask multiplied into ``W`` inside the op (the trace is
      taken with respect to the raw ``W``).

    Inputs with three to five axes, ``(batch, *positions, in)`` with one to three
    position axes sharing the weight, go through a width-1 `etrax.conv`, so their
    positions line up with a hidden state of shape ``(batch, *positions, out)`` and
    the weight is traced into it. Inputs with more axes are flattened to ``(rows,
    in)`` around `etrax.matmul`; such a use is not traced into a hidden state of the
    input's shape (reported as ``relation_excluded_shape_mismatch``; the weight
    learns from its exact instantaneous gradient).
    """

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        w_mask: ArrayLike | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        n_in = feature_size("Linear: in_size", in_size)
        n_out = feature_size("Linear: out_size", out_size)
        self.in_size = (n_in,)
        self.out_size = (n_out,)
        if w_init is None:
            w_init = brainstate.nn.init.KaimingNormal()
        params = {"weight": init_param(w_init, (n_in, n_out))}
        if b_init is not None:
            if isinstance(b_init, str) and b_init == "zeros":
                b_init = brainstate.nn.init.ZeroInit()
            params["bias"] = init_param(b_init, (n_out,))
        self.weight = brainstate.ParamState(params)
        self._weight_fn = None
        self._kernel_fns: dict[int, functools.partial[Array]] = {}
        if w_mask is not None:
            mask = jnp.asarray(w_mask)
            if mask.shape != (n_in, n_out):
                raise ValueError(f"w_mask must have shape {(n_in, n_out)}, got {mask.shape}")
            self._weight_fn = functools.partial(_masked, mask)
            # the same mask for the width-1 convolution's kernel, one per position count
            self._kernel_fns = {
                k: functools.partial(_masked, mask.reshape((1,) * k + mask.shape))
                for k in (1, 2, 3)
            }

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        params = self.weight.value
        bias = params.get("bias")
        if x.ndim <= 2:
            return matmul(x, params["weight"], bias, weight_fn=self._weight_fn)
        if x.ndim <= 5:  # (batch, *positions, in): traced per position
            kernel_fn = self._kernel_fns.get(x.ndim - 2)
            return shared_product(x, params["weight"], bias, kernel_fn=kernel_fn)
        lead = x.shape[:-1]
        y = matmul(x.reshape(-1, x.shape[-1]), params["weight"], bias, weight_fn=self._weight_fn)
        return y.reshape(*lead, y.shape[-1])
