"""Stage 4, `rewrite`: expose every intermediate the executor needs as an output.

One evaluation of the rewritten step then yields everything: each relation's
``x`` and ``y``, the constant inputs of every tail, transition and weight
program. Values that already are step inputs (old states, arguments, jaxpr
constants) are not hoisted: the executor has them anyway.
"""

import equinox as eqx

from .._typing import Path, VarId
from ._diagnostics import CompilationRecord
from ._group import HiddenGroup
from ._module_info import ModuleInfo
from ._analysis import Analyses
from ._relate import HiddenParamOpRelation, RelatedModule
from ._uses import ParamUse

__all__ = ["RewrittenModule", "needed_values", "rewrite"]


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


def rewrite(related: RelatedModule) -> RewrittenModule:
    """Hoist the executor's intermediates as extra outputs of the step (stage 4)."""
    minfo = related.module_info
    jaxpr = minfo.jaxpr
    n_inputs = len(jaxpr.constvars) + len(jaxpr.invars)
    need = needed_values(related.hidden_groups, related.hidden_param_op_relations)
    hoist = [v for v in need if v >= n_inputs]
    return RewrittenModule(
        module_info=minfo.add_jaxpr_outs(hoist),
        hidden_groups=related.hidden_groups,
        hidden_param_op_relations=related.hidden_param_op_relations,
        diagnostics=related.diagnostics,
        param_uses=related.param_uses,
        analyses=related.analyses,
    )
