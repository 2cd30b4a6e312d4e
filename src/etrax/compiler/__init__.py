"""The eligibility-trace compiler: ``compose(extract, group, relate, rewrite, perturb)``."""

from ._compile import compile_etrace_graph, compose
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel
from ._extract import extract, extract_module_info
from ._graph import ETraceGraph, WeightRule, WeightStatus
from ._group import (
    GroupedModule,
    HiddenGroup,
    find_hidden_groups_from_minfo,
    find_hidden_groups_from_module,
    group,
)
from ._jaxpr import Program
from ._module_info import ModuleInfo, StateInfo, StateKind
from ._normalise import CompilePolicy
from ._perturb import (
    REGION_MIN_MACS,
    add_hidden_perturbation_from_minfo,
    add_hidden_perturbation_in_module,
    perturb,
)
from ._perturbation import HiddenPerturbation, Region
from ._positions import PositionRule, register_position_rule
from ._relate import (
    HiddenParamOpRelation,
    RelatedModule,
    RelationTail,
    TrainableOperand,
    find_hidden_param_op_relations_from_minfo,
    find_hidden_param_op_relations_from_module,
    relate,
)
from ._report import CompilationReport
from ._rewrite import RewrittenModule, rewrite
from ._uses import ParamUse, UseRule

__all__ = [
    "REGION_MIN_MACS",
    "CompilationRecord",
    "CompilationReport",
    "CompilePolicy",
    "DiagnosticKind",
    "DiagnosticLevel",
    "ETraceGraph",
    "GroupedModule",
    "HiddenGroup",
    "HiddenParamOpRelation",
    "HiddenPerturbation",
    "ModuleInfo",
    "ParamUse",
    "PositionRule",
    "Program",
    "Region",
    "RelatedModule",
    "RelationTail",
    "RewrittenModule",
    "StateInfo",
    "StateKind",
    "TrainableOperand",
    "UseRule",
    "WeightRule",
    "WeightStatus",
    "add_hidden_perturbation_from_minfo",
    "add_hidden_perturbation_in_module",
    "compile_etrace_graph",
    "compose",
    "extract",
    "extract_module_info",
    "find_hidden_groups_from_minfo",
    "find_hidden_groups_from_module",
    "find_hidden_param_op_relations_from_minfo",
    "find_hidden_param_op_relations_from_module",
    "group",
    "perturb",
    "register_position_rule",
    "relate",
    "rewrite",
]
