"""Static planning shared by the online algorithms and drivers.

A *slot* is one (relation, connected group) pair: one eligibility trace. The plan
records, per slot, how the trace is shaped and whether the op's rules factorise
(so fused kernels apply), and, per graph, which parameter uses add their
exact instantaneous gradient (`instant_uses`).
"""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._compat import shape_struct, struct_of
from .._errors import CompilationError
from .._typing import Shape
from ..compiler import ETraceGraph, HiddenParamOpRelation, ParamUse, UseRule
from ..ops import ETPRules

__all__ = ["Plan", "Slot", "direct_routes", "plan_of"]


class Slot:
    """Static description of one trace (relation ``r``, its ``k``-th tail)."""

    def __init__(self, graph: ETraceGraph, table: Any, rel: HiddenParamOpRelation, k: int) -> None:
        tail = rel.tails[k]
        group = graph.hidden_groups[tail.group_index]
        rules = rel.spec.rules
        if rules is None:
            raise CompilationError(
                f"the ETP primitive {rel.primitive.name} has no ETPRules, so online algorithms "
                "cannot trace it; register them with etrax.register_rules"
            )
        self.relation = rel.index
        self.tail = k
        self.group = tail.group_index
        self.rules: ETPRules = rules
        self.num_state = group.num_state
        self.varshape: Shape = group.varshape
        self.extra: Shape = tuple(group.varshape[: tail.broadcast_ndim])
        self.y_shape: Shape = rel.y_shape
        self.x_shape: Shape | None = rel.x_shape
        self.params: Mapping[str, Any] = rel.params
        self.dtype = np.dtype(rel.dtype)
        weights = {
            t.key: shape_struct(table.var(t.var).aval.shape, table.var(t.var).aval.dtype)
            for t in rel.trainables
        }
        self.weight_structs = weights
        x_struct = (
            None
            if rel.x_var is None
            else shape_struct(table.var(rel.x_var).aval.shape, table.var(rel.x_var).aval.dtype)
        )
        y_struct = shape_struct(rel.y_shape, rel.dtype)
        shapes = rules.param_trace_shapes(x_struct, y_struct, weights, rel.params)
        self.eff_shapes: dict[str, Shape] = rules.effective_shapes(weights, rel.params)
        # trace keys: what the rules trace for the operands that are trained (usually
        # the trainable keys; a constant bias is not traced)
        self.keys: tuple[str, ...] = tuple(k_ for k_ in shapes if k_ in self.eff_shapes)
        self.trace_shapes: dict[str, Shape] = {k_: tuple(shapes[k_]) for k_ in self.keys}
        self.factorized = rules.factor is not None
        self.batch_ndim = 0
        self.inputs: dict[str, int | None] = {}
        if rules.factor is not None:
            fac = jax.eval_shape(lambda xx: rules.factor(xx, rel.params), x_struct)  # type: ignore[misc]
            self.batch_ndim = int(fac.batch_ndim)
            self.inputs = {
                k_: None if u is None else int(u.shape[-1]) for k_, u in fac.inputs.items()
            }
        # canonical fused layout: (NB, I, O, S) / (NB, O, S)
        op_batch = self.y_shape[: self.batch_ndim]
        self.nb = int(np.prod((*self.extra, *op_batch), dtype=np.int64))
        self.out = int(np.prod(self.y_shape[self.batch_ndim :], dtype=np.int64))


class Plan:
    """Everything static an algorithm or driver needs about a graph."""

    def __init__(self, graph: ETraceGraph) -> None:
        from ..compiler._jaxpr import VarTable

        table = VarTable(graph.module_info.jaxpr)
        self.slots: tuple[Slot, ...] = tuple(
            Slot(graph, table, rel, k)
            for rel in graph.hidden_param_op_relations
            for k in range(len(rel.tails))
        )
        self.x_structs: tuple[Any, ...] = tuple(
            None if rel.x_var is None else struct_of(table.var(rel.x_var))
            for rel in graph.hidden_param_op_relations
        )
        hp = graph.hidden_perturb
        self.instant_uses: tuple[ParamUse, ...] = (
            () if hp is None else tuple(graph.param_uses[i] for i in hp.use_indices)
        )
        # per operand of an instant equation: the relation whose input is that same
        # value (its Jacobians' `x`), if any, so that a chunk stacks it once
        relations = enumerate(graph.hidden_param_op_relations)
        by_x = {rel.x_var: r for r, rel in relations if rel.x_var is not None}
        eqns = graph.module_info.jaxpr.eqns
        ids = [table.id_of(eqns[i].invars[p]) for i, p in (() if hp is None else hp.operand_slots)]
        self.operand_inputs: tuple[int | None, ...] = tuple(
            None if v is None else by_x.get(v) for v in ids
        )
        # relations whose within-step traced contribution is also inside an
        # instantaneous gradient (it must be subtracted once)
        self.overlap: tuple[int, ...] = tuple(
            sorted(
                {
                    u.relation
                    for u in graph.param_uses
                    if u.rule is UseRule.PARTLY_TRACED and u.relation is not None
                }
            )
        )


def plan_of(graph: ETraceGraph) -> Plan:
    """The graph's `Plan`, computed once per graph (kept in `graph.memo`)."""
    return graph.memo.get("plan", lambda: Plan(graph))


def direct_routes(graph: ETraceGraph) -> bool:
    """Whether some route reaches the loss from the old hidden values within a step (the
    drivers then contract the traces before each update with those signals too)."""
    perturb = graph.hidden_perturb
    return perturb is not None and bool(perturb.direct_paths)
