"""`etrax.compile`: a brainstate-facing online learner (a thin facade).

It owns the compiled graph, the algorithm and the current traces; every
computation goes through the pure `online_grad` / `bptt_grad`. Hidden states live
in the model (read before, written after each call); traces live in the learner.
"""

import dataclasses
import functools
import pathlib
import types
import warnings
from collections.abc import Callable, Hashable, Mapping
from types import ModuleType
from typing import Any, BinaryIO, Literal, TypeAlias, TypeVar, cast, overload

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .._compat import constant_outputs, is_prng_key, is_tracer, no_batching_rule
from .._errors import (
    InputStructureError,
    NotSupportedError,
    SilentNetworkWarning,
    StepInputError,
)
from .._pathdict import PathDict
from .._typing import ArrayTree, Path, PyTree
from ..compiler import (
    CompilationReport,
    CompilePolicy,
    ETraceGraph,
    StateKind,
    WeightStatus,
    compile_etrace_graph,
)
from ..executor import ModelState, state_of, write_back
from ..executor._state import path_diff
from ._base import DEFAULT_CHUNK_STEPS, OnlineAlgorithm, check_relations
from ._dni import SyntheticGradient
from ._drivers import (
    AuxLossFn,
    AuxT,
    LossFn,
    bptt_grad,
    keyed,
    moving_parts,
    online_evolve,
    online_grad,
    rejoin,
)
from ._plan import plan_of
from ._presets import by_name
from ._rule import LearningRule

__all__ = [
    "ONE_SAMPLE_CPU_OPTIONS",
    "CompilerOptions",
    "LossOutput",
    "OnlineLearner",
    "compile",
    "default_compiler_options",
]

OptT = TypeVar("OptT")
Grads: TypeAlias = PathDict[ArrayTree]
CompilerOptions: TypeAlias = Mapping[str, str | bool | int | float]
"""XLA options for a learner's programs (`jax.jit`'s ``compiler_options``), e.g.
``{"xla_cpu_use_fusion_emitters": False}``."""
LossOutput: TypeAlias = Literal["weighted", "per_step", "total"]
"""Which losses `OnlineLearner.etrace_grad` returns: ``"weighted"`` the per-step
``w_t · loss_t`` (the terms of the objective), ``"per_step"`` the raw per-step
``loss_t``, ``"total"`` the objective ``Σ_t w_t · loss_t`` (a scalar)."""

MAX_PROGRAMS = 16
"""How many jitted programs (one per method and loss function) a learner keeps."""

# A run's per-step results: (grads, weighted losses, raw losses, loss aux).
_Run: TypeAlias = tuple[ModelState, PyTree, tuple[Grads, Array, ArrayTree, ArrayTree]]


def _algorithm(algorithm: object) -> OnlineAlgorithm[Any]:
    if isinstance(algorithm, OnlineAlgorithm):
        return algorithm
    if isinstance(algorithm, str):
        return by_name(algorithm)
    if callable(algorithm):  # a preset such as etrax.DRTRL, with its defaults
        made = algorithm()
        if isinstance(made, OnlineAlgorithm):
            return made
    raise TypeError(
        "algorithm must be an etrax learning rule (etrax.DRTRL(), etrax.LearningRule(...)), "
        f"a preset such as etrax.PPProp, or a preset's name, got {algorithm!r}"
    )


ONE_SAMPLE_CPU_OPTIONS: CompilerOptions = types.MappingProxyType(
    {"xla_cpu_use_fusion_emitters": False}
)
"""What `default_compiler_options` picks for a model that runs on one sample on the
CPU: XLA:CPU's older element-wise emitters."""


def default_compiler_options(
    graph: ETraceGraph, algorithm: OnlineAlgorithm[Any], samples: int = 1
) -> CompilerOptions | None:
    """The XLA options `etrax.compile` gives by default (``compiler_options="auto"``)
    to the program of `etrace_grad` without a window (`etrax.online_grad` of
    `algorithm` on `graph`): `ONE_SAMPLE_CPU_OPTIONS` when the default JAX backend is
    the CPU, every traced op runs on one sample (no batch, or a batch of 1, in the
    graph, and ``samples = 1`` mapped over it with ``vmap=True``) and the rule's
    per-step loop is vector-sized (`OnlineAlgorithm.vector_steps`: the built-in rules
    with ``chunk_steps`` above 1) but not streamed (`OnlineAlgorithm.streams`:
    pp-prop's chunks); otherwise `None`, XLA's defaults. Every other
    program of a learner (`etrace_evolve`, a call, `bptt_grad`, `etrace_grad` with a
    window) keeps XLA's defaults under ``"auto"``.

    On one sample every array of such a loop is a vector, XLA:CPU's newer fusion
    emitters buy nothing there, and their compile costs about twice the older ones'
    per kernel: measured on a 2-core CPU over GRU, LSTM, LIF and ALIF models of 128 to
    2,048 units (D-RTRL, pp-prop, e-prop), the first gradient came 25–45 % sooner at
    128–512 units (level at 2,048) and the steps ran as fast (0.78–1.18× per step over
    two runs of 18 and 24 configurations, geometric means 0.98 and 0.99). A loop that
    updates trace-sized (or weight-sized) arrays at every step is another matter: the
    older emitters' code for those is several times slower (a GRU of 128 units on one
    sample, per step: `etrace_evolve` with D-RTRL 196 µs against 54 with XLA's
    defaults; `etrace_grad` with ``chunk_steps=1``: D-RTRL 662 against 110, pp-prop
    144 against 38). With a batch the older code for ``tanh`` and sigmoids is slower
    (a GRU at batch 32: up to 1.23× per step), so batched models keep XLA's defaults.
    pp-prop's streamed step (each step's trace updates, and the output traces and
    signals it stacks for the chunk's products) ran 5–10 % faster per step with XLA's
    defaults on one sample (GRU 128/1: 28.4 against 30.3 µs, braintrace's 30.0; GRU
    512/1: 228 against 251), and its first gradient stayed below braintrace's (GRU
    128/1: 1.00 s against 1.27; 512/1: 1.23 against 1.34), so streamed rules keep
    XLA's defaults. Options this XLA does not know give `None`. Pass the result to your own
    ``jax.jit(..., compiler_options=...)`` around `etrax.online_grad` to compile as
    `etrax.compile` does.
    """
    if samples != 1 or jax.default_backend() != "cpu":
        return None
    slots = plan_of(graph).slots
    if not slots or any(slot.nb > 1 for slot in slots):
        return None
    if not algorithm.vector_steps(graph) or algorithm.streams(graph):
        return None
    return None if _xla_refusal(ONE_SAMPLE_CPU_OPTIONS) is not None else ONE_SAMPLE_CPU_OPTIONS


def checked_compiler_options(options: object) -> CompilerOptions | None:
    """`options` as a read-only mapping, once XLA has accepted them: a tiny program is
    compiled with them (about 20 ms, once per set of options), so that an unknown
    option or a value of the wrong type fails here, with the option named, rather
    than at the first training call.

    **Raises:** `TypeError` for anything but a mapping from option names (`str`) to
    `str`, `bool`, `int` or `float` values; `ValueError` for options XLA refuses.
    """
    if options is None:
        return None
    # typed `object`: checked as a user without runtime type checks passes it
    if not isinstance(options, Mapping):
        raise TypeError(
            "compiler_options must be a mapping from XLA option names to values, e.g. "
            "{'xla_cpu_use_fusion_emitters': False} (or, for etrax.compile, 'auto' or "
            f"None), got {options!r}"
        )
    items: list[tuple[str, str | bool | int | float]] = []
    for name, value in options.items():
        if not isinstance(name, str) or not isinstance(value, str | bool | int | float):
            raise TypeError(
                "compiler_options maps XLA option names (str) to str, bool, int or float "
                f"values, got {name!r}: {value!r}"
            )
        items.append((name, value))
    refused = _xla_refusal(dict(items))
    if refused is not None:
        raise ValueError(
            f"XLA refused compiler_options {dict(items)!r}: {refused}. Pass options of "
            "this jaxlib's XLA with values of their type (a bool option takes True or "
            "False), e.g. {'xla_cpu_use_fusion_emitters': False}."
        )
    return types.MappingProxyType(dict(items))


def _xla_refusal(options: CompilerOptions) -> str | None:
    """XLA's message when it refuses `options` (`None` when it accepts them), asked
    once per process and set of options (`_refused_by_xla`)."""
    return _refused_by_xla(tuple(sorted((n, type(v).__name__, v) for n, v in options.items())))


@functools.cache
def _refused_by_xla(options: tuple[tuple[str, str, str | bool | int | float], ...]) -> str | None:
    """XLA's message when it refuses to compile a tiny program with these ``(name,
    type name, value)`` options (`None` when it compiles). The type name is part of
    the cache key: ``True == 1``, but XLA takes only the first for a bool option. The
    probe is a new function each time, as JAX's own caches of a function's programs
    take equal option values for the same."""

    def probe() -> Array:
        return jnp.zeros(())

    try:
        jax.jit(probe, compiler_options={n: v for n, _, v in options}).lower().compile()
    except jax.errors.JaxRuntimeError as err:
        return str(err)
    return None


class OnlineLearner:
    """Trains a brainstate model online; built by `etrax.compile`.

    The model's states hold the current hidden values (read before and written after
    each call); the learner holds the traces. With ``vmap=True`` the graph is compiled
    for one sample and every call maps it over the batch with `jax.vmap`: the model's
    hidden states then carry a leading batch axis, the parameters are shared, and the
    gradients are summed over the samples (as a batched model's are for a loss summed
    over the batch).

    Each method runs one jitted program, built on its first call and reused after:
    ``etrace_grad``'s holds the online driver, the mask's per-step weights and the loss
    totals (off the CPU also the checks behind `SilentNetworkWarning`; on the CPU they
    read the results in host memory), so a first call compiles one XLA program and a
    call with new values (a new mask included) none. Building the learner compiles
    nothing when the rule's initial traces are constants (every built-in rule's are
    zeros), but for a tiny program that checks new `compiler_options`. Pass the same
    loss function object every call (a new function, e.g. a new ``lambda``, builds a
    new program).

    !!! Example

        ```python
        learner = etrax.compile(model, etrax.DRTRL(), x0, batch_size=32)
        for xs, ys in batches:
            learner.reset()                       # fresh hidden states and traces
            grads, losses = learner.etrace_grad(xs, ys, loss_fn, return_value=True)
            updates, opt_state = opt.update(grads, opt_state, learner.params)
            learner.params = optax.apply_updates(learner.params, updates)
        ```
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        algorithm: OnlineAlgorithm[Any],
        graph: ETraceGraph,
        batch_size: int | None,
        vmap: bool = False,
        compiler_options: CompilerOptions | Literal["auto"] | None = None,
    ) -> None:
        self._model = model
        self._algorithm = algorithm
        self._graph = graph
        self.batch_size = batch_size
        self.vmap = vmap
        self._auto = isinstance(compiler_options, str) and compiler_options == "auto"
        self.compiler_options = None if self._auto else checked_compiler_options(compiler_options)
        """The XLA options every program of this learner is compiled with (`None`:
        XLA's defaults), but for `grad_compiler_options`."""
        mi = graph.module_info
        self._written_other = frozenset(
            info.path for info in mi.states if info.kind is StateKind.OTHER and info.written
        )
        self._weighted_losses: dict[tuple[LossFn | AuxLossFn[Any], bool], AuxLossFn[Any]] = {}
        self._bound = tuple(  # the states the graph reads, where the model holds them
            (path, ref)
            for path, ref in zip(mi.paths, mi.state_refs.states, strict=True)
            if not (isinstance(path[0], str) and path[0].startswith("_unknown_path_"))
        )
        self._programs: dict[Hashable, Callable[..., Any]] = {}
        self._compiled_batch = batch_size  # what `reset()` returns to
        start = state_of(graph)
        self._initial_hidden = dict(start.hidden)
        self._initial_written = {p: start.other[p] for p in self._written_other}
        self.traces: object = None
        """The rule's traces (of the type its ``init`` returns; with `vmap`, with a
        leading batch axis)."""
        self.synthesiser: SyntheticGradient | None = None
        """`DNI`'s synthetic-gradient model, trained by every `etrace_grad` call and
        carried to the next (`None` until the first call, and for other rules)."""
        self._start(batch_size)

    @property
    def model(self) -> brainstate.nn.Module:
        """The brainstate model this learner trains (its states hold the current values)."""
        return self._model

    @property
    def graph(self) -> ETraceGraph:
        """The model's compiled `ETraceGraph` (fixed: for a changed model, build a new
        learner with `etrax.compile`)."""
        return self._graph

    @property
    def algorithm(self) -> OnlineAlgorithm[Any]:
        """The learning rule. Assigning another one (``learner.algorithm =
        etrax.PPProp(0.5)``, a preset or its name) drops the compiled programs and starts
        fresh traces for it; the hidden states keep their values."""
        return self._algorithm

    @algorithm.setter
    def algorithm(
        self, value: OnlineAlgorithm[Any] | str | Callable[[], OnlineAlgorithm[Any]]
    ) -> None:
        algo = _algorithm(value)
        if self.vmap and algo.synthetic_rate is not None:
            raise ValueError(
                f"{algo.name} trains one synthesiser from every call; a vmap learner would "
                "train one per sample. Compile a batched model (vmap=False) for it."
            )
        self._algorithm = algo
        self._programs.clear()  # each program closed over the old rule
        self.synthesiser = None
        self._start(self.batch_size)

    def __repr__(self) -> str:
        batch = "unbatched" if self.batch_size is None else f"batch_size={self.batch_size}"
        vmap = ", vmap=True" if self.vmap else ""
        groups = len(self._graph.hidden_groups)
        relations = len(self._graph.hidden_param_op_relations)
        return (
            f"OnlineLearner({type(self._model).__name__}, {self._algorithm.name}, {batch}{vmap}; "
            f"{groups} hidden group{'' if groups == 1 else 's'}, "
            f"{relations} traced relation{'' if relations == 1 else 's'})"
        )

    def _start(self, batch_size: int | None) -> None:
        """Fresh traces; with `vmap`, first the per-sample hidden and written states
        repeated for `batch_size` samples (a state that no ``reset_state`` reset to
        its per-sample shape starts from its value when the learner was built)."""
        if self.vmap:
            assert batch_size is not None
            mi = self.graph.module_info
            initial = {**self._initial_hidden, **self._initial_written}
            for info, ref in zip(mi.states, mi.state_refs.states, strict=True):
                if info.path in initial:
                    shapes = tuple(jnp.shape(leaf) for leaf in jax.tree.leaves(ref.value))
                    value = ref.value if shapes == info.shapes else initial[info.path]
                    ref.value = _broadcast(value, batch_size)
        self.batch_size = batch_size
        previous, self.traces = self.traces, None  # the old may have another batch size

        def init(st: ModelState, tr: PyTree, _: PyTree) -> tuple[ModelState, PyTree, PyTree]:
            return st, self.algorithm.init(self.graph, st), None

        def program(state: ModelState) -> PyTree:
            return self._run(init, state, None)[1]

        state = state_of(self.graph)
        folded = constant_outputs(program, state)  # zero traces: no XLA program needed
        traces = self._program(("init",), program)(state) if folded is None else folded
        self.traces = fresh_streams(traces, previous, per_sample=self.vmap)

    @property
    def grad_compiler_options(self) -> CompilerOptions | None:
        """The XLA options of `etrace_grad`'s program without a window: those of
        `compiler_options` given to `etrax.compile`, or, with ``"auto"`` (the default),
        `default_compiler_options` of the graph and the rule `etrace_grad` runs (read
        when the program is built: a rule assigned to `algorithm` gets its own)."""
        if not self._auto:
            return self.compiler_options
        samples = self.batch_size if self.vmap and self.batch_size else 1
        return default_compiler_options(self.graph, self._driver_rule, samples)

    def _program(
        self,
        key: Hashable,
        fn: Callable[..., Any],
        options: Callable[[], CompilerOptions | None] | None = None,
    ) -> Callable[..., Any]:
        """`fn` under `jax.jit`, built once per `key`, so that every call of a method
        runs one XLA program (compiled on the first call, then reused) instead of
        several small eager ones (a loss function that cannot be hashed is keyed by
        its identity, `keyed`). At most `MAX_PROGRAMS` are kept (the least recently
        used goes first), so a new loss function per call cannot grow the learner
        without bound. Compiled with what `options()` gives (asked only when the
        program is built), or by default with `compiler_options`."""
        program = self._programs.pop(key, None)
        if program is None:
            chosen = self.compiler_options if options is None else options()
            program = jax.jit(fn, compiler_options=None if chosen is None else dict(chosen))
            while len(self._programs) >= MAX_PROGRAMS:
                del self._programs[next(iter(self._programs))]
        self._programs[key] = program  # the most recently used last
        return program

    def _run(
        self,
        run: Callable[[ModelState, PyTree, PyTree], tuple[ModelState, PyTree, PyTree]],
        state: ModelState,
        traces: PyTree,
        seq: PyTree = None,
        seq_axes: PyTree = None,
    ) -> tuple[ModelState, PyTree, PyTree]:
        """``run(state, traces, seq) -> (state, traces, out)``: directly, or with `vmap`
        per sample under `jax.vmap` (hidden and written states, traces, `seq` along
        `seq_axes` and `out` mapped over the batch; parameters and the other states
        shared)."""
        if not self.vmap:
            return run(state, traces, seq)
        written = self._written_other
        other_axes = PathDict((p, 0 if p in written else None) for p in state.other)

        def one(hidden: PyTree, other: PyTree, traces: PyTree, s: PyTree) -> Any:
            new, tr, out = run(ModelState(state.params, hidden, other), traces, s)
            return new.hidden, PathDict((p, new.other[p]) for p in written), tr, out

        traces_axes = None if traces is None else 0
        try:
            hidden, mapped, traces, out = jax.vmap(
                one, in_axes=(0, other_axes, traces_axes, seq_axes)
            )(state.hidden, state.other, traces, seq)
        except NotImplementedError as error:
            if not no_batching_rule(error):
                raise
            raise NotSupportedError(
                f"vmap=True maps update() over the batch with jax.vmap, but {error} "
                "(a primitive of the step has no batching rule). Compile the batched "
                "model instead: brainstate.nn.init_all_states(model, batch_size=B), then "
                "etrax.compile(model, rule, x, batch_size=B) without vmap=True."
            ) from None
        other = PathDict((p, mapped[p] if p in written else v) for p, v in state.other.items())
        return ModelState(state.params, hidden, other), traces, out

    @property
    def _driver_rule(self) -> OnlineAlgorithm[Any]:
        """The algorithm `etrace_grad` runs: with `vmap` and a batch of more than one
        sample, a rule that picks its chunk length from the graph (``chunk_steps=None``,
        `default_chunk_steps`) is given `DEFAULT_CHUNK_STEPS`, since the graph is one
        sample's but each step runs the whole batch."""
        algo = self.algorithm
        batched = self.vmap and (self.batch_size or 1) > 1
        if batched and isinstance(algo, LearningRule) and algo.chunk_steps is None:
            return dataclasses.replace(algo, chunk_steps=DEFAULT_CHUNK_STEPS)
        return algo

    def _over_batch(self, tree: PyTree, how: Literal["sum", "time_first"]) -> PyTree:
        """With `vmap`: per-sample results summed over the batch, or stacked sequences
        moved to ``(T, B, ...)``; unchanged otherwise."""
        if not self.vmap:
            return tree
        if how == "sum":
            return jax.tree.map(lambda a: jnp.sum(a, axis=0), tree)
        return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), tree)

    @property
    def state(self) -> ModelState:
        """The model's current state values (with `vmap`, hidden and written states
        carry a leading batch axis)."""
        return state_of(self.graph)

    @property
    def params(self) -> Grads:
        """The current parameter values (a `PathDict` in the graph's order)."""
        return self.state.params

    @params.setter
    def params(self, values: PyTree) -> None:
        self._check_bound(values)
        if not isinstance(values, Mapping):
            raise TypeError(
                "learner.params takes a mapping from parameter path to value, like "
                f"learner.params itself, got {type(values).__name__}. Start from "
                "learner.params and update it (e.g. optax.apply_updates(learner.params, "
                "updates))."
            )
        refs = dict(
            zip(self.graph.module_info.paths, self.graph.module_info.state_refs.states, strict=True)
        )
        expected = list(self.state.params)
        missing, unknown = path_diff(expected, values)
        if missing or unknown:
            raise KeyError(
                f"learner.params needs exactly the parameter paths {expected}; missing "
                f"{missing}, unknown {unknown}. Start from learner.params and update it "
                "(e.g. optax.apply_updates(learner.params, updates))."
            )
        infos = {info.path: info for info in self.graph.module_info.states}
        for path in expected:  # all checked before any is written
            info = infos[path]
            leaves, treedef = jax.tree.flatten(values[path])
            shapes = [tuple(jnp.shape(a)) for a in leaves]
            if treedef != info.treedef or shapes != [tuple(sh) for sh in info.shapes]:
                raise StepInputError(
                    f"learner.params[{path!r}] has structure {treedef} and shapes {shapes}, but "
                    f"the model was compiled with {info.treedef} and shapes "
                    f"{[tuple(sh) for sh in info.shapes]}. Keep every parameter's structure "
                    "and shapes (start from learner.params); for another shape, build a new "
                    "model and learner."
                )
            for leaf, dtype in zip(leaves, info.dtypes, strict=True):
                given = getattr(leaf, "dtype", None)
                if given is not None and np.dtype(given) != np.dtype(dtype):
                    raise StepInputError(
                        f"learner.params[{path!r}] holds {np.dtype(given)} values, but the "
                        f"model was compiled with {np.dtype(dtype)}: the model's own states "
                        "would change precision. Cast them first, e.g. "
                        f"jax.tree.map(lambda a: a.astype(jnp.{np.dtype(dtype).name}), params)."
                    )
        for path in expected:
            refs[path].value = values[path]

    def _check_bound(self, *arrays: PyTree) -> None:
        """Raise a `StepInputError` if the model no longer holds the states the learner
        was compiled with: ``brainstate.nn.init_all_states`` after `etrax.compile`
        creates new `State` objects, which the learner would neither read nor write;
        and a `TypeError` if the call is being traced (`arrays`, or the model's states
        under ``brainstate.transform.jit``, are tracers)."""
        probe = jax.tree.leaves(self._bound[0][1].value)[:1] if self._bound else []
        if any(is_tracer(a) for a in [*jax.tree.leaves(arrays), *probe]):
            raise TypeError(
                "an OnlineLearner runs eagerly: it reads and writes the model's states and "
                "keeps the traces between calls, so it cannot run inside jax.jit, jax.grad, "
                "jax.vmap or brainstate.transform.jit (each call already runs one compiled "
                "program). Call it outside the transformation, or use the pure "
                "etrax.online_grad(graph, algorithm, state, traces, xs, ys, loss_fn) inside it."
            )
        for path, ref in self._bound:
            try:
                held = _at(self.model, path)
            except (AttributeError, KeyError, IndexError, TypeError):
                held = None
            if held is not ref:
                raise StepInputError(
                    f"the model's state {path} is not the one this learner was compiled "
                    "with: it was replaced after etrax.compile (brainstate.nn.init_all_states "
                    "creates new states), so the learner would neither read nor write it. "
                    "To start a new sequence, call learner.reset() instead (it resets the "
                    "states in place); after re-initialising the model, build a new learner "
                    "with etrax.compile(model, ...)."
                )

    def _check_batch(self, what: str, tree: PyTree, axis: int) -> None:
        """With `vmap`: every leaf of `tree` has the learner's batch size on `axis` (1 for
        time-major sequences, 0 for one step's input), else a `StepInputError` (not
        `jax.vmap`'s own error, which names internal arguments)."""
        if not self.vmap:
            return
        size = self.batch_size
        for leaf in jax.tree.leaves(tree):
            shape = tuple(jnp.shape(leaf))
            if len(shape) > axis and shape[axis] == size:
                continue
            layout = "(T, B, ...)" if axis == 1 else "(B, ...)"
            hint = (
                " It looks batch-major: pass time-major sequences (jnp.swapaxes(xs, 0, 1))."
                if axis == 1 and len(shape) > 1 and shape[0] == size
                else " Use learner.reset(batch_size=...) for another batch size."
            )
            raise StepInputError(
                f"{what}: this vmap learner runs batches of {size} and takes {layout}; got "
                f"a leaf of shape {shape}.{hint}"
            )

    def reset(self, batch_size: int | None = None) -> None:
        """Reset the model's hidden states and the traces (between sequences).

        Each module's own ``reset_state`` runs (through brainstate); a hidden state,
        or a short-term state the step writes (a step counter, a delay buffer), that no
        ``reset_state`` resets (one created in ``__init__`` or ``init_state`` of a
        module without ``reset_state``) is restored to its value when the learner was
        built. Long-term states (running statistics) and random states keep their
        values. `batch_size` defaults to the one given to `etrax.compile`. A graph
        compiled for a batched model is compiled for that batch size: resetting to
        another one makes the next `etrace_grad` raise a `StepInputError` (compile a
        new learner instead). With `vmap`, any batch size works.
        """
        self._check_bound()
        size = self._compiled_batch if batch_size is None else batch_size
        if self.vmap and not (isinstance(size, int) and size >= 1):
            raise ValueError(f"a vmap learner needs a batch size of at least 1, got {size!r}")
        refs = dict(
            zip(self.graph.module_info.paths, self.graph.module_info.state_refs.states, strict=True)
        )
        restorable = {
            **self._initial_hidden,
            **{
                p: v
                for p, v in self._initial_written.items()
                if isinstance(refs[p], brainstate.ShortTermState)
            },
        }
        before = {p: refs[p].value for p in restorable}
        brainstate.nn.reset_all_states(self.model, batch_size=None if self.vmap else size)
        if not self.vmap and size == self._compiled_batch:  # the initial values fit
            for path, initial in restorable.items():
                if refs[path].value is before[path]:  # no reset_state touched it
                    refs[path].value = initial
        self._start(size)

    @overload
    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: LossFn | None = None,
        *,
        step_fn: LossFn | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        loss_output: LossOutput = "weighted",
        window: int | None = None,
        modulators: PyTree | None = None,
        has_aux: Literal[False] = False,
        return_value: Literal[False] = False,
    ) -> Grads: ...

    @overload
    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: LossFn | None = None,
        *,
        step_fn: LossFn | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        loss_output: LossOutput = "weighted",
        window: int | None = None,
        modulators: PyTree | None = None,
        has_aux: Literal[False] = False,
        return_value: Literal[True],
    ) -> tuple[Grads, Array]: ...

    @overload
    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: AuxLossFn[AuxT] | None = None,
        *,
        step_fn: AuxLossFn[AuxT] | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        loss_output: LossOutput = "weighted",
        window: int | None = None,
        modulators: PyTree | None = None,
        has_aux: Literal[True],
        return_value: Literal[False] = False,
    ) -> tuple[Grads, AuxT]: ...

    @overload
    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: AuxLossFn[AuxT] | None = None,
        *,
        step_fn: AuxLossFn[AuxT] | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        loss_output: LossOutput = "weighted",
        window: int | None = None,
        modulators: PyTree | None = None,
        has_aux: Literal[True],
        return_value: Literal[True],
    ) -> tuple[Grads, Array, AuxT]: ...

    @overload
    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: LossFn | None = None,
        *,
        step_fn: LossFn | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        loss_output: LossOutput = "weighted",
        window: int | None = None,
        modulators: PyTree | None = None,
        has_aux: Literal[False] = False,
        return_value: bool,
    ) -> Grads | tuple[Grads, Array]: ...

    @overload
    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: LossFn | AuxLossFn[AuxT] | None = None,
        *,
        step_fn: LossFn | AuxLossFn[AuxT] | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        loss_output: LossOutput = "weighted",
        window: int | None = None,
        modulators: PyTree | None = None,
        has_aux: bool,
        return_value: bool = False,
    ) -> Grads | tuple[Grads, Array] | tuple[Grads, AuxT] | tuple[Grads, Array, AuxT]: ...

    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: LossFn | AuxLossFn[AuxT] | None = None,
        *,
        step_fn: LossFn | AuxLossFn[AuxT] | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        loss_output: LossOutput = "weighted",
        window: int | None = None,
        modulators: PyTree | None = None,
        has_aux: bool = False,
        return_value: bool = False,
    ) -> Grads | tuple[Grads, Array] | tuple[Grads, AuxT] | tuple[Grads, Array, AuxT]:
        """Online gradient of the (masked) sum or mean of ``loss_fn(y_t, target_t)``
        over one sequence.

        The model's hidden states and the learner's traces carry over from the
        previous call (call `reset` between independent sequences).

        **Arguments:**

        - `xs`, `ys`: inputs and targets with a leading time axis, ``(T, ...)``; for a
          batched learner ``(T, B, ...)`` (with `vmap` too: each sample's slice is
          ``xs[:, b]``).
        - `loss_fn` (or `step_fn`): ``loss(y_t, target_t) -> scalar`` (with `vmap`,
          one sample's output and target; the objective sums it over the samples).
        - `mask`: per-step weights ``(T,)`` (e.g. 0/1: which steps are scored); the
          traces still advance at every step. With a modulated rule (`ThreeFactor`),
          the traced weights learn from the modulators, which neither `mask` nor
          `reduction` scales (scale the modulators yourself); the other weights learn
          from the masked, reduced loss.
        - `reduction`: ``"sum"`` (default: ``Σ_t mask_t loss_t``) or ``"mean"``
          (divided by ``max(Σ_t mask_t, 1)``, or by ``T`` without a mask).
        - `loss_output`: which losses `return_value` returns: ``"weighted"``
          (default; the per-step ``w_t · loss_t`` whose sum the gradient is of),
          ``"per_step"`` (the raw ``loss_t``, before mask and reduction) or
          ``"total"`` (the scalar ``Σ_t w_t · loss_t``).
        - `window`: optional truncation window (see `etrax.online_grad`).
        - `modulators`: per-step modulators for a modulated rule (`etrax.ThreeFactor`),
          with a leading time axis (see `etrax.online_grad`); with `vmap`, per sample
          along axis 1, ``(T, B, ...)``.
        - `has_aux`: `loss_fn` returns ``(loss, aux)``; the per-step ``aux`` values are
          returned stacked over time (with `vmap`, ``(T, B, ...)``). They do not
          change the gradients.
        - `return_value`: also return the losses chosen by `loss_output`.

        **Returns:** the gradients (a `PathDict` like `params`); ``(grads, losses)``
        with `return_value`; ``(grads, aux)`` with `has_aux`; ``(grads, losses, aux)``
        with both.

        **Raises:** `TypeError` for a missing loss or a `has_aux` / `return_value`
        that is not a bool, `ValueError` for an unknown `reduction` or `loss_output`,
        `StepInputError` for a `mask` that is not one weight per step (and as
        `etrax.online_grad`).
        """
        fn = loss_fn if loss_fn is not None else step_fn
        if fn is None:
            raise TypeError("etrace_grad needs loss_fn(y_t, target_t) -> scalar")
        fn = keyed(fn)  # an unhashable loss is keyed by identity
        self._check_bound(xs, ys, mask, modulators)
        for name, flag in (("has_aux", has_aux), ("return_value", return_value)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if loss_output not in ("weighted", "per_step", "total"):
            raise ValueError(
                f"loss_output must be 'weighted', 'per_step' or 'total', got {loss_output!r}"
            )
        weighted_fn, weighted = self._weighted(fn, mask is None, reduction, has_aux)
        seq_axes = (1, (1, None) if weighted else 1, None if modulators is None else 1, None)
        self._check_batch("xs", xs, 1)
        self._check_batch("targets", ys, 1)

        synthesising = self.algorithm.synthetic_rate is not None

        def run(st: ModelState, tr: PyTree, seq: PyTree) -> _Run:
            x, t, mods, synth = seq
            result = online_grad(
                self.graph,
                self._driver_rule,
                st,
                tr,
                x,
                t,
                weighted_fn,
                window=window,
                modulators=mods,
                synthesiser=synth,
                has_aux=weighted or has_aux,
            )
            pair = cast(tuple[Array, ArrayTree], result.loss_aux)  # the weighted loss's aux
            raw, aux = pair if weighted else (result.losses, result.loss_aux)
            kept: Any = (aux, result.synthesiser) if synthesising else aux
            return result.state, result.traces, (result.grads, result.losses, raw, kept)

        def program(
            before: ModelState,
            traces: PyTree,
            xs: Any,
            ys: Any,
            mask: Any,
            modulators: PyTree,
            synth: SyntheticGradient | None,
        ) -> Any:
            targets = (ys, self._step_weights(xs, mask, reduction, before)) if weighted else ys
            state, traces, (grads, losses, raw, aux) = self._run(
                run, before, traces, (xs, targets, modulators, synth), seq_axes
            )
            grads, losses, raw = self._over_batch((grads, losses, raw), "sum")
            aux = self._over_batch(aux, "time_first")
            shown = {"weighted": losses, "per_step": raw, "total": jnp.sum(losses)}[loss_output]
            silent = None if on_host else self._silence(before, state, grads)
            return moving_parts(state), traces, grads, shown, aux, silent

        # On the CPU the results are in host memory: reading them there is cheaper than
        # a reduction per gradient leaf in the program (fewer kernels to compile). With
        # several processes an array is not all in this one's memory: in the program.
        on_host = jax.default_backend() == "cpu" and jax.process_count() == 1
        key = (
            "grad", weighted_fn, weighted, reduction, has_aux, loss_output, window,
            modulators is None, on_host,
        )  # fmt: skip
        before = state_of(self.graph)
        options = (lambda: self.grad_compiler_options) if window is None else None
        moving, traces, grads, shown, aux, silent = self._program(key, program, options)(
            before, self.traces, xs, ys, mask, modulators, self.synthesiser
        )
        if synthesising:  # carried to the next call
            aux, self.synthesiser = aux
        state = rejoin(before.params, moving)
        still, all_zero = self._silence_host(before, state, grads) if on_host else silent
        self._warn_if_silent(still, all_zero, mask)
        write_back(self.graph, state)
        self.traces = traces
        if return_value:
            return (grads, shown, aux) if has_aux else (grads, shown)
        return (grads, aux) if has_aux else grads

    def _silence(self, before: ModelState, after: ModelState, grads: Grads) -> tuple[Array, Array]:
        """Inside the program: per hidden group, whether it did not change over the
        sequence; and whether every gradient is exactly zero."""

        def leaves(tree: PyTree) -> list[Array]:  # leaf by leaf: values may carry units
            return [jnp.asarray(a) for a in jax.tree.leaves(tree)]

        still = [
            jnp.all(
                jnp.stack(
                    [
                        jnp.array_equal(a, b)
                        for p in g.hidden_paths
                        for a, b in zip(
                            leaves(before.hidden[p]), leaves(after.hidden[p]), strict=True
                        )
                    ]
                    or [jnp.asarray(False)]
                )
            )
            for g in self.graph.hidden_groups
        ]
        nonzero = [jnp.any(g) for g in leaves(grads)]  # NaN counts as nonzero
        all_zero = jnp.logical_not(jnp.any(jnp.stack(nonzero))) if nonzero else jnp.asarray(False)
        return (jnp.stack(still) if still else jnp.zeros((0,), bool)), all_zero

    def _silence_host(
        self, before: ModelState, after: ModelState, grads: Grads
    ) -> tuple[list[bool], bool]:
        """`_silence` for results in host memory, stopping at the first leaf that
        decides (a learner pays this at every call: typically one leaf each)."""
        still = []
        for g in self.graph.hidden_groups:
            pairs = [
                pair
                for p in g.hidden_paths
                for pair in zip(
                    jax.tree.leaves(before.hidden[p]), jax.tree.leaves(after.hidden[p]), strict=True
                )
            ]
            still.append(
                bool(pairs) and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
            )
        leaves = jax.tree.leaves(grads)  # NaN counts as nonzero
        return still, bool(leaves) and not any(np.any(np.asarray(g)) for g in leaves)

    def _warn_if_silent(
        self, still: Array | list[bool], all_zero: Array | bool, mask: Any = None
    ) -> None:
        """Warn (`SilentNetworkWarning`) when a hidden group did not change over the
        sequence, or every gradient is exactly zero although some step was scored (a
        `mask` of zeros scores none: its zero gradient is expected)."""
        flags = still if isinstance(still, list) else still.tolist()
        unchanged = [g.index for g, s in zip(self.graph.hidden_groups, flags, strict=True) if s]
        if unchanged:
            warnings.warn(
                f"hidden group(s) {unchanged} did not change over the sequence: the inputs may "
                "not reach them, or a layer is saturated",
                SilentNetworkWarning,
                stacklevel=3,
            )
        if bool(all_zero) and (mask is None or bool(np.any(np.asarray(mask)))):
            warnings.warn(
                "every gradient is exactly zero over this sequence: a spiking layer may be "
                "silent (no membrane near threshold; see etrax.nn.LIF's R and the input "
                "scale) or the loss does not depend on the parameters",
                SilentNetworkWarning,
                stacklevel=3,
            )

    def _weighted(
        self, loss_fn: LossFn | AuxLossFn[Any], no_mask: bool, reduction: str, has_aux: bool
    ) -> tuple[LossFn | AuxLossFn[Any], bool]:
        """The loss with per-step weights folded in as data (so new masks never
        recompile) and whether it has them: without a mask and with ``"sum"`` the loss
        itself; otherwise ``(y, (target, w)) ↦ (w · loss, (loss, aux))``."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        if no_mask and reduction == "sum":
            return loss_fn, False
        return self._weighted_loss(loss_fn, has_aux), True

    def _step_weights(self, xs: Any, mask: Any, reduction: str, state: ModelState) -> Array:
        """The per-step weights ``w`` of `mask` (ones without one), divided by their
        sum (at least 1) for ``"mean"``."""
        T = int(jnp.shape(jax.tree.leaves(xs)[0])[0])
        dtype = jnp.result_type(*jax.tree.leaves(state.hidden))
        w = jnp.ones((T,), dtype) if mask is None else jnp.asarray(mask, dtype)
        if w.shape != (T,):
            raise StepInputError(f"mask must have one weight per step, shape ({T},), got {w.shape}")
        if reduction == "mean":
            w = w / jnp.maximum(jnp.sum(w), 1.0)
        return w

    def _weighted_loss(self, loss_fn: LossFn | AuxLossFn[Any], has_aux: bool) -> AuxLossFn[Any]:
        """``(y, (target, w)) ↦ (w · loss, (loss, aux))``, one function per loss (so
        the compiled program is reused); at most `MAX_PROGRAMS` are kept, the least
        recently used going first."""
        key = (loss_fn, has_aux)
        found = self._weighted_losses.pop(key, None)
        if found is None:

            def weighted(y: PyTree, target_and_weight: Any) -> tuple[Array, PyTree]:
                target, w = target_and_weight
                out = loss_fn(y, target)
                loss, aux = out if has_aux else (out, None)
                return w * loss, (loss, aux)

            found = weighted
            while len(self._weighted_losses) >= MAX_PROGRAMS:  # as many as programs
                del self._weighted_losses[next(iter(self._weighted_losses))]
        self._weighted_losses[key] = found  # the most recently used last
        return found

    @overload
    def etrace_evolve(self, xs: Any, *, return_outputs: Literal[False] = False) -> None: ...

    @overload
    def etrace_evolve(self, xs: Any, *, return_outputs: Literal[True]) -> PyTree: ...

    @overload
    def etrace_evolve(self, xs: Any, *, return_outputs: bool) -> PyTree: ...

    def etrace_evolve(self, xs: Any, *, return_outputs: bool = False) -> PyTree:
        """Advance the model's hidden states and the traces over `xs` with no gradient
        (see `etrax.online_evolve`); returns the stacked outputs if asked (with `vmap`,
        ``(T, B, ...)``)."""
        self._check_bound(xs)
        self._check_batch("xs", xs, 1)

        def run(st: ModelState, tr: PyTree, x: PyTree) -> tuple[ModelState, PyTree, PyTree]:
            return online_evolve(
                self.graph, self.algorithm, st, tr, x, return_outputs=return_outputs
            )

        def program(state: ModelState, traces: PyTree, xs: Any) -> Any:
            state, traces, outs = self._run(run, state, traces, xs, 1)
            return moving_parts(state), traces, self._over_batch(outs, "time_first")

        before = state_of(self.graph)
        moving, traces, outs = self._program(("evolve", return_outputs), program)(
            before, self.traces, xs
        )
        write_back(self.graph, rejoin(before.params, moving))
        self.traces = traces
        return outs if return_outputs else None

    def __call__(self, *x: Any) -> PyTree:
        """One step on input `x` (the model's ``update`` arguments): advances the hidden
        states and the traces, and returns the step's output."""
        self._check_bound(x)
        one = x[0] if len(x) == 1 else x
        self._check_batch("x", one, 0)

        def run(st: ModelState, tr: PyTree, x: PyTree) -> tuple[ModelState, PyTree, PyTree]:
            xs = jax.tree.map(lambda a: jnp.asarray(a)[None], x)
            st, tr, outs = online_evolve(
                self.graph, self.algorithm, st, tr, xs, return_outputs=True
            )
            return st, tr, jax.tree.map(lambda a: a[0], outs)

        def program(state: ModelState, traces: PyTree, x: Any) -> Any:
            state, traces, out = self._run(run, state, traces, x, 0)
            return moving_parts(state), traces, out

        before = state_of(self.graph)
        moving, traces, out = self._program(("call",), program)(before, self.traces, one)
        write_back(self.graph, rejoin(before.params, moving))
        self.traces = traces
        return out

    @overload
    def bptt_grad(
        self, xs: Any, ys: Any, loss_fn: LossFn, *, return_value: Literal[False] = False
    ) -> Grads: ...

    @overload
    def bptt_grad(
        self, xs: Any, ys: Any, loss_fn: LossFn, *, return_value: Literal[True]
    ) -> tuple[Grads, Array]: ...

    def bptt_grad(
        self, xs: Any, ys: Any, loss_fn: LossFn, *, return_value: bool = False
    ) -> Grads | tuple[Grads, Array]:
        """The exact BPTT gradient from the current state (with `vmap`, per sample and
        summed over the batch). The hidden states and the traces advance over `xs` as
        in `etrace_evolve`, so a sequence can go on online after it."""
        loss_fn = keyed(loss_fn)  # an unhashable loss is keyed by identity
        self._check_bound(xs, ys)
        self._check_batch("xs", xs, 1)
        self._check_batch("targets", ys, 1)

        def run(st: ModelState, tr: PyTree, seq: PyTree) -> _Run:
            result = bptt_grad(self.graph, st, seq[0], seq[1], loss_fn)
            # the traces move on too (the same steps, once more, without a gradient)
            _, tr, _ = online_evolve(self.graph, self.algorithm, st, tr, seq[0])
            return result.state, tr, (result.grads, result.losses, result.losses, None)

        def program(state: ModelState, traces: PyTree, xs: Any, ys: Any) -> Any:
            state, traces, (grads, losses, _, _) = self._run(run, state, traces, (xs, ys), (1, 1))
            return moving_parts(state), traces, self._over_batch((grads, losses), "sum")

        before = state_of(self.graph)
        moving, traces, (grads, losses) = self._program(("bptt", loss_fn), program)(
            before, self.traces, xs, ys
        )
        write_back(self.graph, rejoin(before.params, moving))
        self.traces = traces
        return (grads, losses) if return_value else grads

    def save(self, path: str | pathlib.Path | BinaryIO, opt_state: PyTree = None) -> None:
        """Save the model's parameters and states, the traces and `opt_state` (see
        `etrax.save_checkpoint`)."""
        self._check_bound()
        save_checkpoint(path, Checkpoint(state_of(self.graph), self.traces, opt_state))

    @overload
    def load(self, path: str | pathlib.Path | BinaryIO) -> None: ...

    @overload
    def load(self, path: str | pathlib.Path | BinaryIO, opt_state_like: OptT) -> OptT: ...

    def load(self, path: str | pathlib.Path | BinaryIO, opt_state_like: object = None) -> object:
        """Load a checkpoint written by `save` into the model and the learner, and
        return the saved optimiser state (read into the structure of `opt_state_like`,
        e.g. ``opt.init(learner.params)``; without it, a saved optimiser state is not
        read). The learner must be built from the same model class, rule and batch
        size, and the optimiser state like the saved one."""
        self._check_bound()
        like = Checkpoint(state_of(self.graph), self.traces, opt_state_like)
        loaded = load_checkpoint(path, like, partial=opt_state_like is None)
        self.params = loaded.state.params
        write_back(self.graph, loaded.state)
        self.traces = loaded.traces
        return loaded.opt_state

    def report(self) -> CompilationReport:
        """The compilation report: hidden groups, relations and diagnostics."""
        return CompilationReport(self.graph)

    def weight_rules(self) -> dict[Path, WeightStatus]:
        """How each parameter learns (traced or instantaneous), and why."""
        return self.graph.weight_rules()


def _at(model: brainstate.nn.Module, path: Path) -> object:
    """What `model` holds at a state path: attributes by name, list and dict items by
    index or key."""
    obj: Any = model
    for key in path:
        obj = getattr(obj, key) if isinstance(key, str) and hasattr(obj, key) else obj[key]
    return obj


def _leafwise(tree: PyTree, f: Callable[[ModuleType, Any], Any]) -> PyTree:
    """``f(xp, leaf)`` on every leaf, with `numpy` on the host for concrete, strongly
    typed arrays (an eager `jax.numpy` call would compile an XLA program per leaf
    shape) and with `jax.numpy` otherwise."""

    def one(a: Any) -> Any:
        if is_tracer(a) or getattr(a, "weak_type", False):
            return f(jnp, a)
        return jax.device_put(np.array(f(np, np.asarray(a))))

    return jax.tree.map(one, tree)


def fresh_streams(traces: PyTree, previous: PyTree, *, per_sample: bool) -> PyTree:
    """`traces` with every typed PRNG key in them (the noise of a stochastic rule such
    as `UORO`) made its own stream. After earlier traces (`previous`: a ``reset``), each
    key is derived from the one it replaces, so no sequence repeats an earlier one's
    noise, and a run resumed from a checkpoint draws what the saved run would have;
    the first traces keep the rule's key, as ``algorithm.init`` gives it. With
    `per_sample` (``vmap=True``, where ``init`` gave every sample the same key), the
    key is then split into one per sample along the leading axis."""
    old = iter([leaf for leaf in jax.tree.leaves(previous) if is_prng_key(leaf)])

    def fresh(leaf: Any) -> Any:
        if not is_prng_key(leaf):
            return leaf
        base = leaf if leaf.ndim == 0 else leaf[0]
        before = next(old, None)
        if before is not None:
            first = before if before.ndim == 0 else before[0]
            base = jax.random.fold_in(first, _NEXT_SEQUENCE)
        if not (per_sample and leaf.ndim):
            return base
        return jax.random.split(base, len(leaf))

    return jax.tree.map(fresh, traces)


_NEXT_SEQUENCE = 0x5E9
"""What a key is folded with to give the next sequence's (see `fresh_streams`)."""


def _broadcast(tree: PyTree, size: int) -> PyTree:
    """Every leaf of `tree` repeated along a new leading axis of `size`."""
    return _leafwise(tree, lambda xp, a: xp.broadcast_to(a, (size, *xp.shape(a))))


def _first_sample(args: tuple[Any, ...], batch_size: int) -> tuple[Any, ...]:
    """One sample of batched example inputs (each leaf's leading axis must be the batch)."""
    for leaf in jax.tree.leaves(args):
        shape = jnp.shape(leaf)
        if not shape or shape[0] != batch_size:
            raise StepInputError(
                f"with vmap=True every example input needs a leading batch axis of size "
                f"batch_size={batch_size}, got an array shaped {shape}"
            )
    return tuple(_leafwise(args, lambda xp, a: a[0]))


def _leading_sizes(example_inputs: tuple[Any, ...]) -> set[int]:
    """The leading axis sizes of the example inputs' array leaves (0-d leaves left out)."""
    return {int(np.shape(a)[0]) for a in jax.tree.leaves(example_inputs) if np.ndim(a) > 0}


def compile(
    model: brainstate.nn.Module,
    algorithm: OnlineAlgorithm[Any] | str | Callable[[], OnlineAlgorithm[Any]],
    *example_inputs: Any,
    batch_size: int | None = None,
    vmap: bool = False,
    policy: CompilePolicy | None = None,
    seed: int | None = None,
    verbose: bool = False,
    compiler_options: CompilerOptions | Literal["auto"] | None = "auto",
) -> OnlineLearner:
    """Initialise a model's states, compile its graph and return an `OnlineLearner`.

    **Arguments:**

    - `model`: a `brainstate.nn.Module` whose ``update`` does one step.
    - `algorithm`: a learning rule (``etrax.DRTRL()``, ``etrax.PPProp(0.9)``, an
      ``etrax.LearningRule(...)``), a preset (``etrax.DRTRL``: its defaults), or a
      preset's name, case-insensitive (``"d_rtrl"``, ``"pp_prop"``, ``"es_d_rtrl"``,
      ``"eprop"``, ``"ostl_feedforward"``, ``"three_factor"``; see
      `etrax.algorithms.PRESETS`).
    - `*example_inputs`: one step's inputs (batched if `batch_size` is given).
    - `batch_size`: batch size the model's states are created with.
    - `vmap`: write the model per sample: its states are created unbatched, the
      graph is compiled on one sample of `example_inputs` (whose leaves lead with
      `batch_size`), and each call maps it over the batch with `jax.vmap`. Gives the
      gradients of the batched model (summed over samples). Needs `batch_size`.
    - `policy`: the compiler's `CompilePolicy` (weight-op recognition, if-conversion,
      loop unrolling); the default policy when `None`.
    - `seed`: seeds brainstate's random generator before the states are created
      (reproducible random initial *states*); `None` leaves it as it is. The weights
      were drawn when the model was built, before this call: for reproducible
      weights, call ``brainstate.random.seed(s)`` before building the model.
    - `verbose`: print the compilation report.
    - `compiler_options`: XLA options for every program the learner compiles (passed
      to `jax.jit`), checked here. ``"auto"`` (the default): XLA's defaults, but for
      `etrace_grad`'s program without a window, which gets `default_compiler_options`
      (on the CPU ``{"xla_cpu_use_fusion_emitters": False}`` for a model run on one
      sample by a rule whose per-step loop is vector-sized, e.g. the built-in rules
      with ``chunk_steps`` above 1; `OnlineLearner.grad_compiler_options`). `None`:
      XLA's defaults. On the CPU, ``{"xla_cpu_use_fusion_emitters": False}`` compiles
      the online program in about half the time; with a batch its step then runs
      slower where ``tanh`` and sigmoids dominate the element-wise work (GRU at batch
      32: up to 1.23×) and mostly faster elsewhere (LIF, ALIF, LSTM), and a loop that
      updates traces at every step (`etrace_evolve`, ``chunk_steps=1``) runs several
      times slower; see "Shorter compiles on the CPU" in the benchmarks page.

    **Raises:** `TypeError` for an unknown algorithm, a `vmap` that is not a bool or
    `compiler_options` that are not a mapping of names to values, `ValueError` for
    ``vmap=True`` without a positive `batch_size` or for `compiler_options` that XLA
    refuses, `StepInputError` for ``vmap=True`` example inputs without the leading
    batch axis.
    """
    algo = _algorithm(algorithm)
    auto = isinstance(compiler_options, str) and compiler_options == "auto"
    options = None if auto else checked_compiler_options(compiler_options)
    if not isinstance(vmap, bool):
        raise TypeError(f"vmap must be True or False, got {vmap!r}")
    if vmap:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"vmap=True maps the model over a batch: pass batch_size=B (B ≥ 1), got "
                f"{batch_size!r}"
            )
        if algo.synthetic_rate is not None:
            raise ValueError(
                f"{algo.name} trains one synthesiser from every call; with vmap=True each "
                "sample would train its own. Compile a batched model (vmap=False) instead."
            )
        example_inputs = _first_sample(example_inputs, batch_size)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise TypeError(f"seed must be an int (or None), got {type(seed).__name__} {seed!r}")
        brainstate.random.seed(seed)
    brainstate.nn.init_all_states(model, batch_size=None if vmap else batch_size)
    try:
        graph = compile_etrace_graph(model, *example_inputs, policy=policy)
    except InputStructureError as err:
        leading = _leading_sizes(example_inputs)
        if vmap or batch_size is None or not leading or batch_size in leading:
            raise
        raise InputStructureError(
            f"{err} Here batch_size={batch_size}, but the example inputs lead with "
            f"{sorted(leading)}: pass one step's inputs with the batch axis first, of size "
            "batch_size (or leave batch_size out for an unbatched model)."
        ) from err
    if verbose:
        print(CompilationReport(graph))
    check_relations(graph, algo.name)
    return OnlineLearner(model, algo, graph, batch_size, vmap, "auto" if auto else options)
