"""`LearningRule`: an online learning rule as a point on independent axes.

A rule is the product of five choices (see `_axes.py`): how traces are factorised,
how they recur in time, which part of the transition they follow, what they are
contracted with, and whether they are filtered. The presets (`DRTRL`, `PPProp`,
`EProp`, …) are rules with fixed coordinates; a new rule is a new point, not a new
class.
"""

import abc
import functools
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, SupportsIndex, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._compat import at_top_level, constant_outputs
from .._typing import PyTree
from ..compiler import ETraceGraph
from ..executor import ModelState, StepJacobians, fast_check_state, require_graph
from ._axes import (
    Diagonal,
    Filter,
    Jacobian,
    NoFilter,
    Recursion,
    Scope,
    Signal,
    Signals,
    Symmetric,
    as_dtype,
)
from ._base import (
    DEFAULT_CHUNK_STEPS,
    EffGrads,
    OnlineAlgorithm,
    Weights,
    as_int,
    check_chunk_steps,
    check_relations,
    default_chunk_steps,
)
from ._plan import plan_of

__all__ = ["LearningRule", "TraceFactorisation"]

TraceT = TypeVar("TraceT")


class TraceFactorisation(eqx.Module, Generic[TraceT]):
    """How the eligibility traces are stored, and the engine that runs them.

    Every method receives the whole rule, whose other axes it honours; the rule has
    already replaced each group's ``D`` by its recursion's transition.
    """

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """A short name for reports and errors."""

    @property
    @abc.abstractmethod
    def needs_point(self) -> bool:
        """Whether the engine needs each step's `StepPoint` (e.g. for JVPs)."""

    @property
    @abc.abstractmethod
    def reads_transition(self) -> bool:
        """Whether the engine reads each group's transition ``D`` (as shaped by the
        scope); one that applies the whole transition itself does not."""

    @abc.abstractmethod
    def validate(self, rule: "LearningRule[TraceT]") -> None:
        """Raise `ValueError` naming the axes if `rule`'s other coordinates do not
        combine with this factorisation."""

    @abc.abstractmethod
    def init(self, graph: ETraceGraph, dtype: Any, rule: "LearningRule[TraceT]") -> TraceT:
        """Zero traces stored in `dtype`."""

    @abc.abstractmethod
    def update(
        self, graph: ETraceGraph, traces: TraceT, jac: StepJacobians, weights: Weights,
        rule: "LearningRule[TraceT]",
    ) -> TraceT:  # fmt: skip
        """One step of the recursion (traces in the compute dtype)."""

    @abc.abstractmethod
    def eff_grads(
        self, graph: ETraceGraph, traces: TraceT, signals: Sequence[Array], weights: Weights,
        rule: "LearningRule[TraceT]",
    ) -> EffGrads:  # fmt: skip
        """Effective-operand gradients of the traces contracted with `signals`."""

    @abc.abstractmethod
    def chunk(
        self, graph: ETraceGraph, traces: TraceT, jacs: StepJacobians, signals: Sequence[Array],
        weights: Weights, olds: Sequence[Array] | None, rule: "LearningRule[TraceT]",
    ) -> tuple[TraceT, EffGrads]:  # fmt: skip
        """`OnlineAlgorithm.chunk` for this factorisation."""

    one_sample_cpu_chunk_steps: ClassVar[int] = DEFAULT_CHUNK_STEPS
    """The chunk length of ``chunk_steps=None`` on the CPU for a model run on one
    sample (`default_chunk_steps`)."""

    def vector_chunks(self, graph: ETraceGraph, rule: "LearningRule[TraceT]") -> bool:
        """Whether this factorisation's `chunk` (or streamed chunk) of `rule` on `graph`
        leaves only work of the size of the hidden states and inputs to each step, every
        trace-sized term running once per chunk (`OnlineAlgorithm.vector_steps`);
        `False` unless the factorisation says so."""
        return False

    def streams(self, graph: ETraceGraph, rule: "LearningRule[TraceT]") -> bool:
        """Whether chunks are streamed (`OnlineAlgorithm.streams`); `False` unless the
        factorisation keeps work for `stream_finish`."""
        return False

    def stream_out(
        self, graph: ETraceGraph, traces: TraceT, signals: Sequence[Array], weights: Weights,
        rule: "LearningRule[TraceT]",
    ) -> tuple[EffGrads, PyTree]:  # fmt: skip
        """For traces just updated (in the compute dtype): the gradients formed at once
        and what is stacked over the chunk for `stream_finish`. By default every
        gradient is formed at once (`eff_grads`) and nothing is kept."""
        return self.eff_grads(graph, traces, signals, weights, rule), ()

    def stream_finish(
        self, graph: ETraceGraph, traces: TraceT, saved: PyTree, weights: Weights,
        rule: "LearningRule[TraceT]",
    ) -> EffGrads:  # fmt: skip
        """The gradients left to `stream_out`'s stacked outputs (with the `traces` after
        the chunk's last step); none by default."""
        return tuple({} for _ in graph.hidden_param_op_relations)


def _cast_leaf(a: Any, dtype: Any) -> Any:
    if a is None or not jnp.issubdtype(jnp.result_type(a), jnp.floating):
        return a
    return a.astype(dtype)


def _cast(tree: Any, dtype: Any) -> Any:
    """Every floating leaf of `tree` in `dtype` (integer counters unchanged)."""
    return jax.tree.map(functools.partial(_cast_leaf, dtype=dtype), tree)


# the default coordinates (immutable Modules, shared)
_JACOBIAN, _DIAGONAL, _SYMMETRIC, _NO_FILTER = Jacobian(), Diagonal(), Symmetric(), NoFilter()


class LearningRule(OnlineAlgorithm[TraceT]):
    """An online learning rule: one point on the axes of trace factorisation, temporal
    recursion, recurrence scope, learning signal and trace filter.

    Build one directly or start from a preset (`DRTRL`, `PPProp`, `EProp`,
    `OSTLFeedforward`, `ThreeFactor`, …) and `eqx.tree_at` a coordinate. An invalid
    combination is a `ValueError` at construction that names the conflicting axes.

    **Arguments:**

    - `factorisation`: `PerParameter()` (a trace per weight entry, D-RTRL) or
      `InputOutput(decay)` (an input and an output trace per op, pp-prop).
    - `recursion`: `Jacobian()` (default), `ScalarLeak(decay)` or `NoRecursion()`.
    - `scope`: `Diagonal()` (default).
    - `signal`: `Symmetric()` (default), `RandomFeedback(key)` or `Modulatory()`.
    - `filter`: `NoFilter()` (default) or `Kappa(kappa)` (per-parameter traces only).
    - `chunk_steps`: steps the sequence driver re-associates into one fused update
      (equal results; ``1`` is the per-step form); at most this many, see `DRTRL`.
      `None`: chosen per graph and device (`default_chunk_steps`).
    - `trace_dtype`: the dtype traces are stored in (e.g. ``"bfloat16"``); the
      recursion and contractions compute in the model's dtype. `None`: the model's.
    - `name`: the name shown in errors and reports (the presets set it).
    """

    factorisation: TraceFactorisation[TraceT]
    recursion: Recursion
    scope: Scope
    signal: Signal
    filter: Filter
    chunk_steps: int | None = eqx.field(static=True)
    trace_dtype: str | None = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(
        self,
        factorisation: TraceFactorisation[TraceT],
        recursion: Recursion = _JACOBIAN,
        scope: Scope = _DIAGONAL,
        signal: Signal = _SYMMETRIC,
        filter: Filter = _NO_FILTER,  # the axis's name
        *,
        chunk_steps: SupportsIndex | None = 1,
        trace_dtype: Any = None,
        name: str = "LearningRule",
    ) -> None:
        self.factorisation = factorisation
        self.recursion = recursion
        self.scope = scope
        self.signal = signal
        self.filter = filter
        steps: Any = as_int(chunk_steps)  # a NumPy integer is an int; __check_init__ checks
        self.chunk_steps = steps
        self.trace_dtype = as_dtype(trace_dtype, name)
        self.name = name

    def __check_init__(self) -> None:
        axes: tuple[tuple[str, object, type], ...] = (
            ("factorisation", self.factorisation, TraceFactorisation),
            ("recursion", self.recursion, Recursion),
            ("scope", self.scope, Scope),
            ("signal", self.signal, Signal),
            ("filter", self.filter, Filter),
        )
        for axis, value, kind in axes:
            if not isinstance(value, kind):
                raise TypeError(
                    f"{self.name}: {axis} must be an etrax {kind.__name__} "
                    f"(e.g. {_EXAMPLES[axis]}), got {value!r}"
                )
        check_chunk_steps(self.name, self.chunk_steps)
        if not isinstance(self.scope, Diagonal) and not isinstance(self.recursion, Jacobian):
            raise ValueError(
                f"{self.name}: a {self.scope.label} scope follows the true transition, so it "
                "needs the Jacobian recursion (axes recursion and scope)"
            )
        self.factorisation.validate(self)

    # --- OnlineAlgorithm ---------------------------------------------------------------

    @property
    def chunk_size(self) -> int:
        return DEFAULT_CHUNK_STEPS if self.chunk_steps is None else self.chunk_steps

    def chunk_for(self, graph: ETraceGraph) -> int:
        if self.chunk_steps is not None:
            return self.chunk_steps
        return default_chunk_steps(graph, self.factorisation.one_sample_cpu_chunk_steps)

    def vector_steps(self, graph: ETraceGraph) -> bool:
        # a weight with uses in and out of the traced products adds a per-step term
        return (
            self.chunk_for(graph) > 1
            and not plan_of(graph).overlap
            and self.factorisation.vector_chunks(graph, self)
        )

    @property
    def needs_modulator(self) -> bool:
        return self.signal.needs_modulator

    @property
    def needs_point(self) -> bool:
        return self.scope.needs_point or self.factorisation.needs_point

    @property
    def synthetic_rate(self) -> float | None:
        return self.signal.synthetic_rate

    @property
    def symmetric(self) -> bool:
        return self.signal.symmetric

    def _store(self, compute: Any) -> Any:
        return compute if self.trace_dtype is None else jnp.dtype(self.trace_dtype)

    def init(self, graph: ETraceGraph, state: ModelState) -> TraceT:
        require_graph(graph, f"{self.name}.init")
        state = fast_check_state(graph, state)
        check_relations(graph, self.name)
        if self.factorisation.reads_transition:
            self.scope.check(graph)
        leaves = jax.tree.leaves(state.hidden)
        compute = jnp.result_type(*leaves) if leaves else jnp.float32
        store = self._store(compute)

        def zeros() -> TraceT:
            return self.factorisation.init(graph, store, self)

        if at_top_level():  # eager: the zero traces are made without an XLA program
            folded: TraceT | None = constant_outputs(zeros)
            if folded is not None:
                return folded
        return zeros()

    def update(
        self, graph: ETraceGraph, traces: TraceT, jac: StepJacobians, weights: Weights | None = None
    ) -> TraceT:
        compute = _jac_dtype(jac)
        up = _cast(traces, compute)
        if self.factorisation.reads_transition:
            # the recursion acts on the per-position D; a non-diagonal scope (which
            # needs the Jacobian recursion) then replaces D by its own transition
            jac = self.scope.transitions(graph, self.recursion.apply(jac))
        new = self.factorisation.update(graph, up, jac, _weights(graph, weights), self)
        return _cast(new, self._store(compute))  # type: ignore[no-any-return]

    def eff_grads(
        self,
        graph: ETraceGraph,
        traces: TraceT,
        dl_dh: Sequence[Array],
        weights: Weights | None = None,
    ) -> EffGrads:
        compute = jnp.result_type(*dl_dh) if dl_dh else jnp.float32
        return self.factorisation.eff_grads(
            graph, _cast(traces, compute), dl_dh, _weights(graph, weights), self
        )

    def chunk(
        self,
        graph: ETraceGraph,
        traces: TraceT,
        jacs: StepJacobians,
        signals: Sequence[Array],
        weights: Weights,
        olds: Sequence[Array] | None = None,
    ) -> tuple[TraceT, EffGrads]:
        compute = _jac_dtype(jacs)
        if self.factorisation.reads_transition:
            jacs = self.recursion.apply(jacs)
            if self.scope.needs_point:
                jacs = jax.vmap(lambda j: self.scope.transitions(graph, j))(jacs)
        new, grads = self.factorisation.chunk(
            graph, _cast(traces, compute), jacs, signals, weights, olds, self
        )
        return _cast(new, self._store(compute)), grads

    def streams(self, graph: ETraceGraph) -> bool:
        return self.factorisation.streams(graph, self)

    def stream_out(
        self, graph: ETraceGraph, traces: TraceT, signals: Sequence[Array], weights: Weights
    ) -> tuple[EffGrads, PyTree]:
        # the factorisation forms some contractions now and stacks the others
        compute = jnp.result_type(*signals) if signals else jnp.float32
        return self.factorisation.stream_out(
            graph, _cast(traces, compute), signals, _weights(graph, weights), self
        )

    def stream_finish(
        self, graph: ETraceGraph, traces: TraceT, saved: PyTree, weights: Weights
    ) -> EffGrads:
        return self.factorisation.stream_finish(
            graph, traces, saved, _weights(graph, weights), self
        )

    def learning_signals(
        self,
        graph: ETraceGraph,
        dl_dh: tuple[Array, ...],
        olds: tuple[Array, ...],
        dl_dy: PyTree,
        modulator: PyTree | None,
    ) -> Signals:
        return self.signal.signals(graph, dl_dh, olds, dl_dy, modulator)


_EXAMPLES = {
    "factorisation": "etrax.PerParameter()",
    "recursion": "etrax.Jacobian()",
    "scope": "etrax.Diagonal()",
    "signal": "etrax.Symmetric()",
    "filter": "etrax.NoFilter()",
}


def _jac_dtype(jac: StepJacobians) -> Any:
    leaves = jax.tree.leaves(jac.D) or jax.tree.leaves(jac.df)
    return jnp.result_type(*leaves) if leaves else jnp.float32


def _weights(graph: ETraceGraph, weights: Weights | None) -> Weights:
    if weights is None:
        return tuple({} for _ in graph.hidden_param_op_relations)
    return weights
