"""etrax: a typed, functional eligibility-trace compiler and online learning for
brainstate models on JAX.

```python
import brainstate, jax.numpy as jnp, etrax

gru = etrax.nn.GRUCell(3, 4)
brainstate.nn.init_all_states(gru)
graph = etrax.compile_etrace_graph(gru, jnp.zeros(3))
print(graph.report())
```
"""

import os as _os

import beartype as _beartype
import brainstate as _brainstate
import equinox as _equinox
import jaxtyping as _jaxtyping

from . import nn, ops
from ._checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from ._compat import exclude_from_locations as _exclude_from_locations
from ._errors import (
    CompilationError,
    EtraxError,
    InputStructureError,
    NotSupportedError,
    OpArgumentError,
    ParamStateWriteError,
    ProbeWarning,
    RecursiveCompileError,
    RewriteLimitError,
    SilentNetworkWarning,
    StateNotInitializedError,
    StateShapeChangedError,
    StepInputError,
    WeightNotFloatError,
    WeightNotParamStateError,
)
from ._pathdict import PathDict
from ._typing import ArrayTree, Path
from .algorithms import (
    DNI,
    DRTRL,
    ESDRTRL,
    UORO,
    Bootstrapped,
    BPTTResult,
    CompilerOptions,
    Coupled,
    Diagonal,
    EProp,
    Evaluation,
    GradientCheck,
    InputOutput,
    IOTraces,
    Jacobian,
    Kappa,
    LearningRule,
    Modulatory,
    NoFilter,
    NoRecursion,
    OnlineAlgorithm,
    OnlineLearner,
    OnlineResult,
    OSTLFeedforward,
    OSTLRecurrent,
    ParamCheck,
    ParamTraces,
    PerParameter,
    PPProp,
    ProjectionTraces,
    RandomFeedback,
    RandomProjection,
    ScalarLeak,
    SnAp,
    Sparse,
    Symmetric,
    SyntheticGradient,
    ThreeFactor,
    bptt_grad,
    check_gradients,
    compile,
    evaluate,
    online_evolve,
    online_grad,
)
from .compiler import (
    CompilationRecord,
    CompilationReport,
    CompilePolicy,
    DiagnosticKind,
    DiagnosticLevel,
    ETraceGraph,
    HiddenGroup,
    HiddenParamOpRelation,
    HiddenPerturbation,
    ModuleInfo,
    ParamUse,
    UseRule,
    WeightRule,
    WeightStatus,
    add_hidden_perturbation_from_minfo,
    add_hidden_perturbation_in_module,
    compile_etrace_graph,
    compose,
    extract,
    extract_module_info,
    find_hidden_groups_from_minfo,
    find_hidden_groups_from_module,
    find_hidden_param_op_relations_from_minfo,
    find_hidden_param_op_relations_from_module,
    group,
    perturb,
    register_position_rule,
    relate,
    rewrite,
)
from .executor import (
    ETraceGraphExecutor,
    ETraceVjpGraphExecutor,
    ModelState,
    MultiStepData,
    Pullback,
    StepJacobians,
    StepPoint,
    forward,
    multi_step,
    state_of,
    step,
    step_vjp,
)
from .ops import (
    ETPOpSpec,
    ETPRules,
    Factorization,
    SparsePattern,
    conv,
    einsum,
    element_wise,
    embedding,
    etp_spec,
    grouped_matmul,
    is_etp_primitive,
    lora_matmul,
    matmul,
    register_primitive,
    register_rules,
    sparse_matmul,
)

__version__ = "0.1.0"

_here = _os.path.dirname(__file__)


def _wrapper_library_dirs() -> list[str]:
    """brainunit (and saiunit, which newer brainunit re-exports) wrap jax.numpy, and
    brainevent binds the products of brainstate's event layers; their frames hide the
    user's line in diagnostics. Any may be absent."""
    import importlib.util

    dirs = []
    for name in ("brainunit", "saiunit", "brainevent"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            dirs.append(_os.path.dirname(spec.origin) + _os.sep)
    return dirs


_exclude_from_locations(
    _os.path.join(_here, "ops") + _os.sep,
    _os.path.join(_here, "compiler") + _os.sep,
    _os.path.join(_here, "nn", "_linear.py"),
    _os.path.join(_here, "_compat.py"),
    *(
        _os.path.dirname(_file) + _os.sep
        for _file in (
            _brainstate.__file__,
            _jaxtyping.__file__,
            _beartype.__file__,
            _equinox.__file__,
        )
    ),
    *_wrapper_library_dirs(),
)

__all__ = [
    "DNI",
    "DRTRL",
    "ESDRTRL",
    "UORO",
    "ArrayTree",
    "BPTTResult",
    "Bootstrapped",
    "Checkpoint",
    "CompilationError",
    "CompilationRecord",
    "CompilationReport",
    "CompilePolicy",
    "CompilerOptions",
    "Coupled",
    "DiagnosticKind",
    "DiagnosticLevel",
    "Diagonal",
    "EProp",
    "ETPOpSpec",
    "ETPRules",
    "ETraceGraph",
    "ETraceGraphExecutor",
    "ETraceVjpGraphExecutor",
    "EtraxError",
    "Evaluation",
    "Factorization",
    "GradientCheck",
    "HiddenGroup",
    "HiddenParamOpRelation",
    "HiddenPerturbation",
    "IOTraces",
    "InputOutput",
    "InputStructureError",
    "Jacobian",
    "Kappa",
    "LearningRule",
    "ModelState",
    "Modulatory",
    "ModuleInfo",
    "MultiStepData",
    "NoFilter",
    "NoRecursion",
    "NotSupportedError",
    "OSTLFeedforward",
    "OSTLRecurrent",
    "OnlineAlgorithm",
    "OnlineLearner",
    "OnlineResult",
    "OpArgumentError",
    "PPProp",
    "ParamCheck",
    "ParamStateWriteError",
    "ParamTraces",
    "ParamUse",
    "Path",
    "PathDict",
    "PerParameter",
    "ProbeWarning",
    "ProjectionTraces",
    "Pullback",
    "RandomFeedback",
    "RandomProjection",
    "RecursiveCompileError",
    "RewriteLimitError",
    "ScalarLeak",
    "SilentNetworkWarning",
    "SnAp",
    "Sparse",
    "SparsePattern",
    "StateNotInitializedError",
    "StateShapeChangedError",
    "StepInputError",
    "StepJacobians",
    "StepPoint",
    "Symmetric",
    "SyntheticGradient",
    "ThreeFactor",
    "UseRule",
    "WeightNotFloatError",
    "WeightNotParamStateError",
    "WeightRule",
    "WeightStatus",
    "__version__",
    "add_hidden_perturbation_from_minfo",
    "add_hidden_perturbation_in_module",
    "bptt_grad",
    "check_gradients",
    "compile",
    "compile_etrace_graph",
    "compose",
    "conv",
    "einsum",
    "element_wise",
    "embedding",
    "etp_spec",
    "evaluate",
    "extract",
    "extract_module_info",
    "find_hidden_groups_from_minfo",
    "find_hidden_groups_from_module",
    "find_hidden_param_op_relations_from_minfo",
    "find_hidden_param_op_relations_from_module",
    "forward",
    "group",
    "grouped_matmul",
    "is_etp_primitive",
    "load_checkpoint",
    "lora_matmul",
    "matmul",
    "multi_step",
    "nn",
    "online_evolve",
    "online_grad",
    "ops",
    "perturb",
    "register_position_rule",
    "register_primitive",
    "register_rules",
    "relate",
    "rewrite",
    "save_checkpoint",
    "sparse_matmul",
    "state_of",
    "step",
    "step_vjp",
]
