"""Building blocks shared by the built-in ops (batching, validation)."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._compat import bind

__all__ = ["x_batch_rule"]


def x_batch_rule(
    get_prim: Callable[[], Any], impl: Callable[..., Array], max_x_ndim: int
) -> Callable[..., tuple[Array, int]]:
    """A batching rule that keeps an op an ETP primitive when only ``x`` (operand 0)
    is mapped: the mapped axis becomes the op's leading batch axis (several mapped
    axes are folded into one). Anything else falls back to ``jax.vmap(impl)``."""

    def rule(
        args: tuple[Array, ...], dims: tuple[int | None, ...], **params: Any
    ) -> tuple[Array, int]:
        x, *rest = args
        x_dim, *rest_dims = dims
        if x_dim is not None and all(d is None for d in rest_dims):
            x = jnp.moveaxis(x, x_dim, 0)
            if x.ndim <= max_x_ndim:
                return bind(get_prim(), x, *rest, **params), 0
            core = max_x_ndim - 1
            lead = x.shape[: x.ndim - core]
            y = bind(get_prim(), x.reshape(-1, *x.shape[x.ndim - core :]), *rest, **params)
            return y.reshape(*lead, *y.shape[1:]), 0
        out = jax.vmap(lambda *ops: impl(*ops, **params), in_axes=dims)(*args)
        return out, 0

    return rule
