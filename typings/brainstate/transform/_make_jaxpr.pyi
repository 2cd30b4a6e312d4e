# Stub for brainstate.transform._make_jaxpr: covers only the surface etrax uses
# (`StatefulFunction`, which traces a function that reads and writes States).

from abc import ABCMeta
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple, Self

from brainstate import State
from jax.extend.core import ClosedJaxpr

class CacheKey(NamedTuple):
    static_args: tuple[Any, ...]
    dyn_args: tuple[Any, ...]
    static_kwargs: tuple[Any, ...]
    dyn_kwargs: tuple[Any, ...]

class StatefulFunction(metaclass=ABCMeta):
    fun: Callable[..., Any]
    return_only_write: bool
    def __init__(
        self,
        fun: Callable[..., Any],
        static_argnums: int | Iterable[int] = (),
        static_argnames: str | Iterable[str] = (),
        axis_env: Sequence[tuple[Hashable, int]] | None = None,
        name: str | None = None,
        return_only_write: bool = True,
        ir_optimizations: str | Sequence[str] | None = None,
    ) -> None: ...
    def make_jaxpr(self, *args: Any, **kwargs: Any) -> Self: ...
    def get_arg_cache_key(
        self, *args: Any, compile_if_miss: bool = False, **kwargs: Any
    ) -> CacheKey: ...
    def get_jaxpr_by_cache(self, cache_key: Hashable) -> ClosedJaxpr: ...
    def get_jaxpr(self, *args: Any, compile_if_miss: bool = True, **kwargs: Any) -> ClosedJaxpr: ...
    # ``(output ShapeDtypeStructs, state-value ShapeDtypeStructs)``, both pytrees.
    def get_out_shapes_by_cache(self, cache_key: Hashable) -> tuple[Any, Any]: ...
    def get_out_shapes(
        self, *args: Any, compile_if_miss: bool = True, **kwargs: Any
    ) -> tuple[Any, Any]: ...
    def get_states_by_cache(self, cache_key: Hashable) -> tuple[State[Any], ...]: ...
    def get_states(
        self, *args: Any, compile_if_miss: bool = True, **kwargs: Any
    ) -> tuple[State[Any], ...]: ...
    def get_read_states_by_cache(self, cache_key: Hashable) -> tuple[State[Any], ...]: ...
    def get_write_states_by_cache(self, cache_key: Hashable) -> tuple[State[Any], ...]: ...
    def get_write_states(
        self, *args: Any, compile_if_miss: bool = True, **kwargs: Any
    ) -> tuple[State[Any], ...]: ...
    # Returns ``(new state values, output)``.
    def jaxpr_call(
        self, state_vals: Sequence[Any], *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]: ...
    def clear_cache(self) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
