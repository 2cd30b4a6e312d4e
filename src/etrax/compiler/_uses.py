"""Per-use accounting of parameters: every place the step reads a ParamState.

A *use* is one operand slot of one equation (or one step output) that reads a
value computed from ParamState leaves alone (a *weight value*: the leaves, maybe
through slices, transposes, ``abs``, masks, ...), in an equation that also reads
data or is an ETP op. One ParamState may have several uses, each with its own
rule; their gradients are summed:

- `UseRule.TRACED`: the slot is a trainable operand of an ETP op whose every
  connection is traced by its relation (exact, or flagged approximate);
- `UseRule.PARTLY_TRACED`: a traced operand whose op also reaches the outputs,
  other hidden groups or other weight ops in ways the relation does not trace;
  online learners add the exact instantaneous gradient of those connections;
- `UseRule.INSTANTANEOUS`: everything else (plain JAX uses, ETP ops with no
  relation): the exact instantaneous gradient each step.

Invariant: at T = 1 these rules together give every parameter its exact gradient.
"""

import enum
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import numpy as np

from .._compat import DropVar, Literal, Var, aval_of, equation_location
from .._typing import Path, Shape, VarId
from ..ops import etp_spec
from ._diagnostics import DiagnosticKind
from ._jaxpr import Program, VarTable, slice_program
from ._module_info import ModuleInfo, StateKind

__all__ = ["EtpStatus", "ParamUse", "UseRule", "find_uses"]


class UseRule(enum.Enum):
    """How one use of a parameter learns under an online algorithm."""

    TRACED = "traced"
    """Traced through time by a relation; every connection of the op is traced."""
    PARTLY_TRACED = "partly_traced"
    """Traced by a relation, plus the exact instantaneous gradient of the op's
    connections the relation does not trace."""
    INSTANTANEOUS = "instantaneous"
    """The exact instantaneous gradient each step; not traced through time."""


class ParamUse(eqx.Module):
    """One use of ParamState leaves by the step.

    **Arguments:**

    - `index`: position in `ETraceGraph.param_uses`.
    - `eqn_index`: the equation reading the weight value (`None`: a step output).
    - `slot`: the operand position in that equation (or the output position).
    - `var`: `VarId` of the weight value read; `shape`, `dtype` its aval.
    - `param_leaves`: ``(path, leaf index)`` of the ParamState leaves it comes from.
    - `program`: ``(*consts, *leaf values) -> value``; `consts` its constant inputs.
    - `primitive`, `location`: the reading equation's primitive and source location.
    - `rule`: the `UseRule`.
    - `relation`: the relation tracing it, if any.
    - `reason`: why (part of) this use is not traced, as a `DiagnosticKind`.
    """

    index: int = eqx.field(static=True)
    eqn_index: int | None = eqx.field(static=True)
    slot: int = eqx.field(static=True)
    var: VarId = eqx.field(static=True)
    shape: Shape = eqx.field(static=True)
    dtype: np.dtype[Any] = eqx.field(static=True)
    param_leaves: tuple[tuple[Path, int], ...] = eqx.field(static=True)
    program: Program = eqx.field(static=True)
    consts: tuple[VarId, ...] = eqx.field(static=True)
    primitive: str = eqx.field(static=True)
    location: str = eqx.field(static=True)
    rule: UseRule = eqx.field(static=True)
    relation: int | None = eqx.field(static=True)
    reason: DiagnosticKind | None = eqx.field(static=True)

    @property
    def paths(self) -> tuple[Path, ...]:
        """The ParamState paths this use reads, in order."""
        return tuple(dict.fromkeys(p for p, _ in self.param_leaves))

    @property
    def needs_instant(self) -> bool:
        """Whether online learners add this use's instantaneous gradient."""
        return self.rule is not UseRule.TRACED


class EtpStatus(eqx.Module):
    """What `relate` decided for one ETP equation (input to `find_uses`)."""

    relation: int | None = eqx.field(static=True)
    untraced: bool = eqx.field(static=True)
    reason: DiagnosticKind | None = eqx.field(static=True)
    trainable_slots: frozenset[int] = eqx.field(static=True)


class _Kind(enum.Enum):
    CONST = "const"
    WEIGHT = "weight"
    DATA = "data"


def _value_kinds(
    minfo: ModuleInfo, table: VarTable
) -> tuple[dict[Var, _Kind], dict[Var, tuple[tuple[Path, int], ...]]]:
    """Classify every variable as constant, weight value or data, and name the leaves
    each weight value is computed from."""
    jaxpr = minfo.jaxpr
    kind: dict[Var, _Kind] = {v: _Kind.CONST for v in jaxpr.constvars}
    leaves: dict[Var, tuple[tuple[Path, int], ...]] = {}
    for v in jaxpr.invars[: minfo.num_in]:
        kind[v] = _Kind.DATA
    for s in minfo.states:
        for k, vid in enumerate(s.invars):
            v = table.var(vid)
            if s.kind is StateKind.WEIGHT:
                kind[v] = _Kind.WEIGHT
                leaves[v] = ((s.path, k),)
            else:
                kind[v] = _Kind.DATA
    for eqn in jaxpr.eqns:
        ins = [a for a in eqn.invars if isinstance(a, Var)]
        in_kinds = {kind.get(a, _Kind.DATA) for a in ins}
        if etp_spec(eqn.primitive) is not None or _Kind.DATA in in_kinds:
            out_kind = _Kind.DATA
        elif _Kind.WEIGHT in in_kinds:
            out_kind = _Kind.WEIGHT
        else:
            out_kind = _Kind.CONST
        from_leaves = tuple(dict.fromkeys(lf for a in ins for lf in leaves.get(a, ())))
        for v in eqn.outvars:
            if isinstance(v, DropVar):
                continue
            kind[v] = out_kind
            if out_kind is _Kind.WEIGHT:
                leaves[v] = from_leaves
    return kind, leaves


def _slots(minfo: ModuleInfo, kind: Mapping[Var, _Kind]) -> list[tuple[int | None, int, Var]]:
    """Every ``(equation, slot, weight value)`` where a weight value meets data or an
    ETP op, then every step output that is a weight value."""
    jaxpr = minfo.jaxpr
    found: list[tuple[int | None, int, Var]] = []
    for i, eqn in enumerate(jaxpr.eqns):
        outs = [v for v in eqn.outvars if not isinstance(v, DropVar)]
        if not outs or kind.get(outs[0]) is not _Kind.DATA:
            continue
        for pos, a in enumerate(eqn.invars):
            if isinstance(a, Var) and kind.get(a) is _Kind.WEIGHT:
                found.append((i, pos, a))
    weight_outs: set[int] = set()
    pos = minfo.num_var_out
    for s in minfo.states:
        if s.kind is StateKind.WEIGHT:
            weight_outs.update(range(pos, pos + len(s.invars)))
        pos += len(s.invars)
    for p, a in enumerate(jaxpr.outvars):
        if p not in weight_outs and isinstance(a, Var) and kind.get(a) is _Kind.WEIGHT:
            found.append((None, p, a))
    return found


def _rule_of(
    eqn_index: int | None, slot: int, etp: Mapping[int, EtpStatus]
) -> tuple[UseRule, int | None, DiagnosticKind | None]:
    status = etp.get(eqn_index) if eqn_index is not None else None
    if status is None:
        return UseRule.INSTANTANEOUS, None, DiagnosticKind.WEIGHT_PLAIN_USE
    if slot not in status.trainable_slots:
        return UseRule.INSTANTANEOUS, None, DiagnosticKind.WEIGHT_OPERAND_NOT_STATIC
    if status.relation is None:
        return UseRule.INSTANTANEOUS, None, status.reason
    if status.untraced:
        return UseRule.PARTLY_TRACED, status.relation, status.reason
    return UseRule.TRACED, status.relation, None


def find_uses(
    minfo: ModuleInfo, table: VarTable, etp: Mapping[int, EtpStatus]
) -> tuple[ParamUse, ...]:
    """Every use of ParamState leaves by the step, in equation order, with its rule.

    **Arguments:**

    - `minfo`: the traced step; `table` its `VarTable`.
    - `etp`: for each ETP equation, what `relate` decided.
    """
    kind, leaves = _value_kinds(minfo, table)
    jaxpr = minfo.jaxpr
    uses: list[ParamUse] = []
    for eqn_index, slot, var in _slots(minfo, kind):
        leaf_vars = [table.var(vid) for vid in _leaf_ids(minfo, leaves[var])]
        program, consts = slice_program(
            minfo.closed_jaxpr,
            table,
            leaf_vars,
            [var],
            lambda i: kind.get(_first_out(jaxpr.eqns[i])) is not _Kind.DATA,
        )
        rule, relation, reason = _rule_of(eqn_index, slot, etp)
        eqn = None if eqn_index is None else jaxpr.eqns[eqn_index]
        aval = aval_of(var)
        uses.append(
            ParamUse(
                index=len(uses),
                eqn_index=eqn_index,
                slot=slot,
                var=table.ids[var],
                shape=tuple(aval.shape),
                dtype=np.dtype(aval.dtype),
                param_leaves=leaves[var],
                program=program,
                consts=consts,
                primitive="output" if eqn is None else str(eqn.primitive.name),
                location="a step output" if eqn is None else equation_location(eqn),
                rule=rule,
                relation=relation,
                reason=reason,
            )
        )
    return tuple(uses)


def _first_out(eqn: Any) -> Any:
    outs = [v for v in eqn.outvars if not isinstance(v, DropVar) and not isinstance(v, Literal)]
    return outs[0] if outs else None


def _leaf_ids(minfo: ModuleInfo, leaves: tuple[tuple[Path, int], ...]) -> list[VarId]:
    by_path = {s.path: s for s in minfo.states}
    return [by_path[p].invars[k] for p, k in leaves]
