"""The input/output trace factorisation (ES-D-RTRL, pp-prop): an input trace per op
and an output trace per (op, group), with memory ``O(I + O)`` per relation."""

import numbers
import operator
from collections.abc import Sequence
from typing import Any, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, ScalarLike

from .._typing import PyTree
from ..compiler import ETraceGraph
from ..executor import StepJacobians
from ._axes import Coupled, Diagonal, NoFilter
from ._base import EffGrads, Weights, add_into, concrete_number, scan_chunk
from ._kernels import map_extra, matvec, short_sum
from ._plan import direct_routes, plan_of
from ._rule import LearningRule, TraceFactorisation

__all__ = ["IOTraces", "InputOutput", "decay_from", "steps_from"]


class IOTraces(eqx.Module):
    """Input/output traces.

    **Arguments:**

    - `x`: per relation, the low-pass filtered input (`None` for ops without one).
    - `f`: per (relation, group) slot, the output trace ``(*varshape, S)``.
    - `count`: how many trace steps have been taken (drives the bias correction).
    """

    x: tuple[Array | None, ...]
    f: tuple[Array, ...]
    count: Int[Array, ""]


def _scalar(value: object) -> object:
    """A 0-d NumPy or JAX array as its Python scalar; anything else unchanged. A traced
    value (a rule built inside `jax.jit` or `jax.vmap` from a traced number) is a
    `TypeError`: these settings are static, one compiled program per value."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            "PPProp: decay and chunk_steps must be concrete Python or NumPy numbers, not "
            "traced values: they are static (one compiled program per value). Build the "
            "rule outside jax.jit / jax.vmap, e.g. one rule per decay in a Python loop."
        )
    return concrete_number(value)


def decay_from(decay: ScalarLike) -> float:
    """`decay` as a Python float: an integer rank ``r`` (a Python or NumPy integer, or a
    0-d integer array) becomes ``(r − 1)/(r + 1)``; a real number is taken as is."""
    value = _scalar(decay)
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(
            "PPProp: decay must be a float in [0, 1) or an integer rank >= 1 (Python or "
            f"NumPy numbers), got {type(decay).__name__} {decay!r}"
        )
    if isinstance(value, numbers.Integral):
        rank = int(value)
        if rank < 1:
            raise ValueError(f"PPProp: an integer rank must be >= 1, got {rank}")
        return (rank - 1) / (rank + 1)
    return float(value)


def steps_from(steps: SupportsIndex) -> int:
    """`chunk_steps` as a Python int (NumPy integers accepted)."""
    if isinstance(steps, bool | np.bool_) or not isinstance(_scalar(steps), numbers.Integral):
        raise TypeError(
            "chunk_steps must be a positive int (Python or NumPy integer) or None, got "
            f"{type(steps).__name__} {steps!r}"
        )
    return operator.index(steps)


class InputOutput(TraceFactorisation[IOTraces]):
    """An input trace ``ε_x ← a ε_x + x`` per op and an output trace
    ``ε_f ← a (D ⊛ ε_f) + (1 − a) df`` per (op, group); the gradient is
    ``contract(ε_x, Σ_a ε_f[a] L[a] / c)`` through one VJP-like contraction
    (ES-D-RTRL / pp-prop). The bias correction ``c = 1 − a^n`` counts trace steps
    ``n`` (not calls), so it is right under windows too. Exact at the first step; an
    approximation afterwards.

    **Arguments:**

    - `decay`: ``a`` in ``[0, 1)``; an integer rank ``r ≥ 1`` means ``a = (r − 1)/(r + 1)``.
      Python or NumPy numbers are accepted and stored as a Python ``float``; strings
      and bools are refused with a `TypeError`.
    """

    decay: float = eqx.field(static=True)

    def __init__(self, decay: ScalarLike = 0.9) -> None:
        # NumPy numbers become Python ones, so equal settings share one jit cache entry.
        self.decay = decay_from(decay)

    def __check_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"PPProp / InputOutput: decay must be in [0, 1), got {self.decay}")

    @property
    def label(self) -> str:
        return "input/output"

    @property
    def reads_transition(self) -> bool:
        return True

    @property
    def needs_point(self) -> bool:
        return False

    def validate(self, rule: LearningRule[IOTraces]) -> None:
        if not isinstance(rule.scope, Diagonal | Coupled):
            raise ValueError(
                f"{rule.name}: factorisation InputOutput has one output trace per position, so "
                f"it supports the diagonal and coupled scopes, not {rule.scope.label} (axes "
                "factorisation and scope)"
            )
        if not isinstance(rule.filter, NoFilter):
            raise ValueError(
                f"{rule.name}: a trace filter needs per-parameter traces (axes factorisation "
                "InputOutput and filter Kappa); the output trace is already low-pass filtered"
            )

    def init(self, graph: ETraceGraph, dtype: Any, rule: LearningRule[IOTraces]) -> IOTraces:
        plan = plan_of(graph)
        xs: list[Array | None] = []
        for rel, x_struct in zip(graph.hidden_param_op_relations, plan.x_structs, strict=True):
            rules = rel.spec.rules
            if x_struct is None or rules is None:
                xs.append(None)
                continue
            shape = jax.eval_shape(
                lambda v, r=rules, p=rel.params: r.input_repr(v, {}, p), x_struct
            )
            xs.append(jnp.zeros(shape.shape, dtype))
        fs = tuple(jnp.zeros((*s.varshape, s.num_state), dtype) for s in plan.slots)
        return IOTraces(tuple(xs), fs, jnp.zeros((), jnp.int32))

    def update(
        self, graph: ETraceGraph, traces: IOTraces, jac: StepJacobians, weights: Weights,
        rule: LearningRule[IOTraces],
    ) -> IOTraces:  # fmt: skip
        a = self.decay
        plan = plan_of(graph)
        xs: list[Array | None] = []
        for rel, ex, x in zip(graph.hidden_param_op_relations, traces.x, jac.x, strict=True):
            if ex is None or x is None:
                xs.append(None)
                continue
            rules = rel.spec.rules
            assert rules is not None
            xs.append(a * ex + rules.input_repr(x, weights[rel.index], rel.params))
        fs = []
        for slot, ef in zip(plan.slots, traces.f, strict=True):
            D = jac.D[slot.group]
            df = jac.df[slot.relation][slot.tail]
            mixed = matvec(D, ef)  # D ⊛ ε_f
            fs.append(a * mixed + (1.0 - a) * df)
        return IOTraces(tuple(xs), tuple(fs), traces.count + 1)

    def _signal(self, traces: IOTraces, k: int, L: Array) -> Array:
        """``Σ_a ε_f[a] L[a] / c`` for slot ``k``, with the bias correction ``c``."""
        return self._corrected(traces.f[k], L, traces.count)

    def _corrected(self, ef: Array, L: Array, count: Array) -> Array:
        """``Σ_a ε_f[a] L[a] / c`` with ``c = 1 − a^n`` for ``n = max(count, 1)`` trace
        steps; with stacked steps (leading axis), `count` holds each step's."""
        n = jnp.maximum(count, 1).astype(ef.dtype)
        correction = 1.0 - jnp.asarray(self.decay, ef.dtype) ** n
        summed = short_sum(ef * L)
        correction = correction.reshape(correction.shape + (1,) * (summed.ndim - n.ndim))
        return summed / jnp.maximum(correction, 1e-12)

    def _slot_grads(
        self, traces: IOTraces, k: int, slot: Any, L: Array, weights: Weights
    ) -> dict[str, Array]:
        m = self._signal(traces, k, L)
        ex = traces.x[slot.relation]
        rules = slot.rules
        w = weights[slot.relation]
        out: dict[str, Array] = map_extra(
            slot, lambda sig: rules.contract(ex, sig, w, slot.params), (m,), reduce=True
        )
        return out

    def eff_grads(
        self, graph: ETraceGraph, traces: IOTraces, signals: Sequence[Array], weights: Weights,
        rule: LearningRule[IOTraces],
    ) -> EffGrads:  # fmt: skip
        plan = plan_of(graph)
        out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
        for k, slot in enumerate(plan.slots):
            g = self._slot_grads(traces, k, slot, signals[slot.group], weights)
            add_into(out[slot.relation], g)
        return tuple(out)

    def vector_chunks(self, graph: ETraceGraph, rule: LearningRule[IOTraces]) -> bool:
        # every slot's contraction stacked (`stream_finish`), none on old hidden values
        return not direct_routes(graph) and all(_stacked(s) for s in plan_of(graph).slots)

    def streams(self, graph: ETraceGraph, rule: LearningRule[IOTraces]) -> bool:
        return any(_stacked(s) for s in plan_of(graph).slots)

    def stream_out(
        self, graph: ETraceGraph, traces: IOTraces, signals: Sequence[Array], weights: Weights,
        rule: LearningRule[IOTraces],
    ) -> tuple[EffGrads, PyTree]:  # fmt: skip
        """The slots that are not factorised contract at once; the factorised ones keep
        their signal ``Σ_a ε_f[a] L[a] / c`` and, once per relation, the input trace.
        On one sample (`_late_signals`) they keep their output trace ``ε_f`` instead,
        and each of their groups its ``L``, for `stream_finish` to form the signals
        over the stacked steps: the vectors join the step's one packed buffer write,
        and the step runs no kernel for the signals nor for the bias correction ``c``
        (with a batch, the extra stacked ``L`` costs more than those kernels)."""
        plan = plan_of(graph)
        late = _late_signals(plan.slots)
        now: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
        kept: list[Array] = []
        for k, slot in enumerate(plan.slots):
            if not _stacked(slot):
                g = self._slot_grads(traces, k, slot, signals[slot.group], weights)
                add_into(now[slot.relation], g)
            elif late:
                kept.append(traces.f[k])
            else:
                kept.append(self._signal(traces, k, signals[slot.group]))
        groups = {s.group for s in plan.slots if _stacked(s)} if late else set()
        Ls = tuple(L if g in groups else None for g, L in enumerate(signals))
        inputs = {s.relation for s in plan.slots if _stacked(s)}
        xs = tuple(x if r in inputs else None for r, x in enumerate(traces.x))
        return tuple(now), (tuple(kept), Ls, xs)

    def stream_finish(
        self, graph: ETraceGraph, traces: IOTraces, saved: PyTree, weights: Weights,
        rule: LearningRule[IOTraces],
    ) -> EffGrads:  # fmt: skip
        kept, Ls, xs = saved
        out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
        slots = plan_of(graph).slots
        stacked = [s for s in slots if _stacked(s)]
        counts = None
        if _late_signals(slots) and kept:  # kept holds each slot's stacked ε_f
            K = kept[0].shape[0]  # each step's count, after its update
            counts = traces.count - (K - 1) + jnp.arange(K, dtype=traces.count.dtype)
        for slot, m in zip(stacked, kept, strict=True):
            if counts is not None:
                m = self._corrected(m, Ls[slot.group], counts)
            add_into(out[slot.relation], _stacked_contract(slot, xs[slot.relation], m))
        return tuple(out)

    def chunk(
        self, graph: ETraceGraph, traces: IOTraces, jacs: StepJacobians,
        signals: Sequence[Array], weights: Weights, olds: Sequence[Array] | None,
        rule: LearningRule[IOTraces],
    ) -> tuple[IOTraces, EffGrads]:  # fmt: skip
        """K steps at once: the traces advance step by step, but the contractions
        of factorised slots run as one matrix product over the stacked steps (the
        same sum, with K times more rows per product)."""
        dtype = traces.f[0].dtype
        plan = plan_of(graph)
        fast = [_stacked(s) for s in plan.slots]
        if olds is not None or not any(fast):
            return scan_chunk(
                lambda tr, jac: self.update(graph, tr, jac, weights, rule),
                lambda tr, sig: self.eff_grads(graph, tr, sig, weights, rule),
                graph, traces, jacs, signals, dtype, olds,
            )  # fmt: skip

        def body(tr: IOTraces, inp: Any) -> Any:
            jac, sig = inp
            tr = self.update(graph, tr, jac, weights, rule)
            ms = [
                self._signal(tr, k, sig[s.group]) if fast[k] else None
                for k, s in enumerate(plan.slots)
            ]
            slow = [  # the other slots' gradients, step by step
                None if fast[k] else self._slot_grads(tr, k, s, sig[s.group], weights)
                for k, s in enumerate(plan.slots)
            ]
            return tr, (ms, tr.x, slow)

        traces, (ms, xs, slow) = jax.lax.scan(body, traces, (jacs, tuple(signals)))
        grads: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
        for k, slot in enumerate(plan.slots):
            if fast[k]:
                g = _stacked_contract(slot, xs[slot.relation], ms[k])
            else:  # its per-step gradients, summed over the chunk
                g = {key: jnp.sum(v, axis=0) for key, v in slow[k].items()}
            add_into(grads[slot.relation], g)
        return traces, tuple(grads)


def _late_signals(slots: Sequence[Any]) -> bool:
    """Whether a streamed chunk forms its factorised slots' signals at its end, from
    the stacked output traces and learning signals (`InputOutput.stream_out`): when
    every factorised slot runs on one sample. Per step at GRU 128/1 (2-core CPU):
    29 kernels instead of 32, 0.94–1.02× braintrace's time against 1.01–1.25×; at
    batch 32 the stacked signal is a buffer write of its own, 1.18× against 1.10."""
    return all(s.nb == 1 for s in slots if _stacked(s))


def _stacked(slot: Any) -> bool:
    """Whether a slot's contraction runs as one product over a chunk's stacked steps
    (a factorised operand without extra per-step factors)."""
    return bool(slot.factorized and not slot.extra)


def _stacked_contract(slot: Any, xs: Array | None, ms: Array) -> dict[str, Array]:
    """``Σ_k contract(x_k, m_k)`` for a factorised slot, as one product over steps."""
    assert slot.rules.factor is not None
    fac = slot.rules.factor(None if xs is None else xs[0], slot.params)
    out: dict[str, Array] = {}
    cot = ms.reshape(-1, slot.out)  # (K · op batch, O)
    for key in slot.keys:
        shape = tuple(slot.eff_shapes[key])
        if fac.inputs[key] is None:
            out[key] = jnp.sum(cot, axis=0).reshape(shape)
        else:
            assert xs is not None
            u = jax.vmap(lambda v, k=key: slot.rules.factor(v, slot.params).inputs[k])(xs)
            u = u.reshape(-1, u.shape[-1])  # (K · op batch, I)
            out[key] = (u.T @ cot).reshape(shape)
    return out
