"""Helpers shared by the built-in ETP ops."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array

__all__ = ["chain_transform", "check_transform", "sum_leading"]


def chain_transform(fn: Callable[[Array], Array] | None, raw: Array, grad: Array) -> Array:
    """Pull a gradient with respect to ``fn(raw)`` back to ``raw`` (identity if `fn` is None)."""
    if fn is None:
        return grad
    _, vjp = jax.vjp(fn, raw)
    (out,) = vjp(grad.astype(raw.dtype))
    result: Array = out
    return result


def sum_leading(value: Array, keep: int) -> Array:
    """Sum all but the last `keep` axes."""
    extra = value.ndim - keep
    if extra <= 0:
        return value
    return jnp.sum(value, axis=tuple(range(extra)))


def check_transform(name: str, fn: object) -> None:
    """Validate a ``weight_fn``/``bias_fn`` argument."""
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}.")
