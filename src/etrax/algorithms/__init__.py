"""Online learning: learning rules as points on independent axes, their presets
(D-RTRL, pp-prop, e-prop, …) and the sequence drivers."""

from ._axes import (
    Bootstrapped,
    Coupled,
    Diagonal,
    Filter,
    Jacobian,
    Kappa,
    Modulatory,
    NoFilter,
    NoRecursion,
    RandomFeedback,
    Recursion,
    ScalarLeak,
    Scope,
    Signal,
    Sparse,
    Symmetric,
)
from ._base import DEFAULT_CHUNK_STEPS, EffGrads, OnlineAlgorithm, default_chunk_steps
from ._check import (
    GradientCheck,
    ParamCheck,
    check_gradients,
    compare_gradients,
    t1_tolerance,
)
from ._dni import SyntheticGradient
from ._drivers import (
    PACK_MAX_BYTES,
    BPTTResult,
    OnlineResult,
    bptt_grad,
    online_evolve,
    online_grad,
)
from ._drtrl import ParamTraces, PerParameter
from ._evaluate import Evaluation, evaluate
from ._learner import CompilerOptions, OnlineLearner, compile
from ._pp import InputOutput, IOTraces
from ._presets import (
    DNI,
    DRTRL,
    ESDRTRL,
    PRESETS,
    UORO,
    EProp,
    OSTLFeedforward,
    OSTLRecurrent,
    PPProp,
    SnAp,
    ThreeFactor,
)
from ._rule import LearningRule, TraceFactorisation
from ._uoro import ProjectionTraces, RandomProjection
from ._weights import operand_values, operands_to_params

__all__ = [
    "DEFAULT_CHUNK_STEPS",
    "DNI",
    "DRTRL",
    "ESDRTRL",
    "PACK_MAX_BYTES",
    "PRESETS",
    "UORO",
    "BPTTResult",
    "Bootstrapped",
    "CompilerOptions",
    "Coupled",
    "Diagonal",
    "EProp",
    "EffGrads",
    "Evaluation",
    "Filter",
    "GradientCheck",
    "IOTraces",
    "InputOutput",
    "Jacobian",
    "Kappa",
    "LearningRule",
    "Modulatory",
    "NoFilter",
    "NoRecursion",
    "OSTLFeedforward",
    "OSTLRecurrent",
    "OnlineAlgorithm",
    "OnlineLearner",
    "OnlineResult",
    "PPProp",
    "ParamCheck",
    "ParamTraces",
    "PerParameter",
    "ProjectionTraces",
    "RandomFeedback",
    "RandomProjection",
    "Recursion",
    "ScalarLeak",
    "Scope",
    "Signal",
    "SnAp",
    "Sparse",
    "Symmetric",
    "SyntheticGradient",
    "ThreeFactor",
    "TraceFactorisation",
    "bptt_grad",
    "check_gradients",
    "compare_gradients",
    "compile",
    "default_chunk_steps",
    "evaluate",
    "online_evolve",
    "online_grad",
    "operand_values",
    "operands_to_params",
    "t1_tolerance",
]
