"""The online-algorithm interface."""

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._compat import match_varying
from .._errors import CompilationError
from .._pathdict import PathDict
from .._typing import Path, PyTree
from ..compiler import DiagnosticKind, ETraceGraph
from ..compiler._report import untraceable_hidden_paths
from ..executor import ModelState, StepJacobians
from ._plan import plan_of
from ._weights import operand_values, operands_to_params

__all__ = [
    "DEFAULT_CHUNK_STEPS",
    "ONE_SAMPLE_CPU_CHUNK_STEPS",
    "EffGrads",
    "OnlineAlgorithm",
    "Weights",
    "check_chunk_steps",
    "check_relations",
    "default_chunk_steps",
    "zeros_eff",
]

EffGrads = tuple[dict[str, Array], ...]
"""Gradients with respect to each relation's effective trainable operands."""

Weights = Sequence[Mapping[str, Array]]
"""Each relation's trainable operand values (`operand_values(graph, params)`)."""


def concrete_number(value: object) -> object:
    """A concrete 0-d NumPy or JAX array of numbers as its Python number (a setting given
    as an array); anything else, a traced value included, unchanged."""
    if (
        isinstance(value, np.ndarray | jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and value.shape == ()
        and jnp.issubdtype(value.dtype, jnp.number)
    ):
        return value.item()
    return value


def as_int(value: object) -> object:
    """`value` as a Python int when it is an integer setting given another way (a NumPy
    integer, a concrete 0-d integer array); anything else unchanged (for the caller's
    check to refuse)."""
    if isinstance(value, bool | np.bool_):
        return value
    if isinstance(value, np.integer):
        return int(value)
    number = concrete_number(value)
    return number if isinstance(number, int) and not isinstance(number, bool) else value


def check_chunk_steps(name: str, steps: object) -> None:
    """Raise `ValueError` unless `steps` (an algorithm's ``chunk_steps``) is a positive
    int or `None` (`default_chunk_steps` then picks it per graph)."""
    if steps is None:
        return
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise TypeError(
            f"{name}: chunk_steps must be a positive int (Python or NumPy integer) or None, "
            f"got {type(steps).__name__} {steps!r}"
        )
    if steps < 1:
        raise ValueError(f"{name}: chunk_steps must be a positive int or None, got {steps!r}")


DEFAULT_CHUNK_STEPS = 32
"""The chunk length of the chunked presets (`DRTRL`, `PPProp`, `EProp`) where
`default_chunk_steps` does not pick the per-step form."""


ONE_SAMPLE_CPU_CHUNK_STEPS = 64
"""The chunk length `default_chunk_steps` gives the per-parameter rules (`DRTRL`,
`EProp`) on the CPU when every traced op runs on one sample."""


def default_chunk_steps(graph: ETraceGraph, one_sample_cpu: int = DEFAULT_CHUNK_STEPS) -> int:
    """The chunk length a rule with ``chunk_steps=None`` runs `graph` with:
    `DEFAULT_CHUNK_STEPS`, but for a graph whose every traced op runs on one sample
    (no batch, or a batch of 1), which runs chunks of `one_sample_cpu` steps on the
    CPU and the per-step form (``1``) on an accelerator (the default JAX backend is
    not the CPU).

    On an accelerator a step is a few kernel launches, and a chunk's stacking writes
    add more than its stacked products save (on an H200, one GRU layer of 128 or 512
    units at batch 1: D-RTRL 30.5 → 19.4 µs per step, e-prop 32.0 → 21.2; at batch 32
    the chunks win: D-RTRL 42.1 → 35.5 at 128 units, 123 → 49 at 512; on a 2-core CPU
    they win at batch 1 too: D-RTRL 23.4 → 13.8 at 128 units). On the CPU a chunk's
    fixed work (its stacked products' launches, the buffers it zeroes) weighs more on
    one sample, and the per-parameter rules ask for `ONE_SAMPLE_CPU_CHUNK_STEPS`: on a
    2-core CPU, 64 steps against 32 took 0.62–0.96 of the time per step over GRU
    (1 and 2 layers, 128–2,048 units), LSTM, LIF and ALIF models at batch 1 for D-RTRL
    and e-prop (``T`` = 256); pp-prop keeps 32 (0.90–1.12 there)."""
    slots = plan_of(graph).slots
    one = not any(slot.nb > 1 for slot in slots)
    if jax.default_backend() == "cpu":
        return one_sample_cpu if one else DEFAULT_CHUNK_STEPS
    return 1 if one else DEFAULT_CHUNK_STEPS


def loop_hint(graph: ETraceGraph) -> str:
    """Advice for a graph with no relations whose step kept loops whole (their weights
    are not traced); empty otherwise."""
    loops = graph.explain(kind=DiagnosticKind.LOOP_KEPT_WHOLE)
    if not loops:
        return ""
    return (
        f" {len(loops)} loop(s) in the step stayed whole, so the weights read inside them "
        "are not traced: raise the unroll limit, e.g. etrax.compile_etrace_graph(model, x, "
        "policy=etrax.CompilePolicy(unroll_limit=...)), or see graph.report()."
    )


def _untraceable_hint(graph: ETraceGraph) -> str:
    """Advice for a graph whose hidden states could not be traced (not floating point,
    or a pytree); empty otherwise."""
    paths = list(untraceable_hidden_paths(graph))
    if not paths:
        return ""
    return (
        f" The HiddenState(s) {paths} cannot be traced: a traced hidden state is one "
        "floating-point array (graph.explain() says why for each)."
    )


def check_algorithm(algo: object) -> None:
    """Raise a `TypeError` unless `algo` is an `OnlineAlgorithm`; a preset given
    uncalled (``etrax.DRTRL``) is told to be called."""
    if isinstance(algo, OnlineAlgorithm):
        return
    name = getattr(algo, "__name__", None)
    hint = (
        f" (a preset? call it: etrax.{name}(), or etrax.{name}(...) with its settings)"
        if callable(algo) and isinstance(name, str)
        else ""
    )
    raise TypeError(f"algo must be an etrax OnlineAlgorithm, got {type(algo).__name__}{hint}")


def check_relations(graph: ETraceGraph, name: str) -> None:
    if not graph.hidden_param_op_relations:
        hint = loop_hint(graph) + _untraceable_hint(graph)
        raise CompilationError(
            f"{name} needs at least one weight traced into a hidden state, but this graph has "
            "no relations (see graph.report()). Use etrax.bptt_grad, or build the model from "
            "ETP ops (etrax.nn.Linear, etrax.matmul, ...) feeding brainstate.HiddenState values."
            + hint
        )


_Z = TypeVar("_Z")


def zeros_eff(graph: ETraceGraph, dtype: Any) -> EffGrads:
    """Zero effective-operand gradients, one dict per relation."""
    plan = plan_of(graph)
    out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
    for slot in plan.slots:
        for k in slot.keys:
            out[slot.relation][k] = jnp.zeros(slot.eff_shapes[k], dtype)
    return tuple(out)


def varying_zeros(zeros: _Z, *terms: Any) -> _Z:
    """`zeros`, the start of a sum carried through a loop, cast to vary over every
    manual mesh axis one of `terms` (any pytrees) varies over inside `jax.shard_map`,
    as the sum will once a term is added (a loop's carry must keep its type). Outside
    `jax.shard_map`, `zeros` itself."""
    leaves, tree = jax.tree.flatten(zeros)
    others = jax.tree.leaves(terms)
    matched = match_varying([*leaves, *others])[: len(leaves)]
    return jax.tree.unflatten(tree, matched)  # type: ignore[no-any-return]


def add_into(acc: dict[str, Array], grads: Mapping[str, Array]) -> None:
    """Add each effective-operand gradient of `grads` into `acc` (in place)."""
    for k, v in grads.items():
        acc[k] = acc[k] + v if k in acc else v


def _signed_add(x: Array, y: Array, sign: float) -> Array:
    if sign == 1.0:
        return x + y
    if sign == -1.0:
        return x - y
    return x + sign * y


def add_eff(a: EffGrads, b: EffGrads, sign: float = 1.0) -> EffGrads:
    """``a + sign · b``, relation by relation (keys missing from `b` kept as in `a`)."""
    return tuple(
        {k: _signed_add(x[k], y[k], sign) if k in y else x[k] for k in x}
        for x, y in zip(a, b, strict=True)
    )


TraceT = TypeVar("TraceT")


class OnlineAlgorithm(eqx.Module, Generic[TraceT]):
    """A pure online learning rule over an `ETraceGraph`, generic in its trace type.

    `init`, `update` and `eff_grads` are pure; `grads` maps effective-operand
    gradients back to the parameters. Hyper-parameters are fields. The one concrete
    rule is `LearningRule`, a point on the axes of `etrax.algorithms`.
    """

    name: eqx.AbstractVar[str]

    @abc.abstractmethod
    def init(self, graph: ETraceGraph, state: ModelState) -> TraceT:
        """Zero traces for `graph` (their shapes follow the graph)."""

    @abc.abstractmethod
    def update(
        self, graph: ETraceGraph, traces: TraceT, jac: StepJacobians, weights: Weights | None = None
    ) -> TraceT:
        """Advance the traces by one step given that step's Jacobians."""

    @abc.abstractmethod
    def eff_grads(
        self,
        graph: ETraceGraph,
        traces: TraceT,
        dl_dh: Sequence[Array],
        weights: Weights | None = None,
    ) -> EffGrads:
        """Effective-operand gradients for a loss-to-hidden signal (one per group)."""

    @abc.abstractmethod
    def learning_signals(
        self,
        graph: ETraceGraph,
        dl_dh: tuple[Array, ...],
        olds: tuple[Array, ...],
        dl_dy: PyTree,
        modulator: PyTree | None,
    ) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
        """The signals the traces are contracted with at one step (on the new and on
        the old hidden values), from the true ``∂L/∂h`` per group, the output
        cotangent ``∂L/∂y`` and the step's modulator."""

    @property
    @abc.abstractmethod
    def needs_modulator(self) -> bool:
        """Whether `online_grad` must be given per-step ``modulators``."""

    @property
    @abc.abstractmethod
    def synthetic_rate(self) -> float | None:
        """The synthesiser's learning rate for a rule with synthetic gradients at window
        exits (`etrax.DNI`); `None` for every other rule."""

    @property
    @abc.abstractmethod
    def needs_point(self) -> bool:
        """Whether each step's `StepJacobians` must carry its `StepPoint` (the state
        before the step and its arguments), for rules that use the whole transition."""

    @property
    @abc.abstractmethod
    def symmetric(self) -> bool:
        """Whether the learning signal is the true ``∂L/∂h`` (windows need it)."""

    @abc.abstractmethod
    def chunk(
        self,
        graph: ETraceGraph,
        traces: TraceT,
        jacs: StepJacobians,
        signals: Sequence[Array],
        weights: Weights,
        olds: Sequence[Array] | None = None,
    ) -> tuple[TraceT, EffGrads]:
        """Over the K stacked steps of `jacs` / `signals`: accumulate `eff_grads` of the
        traces *before* each step with `olds` (if given), apply `update`, then
        accumulate `eff_grads` with `signals`; returns the new traces and the sum."""

    @property
    @abc.abstractmethod
    def chunk_size(self) -> int:
        """Steps the sequence driver groups into one `chunk` call (1: per step)."""

    def chunk_for(self, graph: ETraceGraph) -> int:
        """The `chunk_size` the sequence driver uses on `graph` (a rule may pick it by
        the graph and the device; by default `chunk_size`)."""
        return self.chunk_size

    def vector_steps(self, graph: ETraceGraph) -> bool:
        """Whether the sequence driver's per-step loop over `graph` (`online_grad`
        without a window) holds element-wise work of the size of the hidden states and
        inputs only, the work of the size of a trace (or a weight) running once per
        chunk: a rule that re-associates its chunks (`chunk_for` above 1) and forms
        every trace-sized term in `chunk` or `stream_finish`. `default_compiler_options`
        reads it (XLA:CPU's older emitters compile such a loop sooner and run it as
        fast, but run trace-sized element-wise kernels several times slower). The
        default, `False`, is always safe."""
        return False

    def streams(self, graph: ETraceGraph) -> bool:
        """Whether the sequence driver runs a chunk as one scan of `stream_step`
        followed by `stream_finish`, instead of stacking the chunk's Jacobians for
        `chunk`: `True` for a rule whose `stream_step` keeps work for `stream_finish`
        (the default is `False`: its `chunk` is at least as fast)."""
        return False

    def stream_step(
        self,
        graph: ETraceGraph,
        traces: TraceT,
        jac: StepJacobians,
        signals: Sequence[Array],
        weights: Weights,
        olds: Sequence[Array] | None = None,
    ) -> tuple[TraceT, EffGrads, PyTree]:
        """One step of a streamed chunk: the updated traces, the step's gradients that
        are formed at once (added up by the driver) and what the driver stacks over the
        chunk for `stream_finish`: `eff_grads` with `olds` on the traces before the
        step, `update`, then `stream_out` with `signals`."""
        before = None if olds is None else self.eff_grads(graph, traces, olds, weights)
        new = self.update(graph, traces, jac, weights)
        now, saved = self.stream_out(graph, new, signals, weights)
        return new, now if before is None else add_eff(before, now), saved

    def stream_out(
        self, graph: ETraceGraph, traces: TraceT, signals: Sequence[Array], weights: Weights
    ) -> tuple[EffGrads, PyTree]:
        """For traces just updated: the gradients formed at once and what is kept for
        `stream_finish`. By default the per-step form: `eff_grads`, nothing kept."""
        return self.eff_grads(graph, traces, signals, weights), ()

    def stream_finish(
        self, graph: ETraceGraph, traces: TraceT, saved: PyTree, weights: Weights
    ) -> EffGrads:
        """The rest of a streamed chunk's gradients, from `stream_step`'s `saved` outputs
        stacked over the chunk's steps (leading axis) and the `traces` after its last
        step; none by default."""
        return tuple({} for _ in graph.hidden_param_op_relations)

    def grads(
        self,
        graph: ETraceGraph,
        traces: TraceT,
        dl_dh: Sequence[Array],
        params: Mapping[Path, PyTree],
    ) -> PathDict[PyTree]:
        """Parameter gradients ``Σ L · ε`` for a loss-to-hidden signal ``dl_dh``.

        **Arguments:**

        - `graph`, `traces`: as for `update`.
        - `dl_dh`: ``∂L/∂h^t`` per hidden group, each ``(*varshape, S)`` (from a
          `Pullback`).
        - `params`: the parameter values (``state.params``).

        **Returns:** a `PathDict` shaped like `params` (zero for parameters that are
        not traced; the drivers add their instantaneous gradients).
        """
        weights = operand_values(graph, params)
        eff = self.eff_grads(graph, traces, dl_dh, weights)
        return operands_to_params(graph, eff, params, weights)


def scan_chunk(
    update: Callable[[TraceT, StepJacobians], TraceT],
    eff_grads: Callable[[TraceT, Sequence[Array]], EffGrads],
    graph: ETraceGraph,
    traces: TraceT,
    jacs: StepJacobians,
    signals: Sequence[Array],
    dtype: Any,
    olds: Sequence[Array] | None = None,
) -> tuple[TraceT, EffGrads]:
    """`OnlineAlgorithm.chunk` as a scan of per-step `update` and `eff_grads` (the
    reference form)."""

    def body(carry: Any, inp: Any) -> Any:
        tr, acc = carry
        jac, sig, old = inp
        if old is not None:
            acc = add_eff(acc, eff_grads(tr, old))
        tr = update(tr, jac)
        acc = add_eff(acc, eff_grads(tr, sig))
        return (tr, acc), None

    olds_in = None if olds is None else tuple(olds)
    zeros = varying_zeros(zeros_eff(graph, dtype), traces, jacs, signals, olds_in)
    (traces, acc), _ = jax.lax.scan(body, (traces, zeros), (jacs, tuple(signals), olds_in))
    return traces, acc
