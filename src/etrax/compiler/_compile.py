"""The pipeline: ``compile_etrace_graph = compose(extract, group, relate, rewrite, perturb)``."""

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import brainstate

from ._extract import extract
from ._graph import ETraceGraph
from ._group import group
from ._normalise import CompilePolicy
from ._perturb import perturb
from ._relate import relate
from ._rewrite import rewrite

__all__ = ["compile_etrace_graph", "compose"]

_P = ParamSpec("_P")
_A = TypeVar("_A")
_B = TypeVar("_B")
_C = TypeVar("_C")
_D = TypeVar("_D")
_E = TypeVar("_E")


@overload
def compose(f1: Callable[_P, _A], /) -> Callable[_P, _A]: ...
@overload
def compose(f1: Callable[_P, _A], f2: Callable[[_A], _B], /) -> Callable[_P, _B]: ...
@overload
def compose(
    f1: Callable[_P, _A], f2: Callable[[_A], _B], f3: Callable[[_B], _C], /
) -> Callable[_P, _C]: ...
@overload
def compose(
    f1: Callable[_P, _A],
    f2: Callable[[_A], _B],
    f3: Callable[[_B], _C],
    f4: Callable[[_C], _D],
    /,
) -> Callable[_P, _D]: ...
@overload
def compose(
    f1: Callable[_P, _A],
    f2: Callable[[_A], _B],
    f3: Callable[[_B], _C],
    f4: Callable[[_C], _D],
    f5: Callable[[_D], _E],
    /,
) -> Callable[_P, _E]: ...
def compose(*stages: Callable[..., Any]) -> Callable[..., Any]:
    """Chain stages: the first receives the call's arguments, each next one the
    previous result. ``compose(f, g, h)(*a) == h(g(f(*a)))``; typed for up to five
    stages, each stage's input the previous stage's output."""
    if not stages:
        raise ValueError("compose needs at least one stage")

    def composed(*args: Any, **kwargs: Any) -> Any:
        out = stages[0](*args, **kwargs)
        for stage in stages[1:]:
            out = stage(out)
        return out

    composed.__doc__ = " → ".join(getattr(s, "__name__", repr(s)) for s in stages)
    return composed


def compile_etrace_graph(
    model: brainstate.nn.Module,
    *args: Any,
    include_hidden_perturb: bool = True,
    policy: CompilePolicy | None = None,
) -> ETraceGraph:
    """Compile a model's one-step ``update`` into an `ETraceGraph`.

    Runs ``compose(extract, group, relate, rewrite, perturb)``: every stage is a pure
    function of the previous stage's frozen output and returns its diagnostics as
    data (``graph.diagnostics``, ``graph.explain()``).

    **Arguments:**

    - `model`: a `brainstate.nn.Module` with initialised states.
    - `*args`: example positional inputs of one step.
    - `include_hidden_perturb`: also build the perturbed step that yields
      ``∂L/∂h^t`` (needed by single-step online learning).
    - `policy`: a `CompilePolicy`: whether plain ``dot_general`` / convolutions on
      ParamState values are recognised as traced weight ops (fused gates split),
      whether ``lax.cond`` is if-converted, and up to how many steps ``lax.scan`` /
      ``fori_loop`` is unrolled. Defaults to ``CompilePolicy()``.

    **Returns:** the `ETraceGraph`.

    !!! Example

        ```python
        gru = etrax.nn.GRUCell(3, 4)
        brainstate.nn.init_all_states(gru)
        graph = etrax.compile_etrace_graph(gru, jnp.zeros(3))
        print(graph.report())
        ```
    """
    pipeline = compose(
        extract, group, relate, rewrite, functools.partial(perturb, enabled=include_hidden_perturb)
    )
    return pipeline(model, *args, policy=policy)
