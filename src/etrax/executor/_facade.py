"""brainstate-facing executors: thin facades over the pure step.

They read the model's current state values, call the pure functions of
`etrax.executor`, and write new hidden and other values back into the model's
states. All computation happens in the pure core.
"""

import abc
from typing import Any

import brainstate
import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import StepInputError
from .._typing import Path, PyTree
from ..compiler import CompilationReport, ETraceGraph, compile_etrace_graph
from ._state import state_of, write_back
from ._step import Pullback, StepJacobians, multi_step, step, step_vjp

__all__ = ["ETraceGraphExecutor", "ETraceVjpGraphExecutor", "MultiStepData"]


class MultiStepData(eqx.Module):
    """Marks an input that carries a leading time axis (one slice per step)."""

    data: PyTree


def _has_multi(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, MultiStepData) for a in args)


def _first_step(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        jax.tree.map(lambda v: v[0], a.data) if isinstance(a, MultiStepData) else a for a in args
    )


def _pack(args: tuple[Any, ...]) -> Any:
    return args[0] if len(args) == 1 else args


class _Executor(abc.ABC):
    """Shared implementation of the two executors (not public)."""

    def __init__(self, model: brainstate.nn.Module) -> None:
        if not isinstance(model, brainstate.nn.Module):
            raise TypeError(
                f"{type(self).__name__} expects a brainstate.nn.Module, got {type(model).__name__}"
            )
        self.model = model
        self._graph: ETraceGraph | None = None

    @property
    @abc.abstractmethod
    def include_hidden_perturb(self) -> bool:
        """Whether the compiled graph carries the hidden perturbation."""

    def compile_graph(self, *args: Any) -> ETraceGraph:
        """Compile the model's step on example inputs (`MultiStepData` uses step 0)."""
        self._graph = compile_etrace_graph(
            self.model, *_first_step(args), include_hidden_perturb=self.include_hidden_perturb
        )
        return self._graph

    @property
    def graph(self) -> ETraceGraph:
        """The compiled `ETraceGraph`."""
        if self._graph is None:
            raise ValueError(
                f"The graph is not compiled yet: call {type(self).__name__}.compile_graph(*args) "
                "with example inputs first."
            )
        return self._graph

    @property
    def path_to_states(self) -> dict[Path, brainstate.State[Any]]:
        """``path → brainstate State`` of every state the compiled step uses."""
        mi = self.graph.module_info
        return {s.path: ref for s, ref in zip(mi.states, mi.state_refs.states, strict=True)}

    @property
    def states(self) -> dict[Path, brainstate.State[Any]]:
        """The model's `brainstate.State` objects by path."""
        return self.path_to_states

    def show_graph(self, verbose: bool = True, return_msg: bool = False) -> str | None:
        """Print (if `verbose`) and/or return (if `return_msg`) the compilation report."""
        msg = CompilationReport(self.graph).to_str(1)
        if verbose:
            print(msg)
        return msg if return_msg else None

    def solve_h2w_h2h_jacobian(
        self, *args: Any
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Path, PyTree], StepJacobians]:
        """Run the model one step (or over `MultiStepData`) and return its Jacobians.

        **Returns:** ``(out, new hidden values, new other values, jac)``; with
        `MultiStepData` inputs, `out` and every Jacobian gain a leading time axis.
        The new hidden and other values are written back into the model's states.
        """
        graph = self.graph
        state = state_of(graph)
        if _has_multi(args):
            for a in args:
                if not isinstance(a, MultiStepData):
                    continue
                leaves = jax.tree.leaves(a.data)
                if not leaves or any(jnp.ndim(v) == 0 for v in leaves):
                    raise StepInputError(
                        "MultiStepData wraps an input with a leading time axis (one slice per "
                        f"step): each of its leaves needs one, got {a.data!r}"
                    )
            T = {jax.tree.leaves(a.data)[0].shape[0] for a in args if isinstance(a, MultiStepData)}
            if len(T) != 1:
                raise StepInputError(f"MultiStepData inputs have different lengths {sorted(T)}")
            (length,) = T
            seq = tuple(
                a.data
                if isinstance(a, MultiStepData)
                else jax.tree.map(lambda v: jax.numpy.broadcast_to(v, (length, *v.shape)), a)
                for a in args
            )
            out, new, jac = multi_step(graph, state, _pack(seq))
        else:
            out, new, jac = step(graph, state, _pack(args))
        write_back(graph, new)
        return out, dict(new.hidden), dict(new.other), jac


class ETraceGraphExecutor(_Executor):
    """Compiles a brainstate model and evaluates its step with Jacobians.

    !!! Example

        ```python
        executor = etrax.ETraceGraphExecutor(gru)
        executor.compile_graph(x)
        out, hidden, other, jac = executor.solve_h2w_h2h_jacobian(x)
        ```
    """

    @property
    def include_hidden_perturb(self) -> bool:
        return False


class ETraceVjpGraphExecutor(_Executor):
    """Like `ETraceGraphExecutor`, plus the loss-to-hidden pullback."""

    @property
    def include_hidden_perturb(self) -> bool:
        return True

    def solve_h2w_h2h_l2h_jacobian(
        self, *args: Any
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Path, PyTree], StepJacobians, Pullback]:
        """One step with Jacobians and the `Pullback` giving ``∂L/∂h^t`` per group.

        **Returns:** ``(out, new hidden values, new other values, jac, pullback)``;
        the new values are written back into the model's states.
        """
        if _has_multi(args):
            raise StepInputError(
                "solve_h2w_h2h_l2h_jacobian takes the inputs of a single time step; use "
                "solve_h2w_h2h_jacobian for MultiStepData sequences"
            )
        graph = self.graph
        out, new, jac, pullback = step_vjp(graph, state_of(graph), _pack(args))
        write_back(graph, new)
        return out, dict(new.hidden), dict(new.other), jac, pullback
