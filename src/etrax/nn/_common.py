"""Helpers shared by the layers."""

import numbers
from collections.abc import Callable
from typing import Any, TypeAlias

import brainstate
import brainunit as u
import jax
import numpy as np
from jaxtyping import Array

__all__ = [
    "Activation",
    "Initializer",
    "feature_size",
    "init_param",
    "positive_int",
    "resolve_activation",
]

Activation: TypeAlias = str | Callable[[Array], Array]
Initializer: TypeAlias = Any
"""A brainstate initializer (e.g. ``brainstate.nn.init.KaimingNormal()``) or an array."""


def positive_int(name: str, value: object) -> int:
    """`value` as a positive Python int (NumPy integers accepted): a layer's size. A
    `TypeError` for anything but an integer (a float, a string, a bool), a `ValueError`
    for zero or less, each naming the argument."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    n = int(value)
    if n < 1:
        raise ValueError(f"{name} must be a positive int, got {n}")
    return n


def feature_size(name: str, value: object) -> int:
    """A feature size given as an int or, as brainstate's layers take it, a tuple whose
    last entry is the size."""
    if isinstance(value, tuple | list):
        if not value:
            raise ValueError(f"{name} must be a positive int or a non-empty tuple, got {value!r}")
        return positive_int(f"{name}[-1]", value[-1])
    return positive_int(name, value)


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
    """Create an array from a brainstate initializer (or an array) with an optional batch axis.

    Unitless zeros (brainstate's `ZeroInit`, the default of every hidden state) are
    made in NumPy and placed with `jax.device_put`: JAX's eager ``zeros`` (and
    ``jnp.asarray`` of a NumPy array) compile an XLA program for each new shape, about
    50 ms of a model's first call per state shape."""
    if type(initializer) is brainstate.nn.init.ZeroInit and initializer.unit == u.UNITLESS:
        full = shape if batch_size is None else (batch_size, *shape)
        zeros: Array = jax.device_put(np.zeros(full, brainstate.environ.dftype()))
        return zeros
    return brainstate.nn.init.param(initializer, shape, batch_size)  # type: ignore[no-any-return]
