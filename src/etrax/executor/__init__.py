"""The executor: pure, jit-compiled steps over an `ETraceGraph`, and brainstate facades."""

from ._facade import ETraceGraphExecutor, ETraceVjpGraphExecutor, MultiStepData
from ._state import (
    ModelState,
    check_sequence_length,
    fast_check_inputs,
    fast_check_state,
    flat_state,
    shape_dtype,
    state_of,
    write_back,
)
from ._step import (
    Pullback,
    StepJacobians,
    as_args,
    forward,
    forward_pure,
    multi_step,
    next_state,
    step,
    step_env,
    step_jacobians,
    step_pure,
    step_vjp,
)

__all__ = [
    "ETraceGraphExecutor",
    "ETraceVjpGraphExecutor",
    "ModelState",
    "MultiStepData",
    "Pullback",
    "StepJacobians",
    "as_args",
    "check_sequence_length",
    "fast_check_inputs",
    "fast_check_state",
    "flat_state",
    "forward",
    "forward_pure",
    "multi_step",
    "next_state",
    "shape_dtype",
    "state_of",
    "step",
    "step_env",
    "step_jacobians",
    "step_pure",
    "step_vjp",
    "write_back",
]
