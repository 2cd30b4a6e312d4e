"""The per-parameter trace factorisation (D-RTRL, e-prop): one trace per weight entry
and hidden state, ``ε ← D ε + x ⊗ df``, contracted with the learning signal."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._errors import CompilationError
from ..compiler import ETraceGraph
from ..executor import StepJacobians
from ._axes import Coupled, Diagonal, Kappa, NoFilter, Sparse
from ._base import (
    ONE_SAMPLE_CPU_CHUNK_STEPS,
    EffGrads,
    Weights,
    add_into,
    scan_chunk,
    varying_zeros,
)
from ._kernels import (
    ChunkBackward,
    ChunkParts,
    chunk_backward,
    chunk_grads,
    drtrl_chunk_parts,
    drtrl_init,
    drtrl_solve,
    drtrl_update,
)
from ._plan import Slot, plan_of
from ._rule import LearningRule, TraceFactorisation
from ._snap import neighbourhood, snap_init, snap_solve, snap_update

__all__ = ["ParamTraces", "PerParameter"]


class ParamTraces(eqx.Module):
    """Per-parameter traces.

    **Arguments:**

    - `eps`: one dict (trainable key → trace ``(*extra, *trace_shape, S)``) per
      (relation, connected group) slot.
    - `filtered`: their κ-filtered copies under a `Kappa` filter, else `None`.
    """

    eps: tuple[dict[str, Array], ...]
    filtered: tuple[dict[str, Array], ...] | None = None


def _update_eps(
    graph: ETraceGraph, eps: tuple[dict[str, Array], ...], jac: StepJacobians, weights: Weights
) -> tuple[dict[str, Array], ...]:
    plan = plan_of(graph)
    return tuple(
        drtrl_update(
            slot,
            e,
            jac.x[slot.relation],
            jac.df[slot.relation][slot.tail],
            jac.D[slot.group],
            weights[slot.relation],
        )
        for slot, e in zip(plan.slots, eps, strict=True)
    )


def _solve_eps(
    graph: ETraceGraph,
    eps: tuple[dict[str, Array], ...],
    dl_dh: Sequence[Array],
    weights: Weights,
) -> EffGrads:
    plan = plan_of(graph)
    out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
    for slot, e in zip(plan.slots, eps, strict=True):
        g = drtrl_solve(slot, e, dl_dh[slot.group], weights[slot.relation])
        add_into(out[slot.relation], g)
    return tuple(out)


def _backwards(
    jacs: StepJacobians,
    signals: Sequence[Array],
    olds: Sequence[Array] | None,
    kappa: float | None = None,
) -> Callable[[int], ChunkBackward]:
    """Each group's `ChunkBackward`, formed once, when a slot of the group first asks
    for it: the slots of one group share its backward pass over the chunk."""

    @functools.cache
    def backward(group: int) -> ChunkBackward:
        N = None if olds is None else olds[group]
        return chunk_backward(jacs.D[group], signals[group], N, kappa)

    return backward


def _chunk_filtered(
    graph: ETraceGraph,
    traces: ParamTraces,
    jacs: StepJacobians,
    signals: Sequence[Array],
    olds: Sequence[Array] | None,
    kappa: float,
) -> tuple[ParamTraces, EffGrads]:
    """The fused chunk with e-prop's κ filter (every slot factorised)."""
    assert traces.filtered is not None
    plan = plan_of(graph)
    eps: list[dict[str, Array]] = []
    filtered: list[dict[str, Array]] = []
    out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
    backward = _backwards(jacs, signals, olds, kappa)
    parts = [
        (
            slot,
            drtrl_chunk_parts(
                slot,
                e,
                jacs.x[slot.relation],
                jacs.df[slot.relation][slot.tail],
                backward(slot.group),
                f,
                kappa,
            ),
        )
        for slot, e, f in zip(plan.slots, traces.eps, traces.filtered, strict=True)
    ]
    for (slot, part), g in zip(parts, chunk_grads(parts), strict=True):
        assert part.filtered is not None
        eps.append(part.eps)
        filtered.append(part.filtered)
        add_into(out[slot.relation], g)
    return ParamTraces(tuple(eps), tuple(filtered)), tuple(out)


def _chunk_eps(
    graph: ETraceGraph,
    eps: tuple[dict[str, Array], ...],
    jacs: StepJacobians,
    signals: Sequence[Array],
    weights: Weights,
    olds: Sequence[Array] | None,
) -> tuple[tuple[dict[str, Array], ...], EffGrads]:
    """Fused chunk for factorised slots; per-step scan for the others."""
    plan = plan_of(graph)
    out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
    backward = _backwards(jacs, signals, olds)
    traces: dict[int, dict[str, Array]] = {}
    fused: list[tuple[int, Slot, ChunkParts]] = []  # weighed together at the end
    for n, (slot, e) in enumerate(zip(plan.slots, eps, strict=True)):
        x = jacs.x[slot.relation]
        df = jacs.df[slot.relation][slot.tail]
        D = jacs.D[slot.group]
        L = signals[slot.group]
        N = None if olds is None else olds[slot.group]
        if slot.factorized:
            fused.append((n, slot, drtrl_chunk_parts(slot, e, x, df, backward(slot.group))))
            continue

        def body(carry: Any, inp: Any, _slot: Any = slot) -> Any:
            tr, acc = carry
            xt, dft, Dt, Lt, Nt = inp
            w = weights[_slot.relation]
            if Nt is not None:
                g_old = drtrl_solve(_slot, tr, Nt, w)
                acc = {k: acc[k] + g_old[k] for k in acc}
            tr = drtrl_update(_slot, tr, xt, dft, Dt, w)
            gt = drtrl_solve(_slot, tr, Lt, w)
            acc = {k: acc[k] + gt[k] for k in acc}
            return (tr, acc), None

        zeros = {k: jnp.zeros(slot.eff_shapes[k], df.dtype) for k in slot.keys}
        zero = varying_zeros(zeros, e, x, df, D, L, N)
        (traces[n], g), _ = jax.lax.scan(body, (e, zero), (x, df, D, L, N))
        add_into(out[slot.relation], g)
    weighed = chunk_grads([(slot, part) for _, slot, part in fused])
    for (n, slot, part), g in zip(fused, weighed, strict=True):
        traces[n] = part.eps
        add_into(out[slot.relation], g)
    return tuple(traces[n] for n in range(len(plan.slots))), tuple(out)


def _hoods(graph: ETraceGraph, scope: Sparse) -> list[Any]:
    return [
        neighbourhood(graph, slot.group, scope.n, scope.max_elements)
        for slot in plan_of(graph).slots
    ]


class PerParameter(TraceFactorisation[ParamTraces]):
    """A trace per weight entry and hidden state: ``ε ← D ε + x ⊗ df`` per (weight,
    group), contracted with the signal as ``Σ_a L[..., a] ε[..., a]`` (D-RTRL, e-prop).
    Memory: the weight's size times ``S`` per connected group (times the
    neighbourhood's width ``K`` under a `Sparse` scope)."""

    @property
    def label(self) -> str:
        return "per-parameter"

    @property
    def reads_transition(self) -> bool:
        return True

    @property
    def needs_point(self) -> bool:
        return False

    def validate(self, rule: LearningRule[ParamTraces]) -> None:
        if not isinstance(rule.scope, Diagonal | Coupled | Sparse):
            raise ValueError(
                f"{rule.name}: factorisation PerParameter does not support scope {rule.scope.label}"
            )

    def init(self, graph: ETraceGraph, dtype: Any, rule: LearningRule[ParamTraces]) -> ParamTraces:
        slots = plan_of(graph).slots
        if isinstance(rule.scope, Sparse):
            hoods = _hoods(graph, rule.scope)
            eps = tuple(snap_init(s, h, dtype) for s, h in zip(slots, hoods, strict=True))
            size = sum(a.size for a in jax.tree.leaves(eps))
            if size > rule.scope.max_trace_elements:
                raise CompilationError(
                    f"{rule.name}: the sparse-{rule.scope.n} traces would hold {size} elements, "
                    f"more than max_trace_elements={rule.scope.max_trace_elements}; use a "
                    "smaller n, raise the cap, or use the coupled scope"
                )
        else:
            eps = tuple(drtrl_init(s, dtype) for s in slots)
        return ParamTraces(eps, eps if isinstance(rule.filter, Kappa) else None)

    def update(
        self, graph: ETraceGraph, traces: ParamTraces, jac: StepJacobians, weights: Weights,
        rule: LearningRule[ParamTraces],
    ) -> ParamTraces:  # fmt: skip
        if isinstance(rule.scope, Sparse):
            slots = plan_of(graph).slots
            hoods = _hoods(graph, rule.scope)
            eps = tuple(
                snap_update(s, h, e, jac.x[s.relation], jac.df[s.relation][s.tail], jac.D[s.group])
                for s, h, e in zip(slots, hoods, traces.eps, strict=True)
            )
        else:
            eps = _update_eps(graph, traces.eps, jac, weights)
        if traces.filtered is None or not isinstance(rule.filter, Kappa):
            return ParamTraces(eps, None)
        kappa = rule.filter.kappa
        filtered = jax.tree.map(lambda f, e: kappa * f + e, traces.filtered, eps)
        return ParamTraces(eps, filtered)

    def eff_grads(
        self, graph: ETraceGraph, traces: ParamTraces, signals: Sequence[Array], weights: Weights,
        rule: LearningRule[ParamTraces],
    ) -> EffGrads:  # fmt: skip
        eps = traces.eps if traces.filtered is None else traces.filtered
        if not isinstance(rule.scope, Sparse):
            return _solve_eps(graph, eps, signals, weights)
        out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
        slots = plan_of(graph).slots
        for slot, hood, e in zip(slots, _hoods(graph, rule.scope), eps, strict=True):
            add_into(out[slot.relation], snap_solve(slot, hood, e, signals[slot.group]))
        return tuple(out)

    one_sample_cpu_chunk_steps: ClassVar[int] = ONE_SAMPLE_CPU_CHUNK_STEPS

    def vector_chunks(self, graph: ETraceGraph, rule: LearningRule[ParamTraces]) -> bool:
        # the fused chunk (`_chunk_eps`, `_chunk_filtered`) for every slot
        return (
            not isinstance(rule.scope, Sparse)
            and isinstance(rule.filter, NoFilter | Kappa)
            and all(slot.factorized for slot in plan_of(graph).slots)
        )

    def chunk(
        self, graph: ETraceGraph, traces: ParamTraces, jacs: StepJacobians,
        signals: Sequence[Array], weights: Weights, olds: Sequence[Array] | None,
        rule: LearningRule[ParamTraces],
    ) -> tuple[ParamTraces, EffGrads]:  # fmt: skip
        if traces.filtered is None and not isinstance(rule.scope, Sparse):
            eps, grads = _chunk_eps(graph, traces.eps, jacs, signals, weights, olds)
            return ParamTraces(eps, None), grads
        fused = all(s.factorized for s in plan_of(graph).slots)
        sparse = isinstance(rule.scope, Sparse)
        if isinstance(rule.filter, Kappa) and traces.filtered is not None and fused and not sparse:
            return _chunk_filtered(graph, traces, jacs, signals, olds, rule.filter.kappa)
        dtype = jax.tree.leaves(traces.eps)[0].dtype
        return scan_chunk(
            lambda tr, jac: self.update(graph, tr, jac, weights, rule),
            lambda tr, sig: self.eff_grads(graph, tr, sig, weights, rule),
            graph, traces, jacs, signals, dtype, olds,
        )  # fmt: skip
