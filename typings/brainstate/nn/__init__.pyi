# Stub for brainstate.nn: covers only the surface etrax uses (the `Module` base
# class, the collective state initialisers and the `init` submodule).

from abc import ABCMeta
from collections.abc import Callable, Iterator, Sequence
from types import EllipsisType
from typing import Any, ParamSpec, Protocol, TypeAlias, TypeVar, overload

from brainstate import ParamState, State

from . import init as init

_T = TypeVar("_T")
_S = TypeVar("_S", bound=State[Any])
_N = TypeVar("_N", bound=Module)
_P = ParamSpec("_P")
_R_co = TypeVar("_R_co", covariant=True)

# Paths are tuples of attribute names, sequence indices and dict keys.
_PathParts: TypeAlias = tuple[Any, ...]
_FilterLiteral: TypeAlias = (
    type | str | Callable[[_PathParts, Any], bool] | bool | EllipsisType | None
)
_Filter: TypeAlias = _FilterLiteral | tuple[_Filter, ...] | list[_Filter]
_Hierarchy: TypeAlias = tuple[int, int]

class _Updates(Protocol[_P, _R_co]):
    def update(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...

class Module(metaclass=ABCMeta):  # runtime metaclass: GraphNodeMeta(ABCMeta)
    """A graph node whose `update` performs one step; calling it calls `update`."""

    def __init__(self, name: str | None = None) -> None: ...
    @property
    def name(self) -> str | None: ...
    # The getters return what the setters stored, normalised to a tuple.
    @property
    def in_size(self) -> tuple[int, ...]: ...
    @in_size.setter
    def in_size(self, in_size: Sequence[int] | int) -> None: ...
    @property
    def out_size(self) -> tuple[int, ...]: ...
    @out_size.setter
    def out_size(self, out_size: Sequence[int] | int) -> None: ...
    def update(self, *args: Any, **kwargs: Any) -> Any: ...
    # `__call__` forwards to `update`, so a call takes `update`'s signature.
    def __call__(self: _Updates[_P, _R_co], *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...
    def init_state(self, *args: Any, **kwargs: Any) -> None: ...
    def reset_state(self, *args: Any, **kwargs: Any) -> None: ...
    # Returns the `NewStateCatcher` of the states it created (not stubbed).
    def init_all_states(self, *args: Any, state_tag: str | None = None, **kwargs: Any) -> Any: ...
    # With no filter or one filter, one mapping; with several, one mapping per filter.
    @overload
    def states(self, *, allowed_hierarchy: _Hierarchy = ...) -> dict[_PathParts, State[Any]]: ...
    @overload
    def states(
        self, filter: type[_S], /, *, allowed_hierarchy: _Hierarchy = ...
    ) -> dict[_PathParts, _S]: ...
    @overload
    def states(
        self, filter: _Filter, /, *, allowed_hierarchy: _Hierarchy = ...
    ) -> dict[_PathParts, State[Any]]: ...
    @overload
    def states(
        self,
        filter1: _Filter,
        filter2: _Filter,
        /,
        *filters: _Filter,
        allowed_hierarchy: _Hierarchy = ...,
    ) -> tuple[dict[_PathParts, State[Any]], ...]: ...
    @overload
    def nodes(self, *, allowed_hierarchy: _Hierarchy = ...) -> dict[_PathParts, Any]: ...
    @overload
    def nodes(
        self, filter: type[_N], /, *, allowed_hierarchy: _Hierarchy = ...
    ) -> dict[_PathParts, _N]: ...
    @overload
    def nodes(
        self, filter: _Filter, /, *, allowed_hierarchy: _Hierarchy = ...
    ) -> dict[_PathParts, Any]: ...
    @overload
    def nodes(
        self,
        filter1: _Filter,
        filter2: _Filter,
        /,
        *filters: _Filter,
        allowed_hierarchy: _Hierarchy = ...,
    ) -> tuple[dict[_PathParts, Any], ...]: ...
    def children(self) -> Iterator[Module]: ...
    def modules(self, include_self: bool = True) -> Iterator[Module]: ...
    def parameters(self, recurse: bool = True) -> Iterator[ParamState[Any]]: ...

def init_all_states(
    target: _T, *init_args: Any, node_to_exclude: _Filter = None, **init_kwargs: Any
) -> _T: ...
def reset_all_states(
    target: _T, *reset_args: Any, node_to_exclude: _Filter = None, **reset_kwargs: Any
) -> _T: ...
