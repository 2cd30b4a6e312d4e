# Stub for brainstate 0.5.x: covers only the surface etrax (src, tests, examples,
# benchmarks) uses. brainstate ships py.typed, but its own annotations are
# incomplete (untyped methods, `Module.__init__` hidden from type checkers), so
# this stub package replaces them for mypy. Add names here as etrax needs them.

from abc import ABCMeta
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeAlias, TypeVar

import jax
import numpy as np
from jaxtyping import ArrayLike

from . import environ as environ
from . import nn as nn
from . import random as random
from . import transform as transform

__version__: str

_A = TypeVar("_A")
# The array types a `HiddenState` accepts at runtime (brainunit Quantities are
# accepted too, but etrax does not use units).
_Arr = TypeVar("_Arr", bound=jax.Array | np.ndarray[Any, Any])

_Item: TypeAlias = int | str

class State(Generic[_A], metaclass=ABCMeta):
    """A mutable reference to a pytree value `_A`, tracked by brainstate transforms."""

    tag: set[str] | None
    def __init__(self, value: _A, name: str | None = None, **metadata: Any) -> None: ...
    @property
    def name(self) -> str | None: ...
    @name.setter
    def name(self, name: str) -> None: ...
    @property
    def value(self) -> _A: ...
    @value.setter
    def value(self, v: _A) -> None: ...
    def restore_value(self, v: _A) -> None: ...
    def numel(self) -> int: ...
    def __hash__(self) -> int: ...

class ShortTermState(State[_A]): ...
class LongTermState(State[_A]): ...
class ParamState(LongTermState[_A]): ...

class HiddenState(ShortTermState[_Arr]):
    """A single-array hidden state (the runtime rejects non-array values)."""

    def __init__(self, value: _Arr, name: str | None = None, **kwargs: Any) -> None: ...
    @property
    def varshape(self) -> tuple[int, ...]: ...
    @property
    def num_state(self) -> int: ...

class HiddenGroupState(HiddenState[_Arr]):
    """Several hidden states stacked on the value's last axis."""

    name2index: dict[str, int]
    def __init__(self, value: _Arr, **kwargs: Any) -> None: ...
    def get_value(self, item: _Item) -> _Arr: ...
    def set_value(self, val: Mapping[_Item, ArrayLike] | Sequence[ArrayLike]) -> None: ...

class HiddenTreeState(HiddenGroupState[jax.Array]):
    """Named hidden states given as a dict or sequence, stored stacked on the last axis."""

    def __init__(
        self, value: Mapping[str, ArrayLike] | Sequence[ArrayLike], **kwargs: Any
    ) -> None: ...
    def get_value(self, item: _Item) -> jax.Array: ...
