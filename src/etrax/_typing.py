"""Shared type aliases used across etrax.

Everything here is a plain alias: paths identify brainstate states, variable ids
identify values inside a traced step, and the jaxtyping aliases name the array
shapes that recur in the compiler and executor.
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from jaxtyping import Array, Float, Shaped

__all__ = [
    "Array",
    "ArrayTree",
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

if TYPE_CHECKING:
    ArrayTree: TypeAlias = Array | Sequence["ArrayTree"] | Mapping[str, "ArrayTree"] | None
else:
    ArrayTree = Any  # the runtime checker does not walk recursive aliases
"""The values etrax hands back: an array, or tuples, lists and string-keyed dicts of
them (a parameter's ``{'weight': W, 'bias': b}``, a model's outputs). A precise type
for user code (no ``Any``): narrow it with ``isinstance(v, jax.Array)`` or index it."""

Params: TypeAlias = Mapping[str, Any]
"""The static parameters of a primitive equation."""

T = TypeVar("T")

FloatArray: TypeAlias = Float[Array, "..."]
AnyArray: TypeAlias = Shaped[Array, "..."]
