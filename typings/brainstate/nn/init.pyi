# Stub for brainstate.nn.init: covers only the surface etrax uses. Initialisers
# return a `jax.Array`, or a brainunit Quantity when given a unit, hence `Any`.

from abc import ABCMeta
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
from jaxtyping import ArrayLike

_Shape: TypeAlias = int | Sequence[int]
_SeedOrKey: TypeAlias = int | jax.Array | np.ndarray[Any, Any] | None

class Initializer(metaclass=ABCMeta):
    def __call__(self, shape: _Shape, **kwargs: Any) -> Any: ...

# `param` returns None, a scalar, an array or a Quantity depending on `parameter`.
def param(
    parameter: Any,
    sizes: _Shape,
    batch_size: int | None = None,
    allow_none: bool = True,
    allow_scalar: bool = True,
) -> Any: ...

class ZeroInit(Initializer):
    unit: Any
    def __init__(self, unit: Any = ...) -> None: ...

class Constant(Initializer):
    def __init__(self, value: ArrayLike = 1.0) -> None: ...

class Normal(Initializer):
    def __init__(
        self,
        mean: ArrayLike = 0.0,
        scale: ArrayLike = 1.0,
        unit: Any = ...,
        seed: _SeedOrKey = None,
    ) -> None: ...

class VarianceScaling(Initializer):
    def __init__(
        self,
        scale: ArrayLike,
        mode: str,
        distribution: str,
        in_axis: int = -2,
        out_axis: int = -1,
        seed: _SeedOrKey = None,
        unit: Any = ...,
    ) -> None: ...

class KaimingNormal(VarianceScaling):
    def __init__(
        self,
        scale: float = 2.0,
        mode: str = "fan_in",
        distribution: str = "truncated_normal",
        in_axis: int = -2,
        out_axis: int = -1,
        seed: _SeedOrKey = None,
        unit: Any = ...,
    ) -> None: ...

class XavierNormal(VarianceScaling):
    def __init__(
        self,
        scale: float = 1.0,
        mode: str = "fan_avg",
        distribution: str = "truncated_normal",
        in_axis: int = -2,
        out_axis: int = -1,
        seed: _SeedOrKey = None,
        unit: Any = ...,
    ) -> None: ...

class Orthogonal(Initializer):
    def __init__(
        self,
        scale: ArrayLike = 1.0,
        axis: int = -1,
        seed: _SeedOrKey = None,
        unit: Any = ...,
    ) -> None: ...
