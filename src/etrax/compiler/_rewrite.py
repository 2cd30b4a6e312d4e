"""Stage 4, `rewrite`: expose every intermediate the executor needs as an output.

One evaluation of the rewritten step then yields everything: each relation's
``x`` and ``y``, the constant inputs of every tail, transition and weight
program. Values that already are step inputs (old states, arguments, jaxpr
constants) are not hoisted: the executor has them anyway.
"""

import dataclasses
from collections.abc import Sequence

import equinox as eqx

from .._compat import ClosedJaxpr, replace_outvars
from .._typing import Path, VarId
from ._analysis import Analyses
from ._diagnostics import CompilationRecord
from ._group import HiddenGroup
from ._jaxpr import Program, VarTable
from ._module_info import ModuleInfo
from ._relate import HiddenParamOpRelation, RelatedModule
from ._uses import ParamUse

__all__ = ["RewrittenModule", "hoist_outputs", "needed_values", "rewrite"]


class RewrittenModule(eqx.Module):
    """Output of the `rewrite` stage: the related module with hoisted outputs."""

    module_info: ModuleInfo
    hidden_groups: tuple[HiddenGroup, ...]
    hidden_param_op_relations: tuple[HiddenParamOpRelation, ...]
    diagnostics: tuple[CompilationRecord, ...] = eqx.field(static=True)
    param_uses: tuple[ParamUse, ...] = eqx.field(static=True)
    analyses: Analyses = eqx.field(static=True)

    @property
    def hid_path_to_group(self) -> dict[Path, HiddenGroup]:
        return {p: g for g in self.hidden_groups for p in g.hidden_paths}


def needed_values(
    groups: tuple[HiddenGroup, ...], relations: tuple[HiddenParamOpRelation, ...]
) -> list[VarId]:
    """Every `VarId` the executor reads, in a deterministic order."""
    need: list[VarId] = []
    for rel in relations:
        if rel.x_var is not None:
            need.append(rel.x_var)
        need.append(rel.y_var)
        for tail in rel.tails:
            need.extend(tail.consts)
        for t in rel.trainables:
            need.extend(t.consts)
    for g in groups:
        need.extend(g.transition_consts)
    return list(dict.fromkeys(need))


def hoist_outputs(minfo: ModuleInfo, var_ids: Sequence[VarId]) -> ModuleInfo:
    """A copy of `minfo` whose step also returns the values of `var_ids` (after the
    existing outputs, in order, skipping ids already hoisted)."""
    table = VarTable(minfo.jaxpr)
    new = [v for v in dict.fromkeys(var_ids) if v not in minfo.hoisted]
    if not new:
        return minfo
    jaxpr = minfo.jaxpr
    extended = replace_outvars(jaxpr, [*jaxpr.outvars, *(table.var(v) for v in new)])
    program = Program(
        ClosedJaxpr(extended, minfo.closed_jaxpr.consts),
        minfo.program.input_ids,
        [*minfo.program.output_ids, *new],
        rules=minfo.program.rules_key(),  # the same equations: the same rules
    )
    return dataclasses.replace(minfo, program=program, hoisted=(*minfo.hoisted, *new))


def rewrite(related: RelatedModule) -> RewrittenModule:
    """Hoist the executor's intermediates as extra outputs of the step (stage 4)."""
    minfo = related.module_info
    jaxpr = minfo.jaxpr
    n_inputs = len(jaxpr.constvars) + len(jaxpr.invars)
    need = needed_values(related.hidden_groups, related.hidden_param_op_relations)
    hoist = [v for v in need if v >= n_inputs]
    return RewrittenModule(
        module_info=hoist_outputs(minfo, hoist),
        hidden_groups=related.hidden_groups,
        hidden_param_op_relations=related.hidden_param_op_relations,
        diagnostics=related.diagnostics,
        param_uses=related.param_uses,
        analyses=related.analyses,
    )
