# Stub for brainstate.random (a package at runtime): covers only the surface etrax
# uses. Arguments are typed without brainunit Quantities, so results are plain
# `jax.Array`s (the runtime returns a Quantity only for Quantity inputs).

from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import ArrayLike

_SeedOrKey: TypeAlias = int | jax.Array | np.ndarray[Any, Any]
_Size: TypeAlias = int | Sequence[int]

from brainstate import State

class RandomState(State[jax.Array]):
    """A state holding a PRNG key (brainstate's global one is `DEFAULT`)."""

DEFAULT: RandomState

def seed(seed_or_key: _SeedOrKey | None = None) -> None: ...
def split_key(n: int | None = None, backup: bool = False) -> jax.Array: ...
def rand(*dn: int, key: _SeedOrKey | None = None, dtype: DTypeLike | None = None) -> jax.Array: ...
def randn(*dn: int, key: _SeedOrKey | None = None, dtype: DTypeLike | None = None) -> jax.Array: ...
def normal(
    loc: ArrayLike | None = None,
    scale: ArrayLike | None = None,
    size: _Size | None = None,
    key: _SeedOrKey | None = None,
    dtype: DTypeLike | None = None,
) -> jax.Array: ...
def uniform(
    low: ArrayLike = 0.0,
    high: ArrayLike = 1.0,
    size: _Size | None = None,
    key: _SeedOrKey | None = None,
    dtype: DTypeLike | None = None,
) -> jax.Array: ...
