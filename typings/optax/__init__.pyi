# Stub for optax: covers only the surface etrax's demo and tests use.
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

Params = Any
Updates = Any
OptState = Any

class _Init(Protocol):
    def __call__(self, params: Params) -> OptState: ...

class _Update(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = ...
    ) -> tuple[Updates, OptState]: ...

class GradientTransformation(NamedTuple):
    init: _Init
    update: _Update

def adam(
    learning_rate: float | Callable[[Any], Any],
    b1: float = ...,
    b2: float = ...,
    eps: float = ...,
) -> GradientTransformation: ...
def sgd(
    learning_rate: float | Callable[[Any], Any], momentum: float | None = ...
) -> GradientTransformation: ...
def clip_by_global_norm(max_norm: float) -> GradientTransformation: ...
def chain(*transforms: GradientTransformation) -> GradientTransformation: ...
def apply_updates(params: Params, updates: Updates) -> Params: ...
