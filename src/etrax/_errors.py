"""The exceptions etrax raises.

Every error that etrax raises before tracing is one of these, each with a message
that says what went wrong and what to do about it.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compiler._diagnostics import CompilationRecord

__all__ = [
    "CompilationError",
    "EtraxError",
    "InputStructureError",
    "NotSupportedError",
    "OpArgumentError",
    "ParamStateWriteError",
    "RecursiveCompileError",
    "RewriteLimitError",
    "StateNotInitializedError",
    "StateShapeChangedError",
    "StepInputError",
    "WeightNotFloatError",
    "WeightNotParamStateError",
]


class EtraxError(Exception):
    """Base class of every error etrax raises on purpose."""


class CompilationError(EtraxError):
    """The model could not be compiled into an eligibility-trace graph.

    `records` holds the diagnostics gathered up to the failure, so a caller can
    inspect them like the diagnostics of a successful compile.
    """

    records: "tuple[CompilationRecord, ...]"

    def __init__(self, message: str, records: "Sequence[CompilationRecord]" = ()) -> None:
        super().__init__(message)
        self.records = tuple(records)


class NotSupportedError(CompilationError):
    """The step uses a construct the compiler does not support."""


class RewriteLimitError(CompilationError):
    """Rewriting the step (unrolling loops) would exceed `CompilePolicy.max_equations`."""


class StateNotInitializedError(CompilationError):
    """The model's states have not been created yet."""


class ParamStateWriteError(NotSupportedError):
    """The step writes a `brainstate.ParamState`; weights must be constant within a step."""


class StateShapeChangedError(CompilationError):
    """The step gives a state a new value of another shape or dtype than its current one.

    A state's shape and dtype must stay the same from step to step. The usual cause
    is a model whose states were initialised without a batch axis
    (``brainstate.nn.init_all_states(model)``) but stepped with a batched input:
    initialise with ``brainstate.nn.init_all_states(model, batch_size=B)`` instead.
    """


class WeightNotFloatError(NotSupportedError):
    """A `brainstate.ParamState` used by the step holds a non-floating-point array.

    Weights are what etrax differentiates, and integer or boolean arrays have no
    gradient, so such a ParamState is refused rather than silently left untrained.
    Keep a fixed table that multiplies or indexes a weight (a connectivity mask) as a
    constant attribute of the module, so the weight's product stays traced; a table
    the step changes (a counter) goes in a plain ``brainstate.State`` or
    ``ShortTermState`` (a weight computed from such a State is a plain use, learned
    from its instantaneous gradient).
    """


class InputStructureError(CompilationError, TypeError):
    """The example inputs do not match the signature or shapes of `model.update`."""


class WeightNotParamStateError(CompilationError):
    """An ETP operation's weight operand does not come from a `brainstate.ParamState`."""


class RecursiveCompileError(CompilationError):
    """`compile_etrace_graph` was called while a JAX trace of a model was running."""


class StepInputError(EtraxError, ValueError):
    """The inputs or state given to a step do not match the compiled graph."""


class SilentNetworkWarning(UserWarning):
    """A learner saw a sequence over which a hidden group never changed, or after
    which every gradient was exactly zero (a silent spiking layer, a dead input)."""


class ProbeWarning(UserWarning):
    """A property read off a model numerically (`SnAp`'s position graph, probed at
    random points) differs from point to point, so it may be incomplete."""


class OpArgumentError(EtraxError, ValueError, TypeError):
    """An ETP operation (`etrax.matmul`, `etrax.conv`, …) or `register_primitive` was
    given an argument it cannot take; the message names the operation and the
    argument. It is a `ValueError` and a `TypeError`, as the plain errors it replaces
    were one or the other."""
