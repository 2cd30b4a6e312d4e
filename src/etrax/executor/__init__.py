"""The executor: pure, jit-compiled steps over an `ETraceGraph`, and brainstate facades."""

from ._facade import ETraceGraphExecutor, ETraceVjpGraphExecutor, MultiStepData
from ._state import ModelState, state_of
from ._step import Pullback, StepJacobians, forward, multi_step, step, step_vjp

__all__ = [
    "ETraceGraphExecutor",
    "ETraceVjpGraphExecutor",
    "ModelState",
    "MultiStepData",
    "Pullback",
    "StepJacobians",
    "forward",
    "multi_step",
    "state_of",
    "step",
    "step_vjp",
]
