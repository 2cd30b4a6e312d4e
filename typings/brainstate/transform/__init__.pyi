# Stub for brainstate.transform: covers only the surface etrax uses.

from ._make_jaxpr import StatefulFunction as StatefulFunction

from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

def jit(fun: Callable[_P, _R], /) -> Callable[_P, _R]: ...
