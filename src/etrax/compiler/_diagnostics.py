"""Compiler diagnostics as data: what each stage found, included, excluded and why."""

import enum
from collections.abc import Iterable, Mapping
from typing import Any

import equinox as eqx

from .._typing import Path

__all__ = [
    "CompilationRecord",
    "DiagnosticKind",
    "DiagnosticLevel",
    "record",
]


class DiagnosticLevel(enum.StrEnum):
    """How much a diagnostic matters: `INFO` is bookkeeping, `WARNING` means a weight
    or a Jacobian is approximated or not traced, `ERROR` accompanies a failed compile."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class DiagnosticKind(enum.StrEnum):
    """Every kind of record the compiler can emit (a closed family)."""

    # relations
    RELATION_INCLUDED = "relation_included"
    RELATION_PARTIAL_PATH = "relation_partial_path"
    RELATION_UNTRACED_ROUTE = "relation_untraced_route"
    RELATION_EXCLUDED_WEIGHT_TO_WEIGHT = "relation_excluded_weight_to_weight"
    RELATION_EXCLUDED_NON_TEMPORAL = "relation_excluded_non_temporal"
    RELATION_EXCLUDED_SHAPE_MISMATCH = "relation_excluded_shape_mismatch"
    RELATION_EXCLUDED_MIXING = "relation_excluded_mixing"
    RELATION_EXCLUDED_NO_PARAMSTATE = "relation_excluded_no_paramstate"
    RELATION_EXCLUDED_UNSUPPORTED = "relation_excluded_unsupported"
    TRAINABLE_INVAR_NOT_PARAMSTATE = "trainable_invar_not_paramstate"
    TAIL_MIXES_POSITIONS = "tail_mixes_positions"
    # weights outside relations
    WEIGHT_PLAIN_USE = "weight_plain_use"
    # hidden groups
    HIDDEN_GROUP_MERGED = "hidden_group_merged"
    HIDDEN_GROUP_NO_RECURRENCE = "hidden_group_no_recurrence"
    TRANSITION_MIXES_POSITIONS = "transition_mixes_positions"
    RECURRENT_CONSTANT_PRODUCT = "recurrent_constant_product"
    GROUP_VARSHAPE_CONFLICT = "group_varshape_conflict"
    HIDDEN_STATE_NOT_FLOAT = "hidden_state_not_float"
    HIDDEN_GROUP_NOT_READ = "hidden_group_not_read"
    CROSS_GROUP_ROUTE = "cross_group_route"
    RECURRENT_WEIGHT_ROUTE = "recurrent_weight_route"
    # states and structure
    STATE_MISMATCH = "state_mismatch"
    DYNAMIC_STATE = "dynamic_state"
    CARRIED_STATE_ROUTE = "carried_state_route"
    PARAM_STATE_WRITE = "param_state_write"
    WEIGHT_NOT_FLOAT = "weight_not_float"
    PRIMITIVE_INSIDE_CONTROL_FLOW = "primitive_inside_control_flow"
    WEIGHT_OPERAND_NOT_STATIC = "weight_operand_not_static"
    WEIGHT_OP_RECOGNISED = "weight_op_recognised"
    LOOP_KEPT_WHOLE = "loop_kept_whole"


# Kinds that explain why a weight is not traced by any relation.
EXCLUSION_KINDS = frozenset(
    {
        DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT,
        DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL,
        DiagnosticKind.RELATION_EXCLUDED_SHAPE_MISMATCH,
        DiagnosticKind.RELATION_EXCLUDED_MIXING,
        DiagnosticKind.RELATION_EXCLUDED_NO_PARAMSTATE,
        DiagnosticKind.RELATION_EXCLUDED_UNSUPPORTED,
        DiagnosticKind.WEIGHT_PLAIN_USE,
        DiagnosticKind.STATE_MISMATCH,
    }
)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, set | frozenset):
        return tuple(sorted((_freeze(v) for v in value), key=repr))
    return value


class CompilationRecord(eqx.Module):
    """One diagnostic emitted while compiling a graph.

    **Arguments:**

    - `kind`: a `DiagnosticKind`.
    - `level`: a `DiagnosticLevel`.
    - `message`: a sentence saying what happened and, where relevant, what to do.
    - `primitive`: name of the primitive concerned, if any.
    - `weight_path`: the ParamState path concerned, if any.
    - `hidden_paths`: the hidden-state paths concerned.
    - `context`: further facts as ``(key, value)`` pairs (see `context_dict`).
    """

    kind: DiagnosticKind = eqx.field(static=True)
    level: DiagnosticLevel = eqx.field(static=True)
    message: str = eqx.field(static=True)
    primitive: str | None = eqx.field(static=True, default=None)
    weight_path: Path | None = eqx.field(static=True, default=None)
    hidden_paths: tuple[Path, ...] = eqx.field(static=True, default=())
    context: tuple[tuple[str, Any], ...] = eqx.field(static=True, default=())

    @property
    def context_dict(self) -> dict[str, Any]:
        """`context` as a dict."""
        return dict(self.context)

    def __repr__(self) -> str:
        parts = [f"kind={self.kind.value}", f"level={self.level.value}"]
        if self.primitive is not None:
            parts.append(f"primitive={self.primitive!r}")
        if self.weight_path is not None:
            parts.append(f"weight_path={self.weight_path}")
        if self.hidden_paths:
            parts.append(f"hidden_paths={list(self.hidden_paths)}")
        parts.append(f"message={self.message!r}")
        if self.context:
            parts.append(f"context={self.context_dict}")
        return f"CompilationRecord({', '.join(parts)})"


def record(
    kind: DiagnosticKind,
    level: DiagnosticLevel,
    message: str,
    *,
    primitive: str | None = None,
    weight_path: Path | None = None,
    hidden_paths: Iterable[Path] = (),
    **context: Any,
) -> CompilationRecord:
    """Build a `CompilationRecord` (keyword context values are frozen to tuples)."""
    return CompilationRecord(
        kind=kind,
        level=level,
        message=message,
        primitive=primitive,
        weight_path=weight_path,
        hidden_paths=tuple(hidden_paths),
        context=tuple((k, _freeze(v)) for k, v in context.items()),
    )
