"""Shared type aliases used across etrax.

Everything here is a plain alias: paths identify brainstate states, variable ids
identify values inside a traced step, and the jaxtyping aliases name the array
shapes that recur in the compiler and executor.
"""

from collections.abc import Mapping
from typing import Any, TypeAlias, TypeVar

from jaxtyping import Array, Float, Shaped

__all__ = [
    "Array",
    "FloatArray",
    "Params",
    "Path",
    "PyTree",
    "Shape",
    "T",
    "VarId",
]

Path: TypeAlias = tuple[str | int, ...]
"""The key brainstate gives a state in ``model.states()``, e.g. ``('rnn', 'Wz', 'weight')``."""

VarId: TypeAlias = int
"""Stable integer id of a variable of a traced step (constvars, invars, then equation
outputs, in order). Used instead of object identity in every artifact."""

Shape: TypeAlias = tuple[int, ...]

PyTree: TypeAlias = Any
"""A JAX pytree (jaxtyping's ``PyTree`` is not usable as a mypy type)."""

Params: TypeAlias = Mapping[str, Any]
"""The static parameters of a primitive equation."""

T = TypeVar("T")

FloatArray: TypeAlias = Float[Array, "..."]
AnyArray: TypeAlias = Shaped[Array, "..."]
