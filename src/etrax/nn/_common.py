"""Helpers shared by the layers."""

from collections.abc import Callable
from typing import Any, TypeAlias

import brainstate
import jax
from jaxtyping import Array

__all__ = ["Activation", "Initializer", "init_param", "resolve_activation"]

Activation: TypeAlias = str | Callable[[Array], Array]
Initializer: TypeAlias = Any
"""A brainstate initializer (e.g. ``brainstate.nn.init.KaimingNormal()``) or an array."""


def resolve_activation(activation: Activation) -> Callable[[Array], Array]:
    """A callable activation from a name in `jax.nn` / `jax.numpy` or a callable."""
    if callable(activation):
        return activation
    if isinstance(activation, str):
        for namespace in (jax.nn, jax.numpy):
            fn = getattr(namespace, activation, None)
            if callable(fn):
                return fn  # type: ignore[no-any-return]
        raise ValueError(
            f"unknown activation {activation!r}; use a name from jax.nn (e.g. 'tanh', 'relu', "
            "'sigmoid') or pass a callable"
        )
    raise TypeError(f"activation must be a string or a callable, got {type(activation).__name__}")


def init_param(
    initializer: Initializer, shape: tuple[int, ...], batch_size: int | None = None
) -> Array:
    """Create an array from a brainstate initializer (or an array) with an optional batch axis."""
    return brainstate.nn.init.param(initializer, shape, batch_size)  # type: ignore[no-any-return]
