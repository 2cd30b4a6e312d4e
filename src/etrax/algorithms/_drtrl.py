"""D-RTRL and e-prop: per-parameter eligibility traces with diagonal recursion."""

from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._typing import PyTree
from ..compiler import ETraceGraph
from ..executor import ModelState, StepJacobians
from ._base import (
    EffGrads,
    OnlineAlgorithm,
    Weights,
    check_chunk_steps,
    check_relations,
    scan_chunk,
)
from ._kernels import drtrl_chunk, drtrl_init, drtrl_solve, drtrl_update
from ._plan import plan_of

__all__ = ["DRTRL", "DRTRLTraces", "EProp", "EPropTraces"]


class DRTRLTraces(eqx.Module):
    """One trace dict (trainable key → array) per (relation, connected group) slot."""

    eps: tuple[dict[str, Array], ...]


def _dtype_of(state: ModelState) -> Any:
    leaves = jax.tree.leaves(state.hidden)
    return jnp.result_type(*leaves) if leaves else jnp.float32


def _weights(graph: ETraceGraph, weights: Weights | None) -> Weights:
    if weights is None:
        return tuple({} for _ in graph.hidden_param_op_relations)
    return weights


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
        acc = out[slot.relation]
        for k, v in g.items():
            acc[k] = acc[k] + v if k in acc else v
    return tuple(out)


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
    new: list[dict[str, Array]] = []
    out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
    for slot, e in zip(plan.slots, eps, strict=True):
        x = jacs.x[slot.relation]
        df = jacs.df[slot.relation][slot.tail]
        D = jacs.D[slot.group]
        L = signals[slot.group]
        N = None if olds is None else olds[slot.group]
        if slot.factorized:
            e_new, g = drtrl_chunk(slot, e, x, df, D, L, N)
        else:

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

            zero = {k: jnp.zeros(slot.eff_shapes[k], df.dtype) for k in slot.keys}
            (e_new, g), _ = jax.lax.scan(body, (e, zero), (x, df, D, L, N))
        new.append(e_new)
        acc = out[slot.relation]
        for k, v in g.items():
            acc[k] = acc[k] + v if k in acc else v
    return tuple(new), tuple(out)


class DRTRL(OnlineAlgorithm):
    """Diagonal RTRL: a per-parameter trace ``ε ← D ε + x ⊗ df`` per (weight, group),
    contracted with ``∂L/∂h`` every step.

    Exact (equal to BPTT) when every transition is position-diagonal, every tail
    element-wise, and each weight reaches later steps only through the hidden group
    it feeds (in a stacked network the upper layer's state also carries the lower
    layer's weights forward); otherwise the cross-position and cross-group terms are
    dropped.

    **Arguments:**

    - `chunk_steps`: steps the sequence driver re-associates into one fused update (the
      trace is read and written once per chunk; results equal the per-step form).
      ``1`` runs the per-step form.
    """

    chunk_steps: int = eqx.field(static=True, default=32)

    def __check_init__(self) -> None:
        check_chunk_steps("DRTRL", self.chunk_steps)

    @property
    def chunk_size(self) -> int:
        return self.chunk_steps

    def init(self, graph: ETraceGraph, state: ModelState) -> DRTRLTraces:
        check_relations(graph, "DRTRL")
        dtype = _dtype_of(state)
        return DRTRLTraces(tuple(drtrl_init(s, dtype) for s in plan_of(graph).slots))

    def update(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        jac: StepJacobians,
        weights: Weights | None = None,
    ) -> DRTRLTraces:
        return DRTRLTraces(_update_eps(graph, traces.eps, jac, _weights(graph, weights)))

    def eff_grads(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        dl_dh: Sequence[Array],
        weights: Weights | None = None,
    ) -> EffGrads:
        return _solve_eps(graph, traces.eps, dl_dh, _weights(graph, weights))

    def chunk(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        jacs: StepJacobians,
        signals: Sequence[Array],
        weights: Weights,
        olds: Sequence[Array] | None = None,
    ) -> tuple[DRTRLTraces, EffGrads]:
        eps, grads = _chunk_eps(graph, traces.eps, jacs, signals, weights, olds)
        return DRTRLTraces(eps), grads


class EPropTraces(eqx.Module):
    """D-RTRL traces plus their κ-filtered copies."""

    eps: tuple[dict[str, Array], ...]
    filtered: tuple[dict[str, Array], ...]


class EProp(OnlineAlgorithm):
    """e-prop: D-RTRL's traces, optionally low-pass filtered (``ē ← κ ē + ε``) and
    contracted with a symmetric or a fixed random learning signal.

    **Arguments:**

    - `kappa`: the filter's decay in ``[0, 1)`` (``0``: no filter, equal to `DRTRL`).
    - `feedback`: ``"symmetric"`` uses ``∂L/∂h`` itself; ``"random"`` replaces it by
      ``∂L/∂h · B`` with a fixed random matrix ``B`` per group mixing the last
      varshape axis (feedback alignment).
    - `key`: a PRNG key, required for random feedback.
    """

    kappa: float = eqx.field(static=True, default=0.0)
    feedback: Literal["symmetric", "random"] = eqx.field(static=True, default="symmetric")
    key: PRNGKeyArray | None = None

    def __check_init__(self) -> None:
        if not 0.0 <= self.kappa < 1.0:
            raise ValueError(f"EProp: kappa must be in [0, 1), got {self.kappa}")
        if self.feedback not in ("symmetric", "random"):
            raise ValueError(
                f"EProp: feedback must be 'symmetric' or 'random', got {self.feedback!r}"
            )
        if self.feedback == "random" and self.key is None:
            raise ValueError("EProp(feedback='random') needs key=jax.random.key(...)")

    @property
    def chunk_size(self) -> int:
        return 1

    def _signal(self, graph: ETraceGraph, dl_dh: Sequence[Array]) -> list[Array]:
        if self.feedback == "symmetric":
            return list(dl_dh)
        assert self.key is not None
        out = []
        for g, sig in zip(graph.hidden_groups, dl_dh, strict=True):
            width = g.varshape[-1] if g.varshape else 1
            B = jax.random.normal(
                jax.random.fold_in(self.key, g.index), (width, width), sig.dtype
            ) / jnp.sqrt(jnp.asarray(width, sig.dtype))
            out.append(jnp.einsum("...ha,hk->...ka", sig, B) if g.varshape else sig)
        return out

    def init(self, graph: ETraceGraph, state: ModelState) -> EPropTraces:
        check_relations(graph, "EProp")
        dtype = _dtype_of(state)
        eps = tuple(drtrl_init(s, dtype) for s in plan_of(graph).slots)
        return EPropTraces(eps, eps)

    def update(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        jac: StepJacobians,
        weights: Weights | None = None,
    ) -> EPropTraces:
        eps = _update_eps(graph, traces.eps, jac, _weights(graph, weights))
        filtered = jax.tree.map(lambda f, e: self.kappa * f + e, traces.filtered, eps)
        return EPropTraces(eps, filtered)

    def eff_grads(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        dl_dh: Sequence[Array],
        weights: Weights | None = None,
    ) -> EffGrads:
        return _solve_eps(
            graph, traces.filtered, self._signal(graph, dl_dh), _weights(graph, weights)
        )

    def chunk(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        jacs: StepJacobians,
        signals: Sequence[Array],
        weights: Weights,
        olds: Sequence[Array] | None = None,
    ) -> tuple[EPropTraces, EffGrads]:
        dtype = jax.tree.leaves(traces.eps)[0].dtype
        out: tuple[EPropTraces, EffGrads] = scan_chunk(
            self, graph, traces, jacs, signals, weights, dtype, olds
        )
        return out
