"""ES-D-RTRL / pp-prop: input and output traces instead of per-parameter traces."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._typing import PyTree
from ..compiler import ETraceGraph
from ..executor import ModelState, StepJacobians
from ._base import EffGrads, OnlineAlgorithm, Weights, check_relations, scan_chunk
from ._kernels import map_extra
from ._plan import plan_of

__all__ = ["ESDRTRL", "PPProp", "PPTraces"]


class PPTraces(eqx.Module):
    """pp-prop traces.

    **Arguments:**

    - `x`: per relation, the low-pass filtered input (`None` for ops without one).
    - `f`: per (relation, group) slot, the output trace ``(*varshape, S)``.
    - `count`: how many trace steps have been taken (drives the bias correction).
    """

    x: tuple[Array | None, ...]
    f: tuple[Array, ...]
    count: Int[Array, ""]


def _decay_from(decay: float | int) -> float:
    if isinstance(decay, bool):
        raise TypeError("PPProp: decay must be a float in [0, 1) or an integer rank >= 1")
    if isinstance(decay, int):
        if decay < 1:
            raise ValueError(f"PPProp: an integer rank must be >= 1, got {decay}")
        return (decay - 1) / (decay + 1)
    return float(decay)


class PPProp(OnlineAlgorithm):
    """ES-D-RTRL (pp-prop): ``ε_x ← a ε_x + x``, ``ε_f ← a (D ⊛ ε_f) + (1 − a) df``, and
    the gradient ``contract(ε_x, Σ_a ε_f[a] L[a] / c)`` through one VJP-like
    contraction, with memory ``O(I + O)`` per relation.

    The bias correction ``c = 1 − a^n`` counts trace steps ``n`` (not calls), so it is
    right under windows too. Exact at the first step; an approximation afterwards.

    **Arguments:**

    - `decay`: ``a`` in ``[0, 1)``; an integer rank ``r ≥ 1`` means ``a = (r − 1)/(r + 1)``.
    """

    decay: float = eqx.field(static=True, default=0.9, converter=_decay_from)

    def __check_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"PPProp: decay must be in [0, 1), got {self.decay}")

    @property
    def chunk_size(self) -> int:
        return 1

    def init(self, graph: ETraceGraph, state: ModelState) -> PPTraces:
        check_relations(graph, "PPProp")
        leaves = jax.tree.leaves(state.hidden)
        dtype = jnp.result_type(*leaves) if leaves else jnp.float32
        plan = plan_of(graph)
        xs: list[Array | None] = []
        for rel in graph.hidden_param_op_relations:
            xs.append(None if rel.x_shape is None else jnp.zeros(rel.x_shape, dtype))
        fs = tuple(jnp.zeros((*s.varshape, s.num_state), dtype) for s in plan.slots)
        return PPTraces(tuple(xs), fs, jnp.zeros((), jnp.int32))

    def update(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        jac: StepJacobians,
        weights: Weights | None = None,
    ) -> PPTraces:
        a = self.decay
        plan = plan_of(graph)
        ws = weights if weights is not None else [{} for _ in graph.hidden_param_op_relations]
        xs: list[Array | None] = []
        for rel, ex, x in zip(graph.hidden_param_op_relations, traces.x, jac.x, strict=True):
            if ex is None or x is None:
                xs.append(None)
                continue
            rules = rel.spec.rules
            assert rules is not None
            xs.append(a * ex + rules.input_repr(x, ws[rel.index], rel.params))
        fs = []
        for slot, ef in zip(plan.slots, traces.f, strict=True):
            D = jac.D[slot.group]
            df = jac.df[slot.relation][slot.tail]
            fs.append(a * jnp.einsum("...ac,...c->...a", D, ef) + (1.0 - a) * df)
        return PPTraces(tuple(xs), tuple(fs), traces.count + 1)

    def eff_grads(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        dl_dh: Sequence[Array],
        weights: Weights | None = None,
    ) -> EffGrads:
        plan = plan_of(graph)
        ws = weights if weights is not None else [{} for _ in graph.hidden_param_op_relations]
        a = self.decay
        out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
        for slot, ef in zip(plan.slots, traces.f, strict=True):
            L = dl_dh[slot.group]
            n = jnp.maximum(traces.count, 1).astype(ef.dtype)
            correction = 1.0 - jnp.asarray(a, ef.dtype) ** n
            m = jnp.sum(ef * L, axis=-1) / jnp.maximum(correction, 1e-12)
            ex = traces.x[slot.relation]
            rules = slot.rules
            w = ws[slot.relation]

            def one(sig: Array, _ex: Any = ex, _r: Any = rules, _w: Any = w, _s: Any = slot) -> Any:
                return _r.contract(_ex, sig, _w, _s.params)

            g = map_extra(slot, one, (m,), reduce=True)
            acc = out[slot.relation]
            for k, v in g.items():
                acc[k] = acc[k] + v if k in acc else v
        return tuple(out)

    def chunk(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        jacs: StepJacobians,
        signals: Sequence[Array],
        weights: Weights,
        olds: Sequence[Array] | None = None,
    ) -> tuple[PPTraces, EffGrads]:
        dtype = traces.f[0].dtype
        out: tuple[PPTraces, EffGrads] = scan_chunk(
            self, graph, traces, jacs, signals, weights, dtype, olds
        )
        return out


ESDRTRL = PPProp
"""Alias of `PPProp` (exponentially smoothed D-RTRL)."""
