"""`etrax.compile`: a brainstate-facing online learner (a thin facade).

It owns the compiled graph, the algorithm and the current traces; every
computation goes through the pure `online_grad` / `bptt_grad`. Hidden states live
in the model (read before, written after each call); traces live in the learner.
"""

import pathlib
import warnings
from collections.abc import Callable
from typing import Any, BinaryIO, Literal

import brainstate
import jax
import jax.numpy as jnp

from .._checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .._errors import SilentNetworkWarning, StepInputError
from .._pathdict import PathDict
from .._typing import Path, PyTree
from ..compiler import CompilationReport, CompilePolicy, ETraceGraph, compile_etrace_graph
from ..executor import ModelState, state_of, write_back
from ._base import OnlineAlgorithm, check_relations
from ._drivers import LossFn, bptt_grad, online_evolve, online_grad
from ._presets import by_name

__all__ = ["OnlineLearner", "compile"]


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


class OnlineLearner:
    """Trains a brainstate model online; built by `etrax.compile`.

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
    ) -> None:
        self.model = model
        self.algorithm = algorithm
        self.graph = graph
        self.batch_size = batch_size
        self.traces: PyTree = algorithm.init(graph, state_of(graph))
        self._weighted_losses: dict[LossFn, LossFn] = {}
        self._initial_hidden = dict(state_of(graph).hidden)

    @property
    def state(self) -> ModelState:
        """The model's current state values."""
        return state_of(self.graph)

    @property
    def params(self) -> PathDict[PyTree]:
        """The current parameter values (a `PathDict` in the graph's order)."""
        return self.state.params

    @params.setter
    def params(self, values: PyTree) -> None:
        refs = dict(
            zip(self.graph.module_info.paths, self.graph.module_info.state_refs.states, strict=True)
        )
        expected = list(self.state.params)
        missing = [p for p in expected if p not in values]
        unknown = [p for p in values if p not in self.state.params]
        if missing or unknown:
            raise KeyError(
                f"learner.params needs exactly the parameter paths {expected}; missing "
                f"{missing}, unknown {unknown}. Start from learner.params and update it "
                "(e.g. optax.apply_updates(learner.params, updates))."
            )
        for path in expected:
            refs[path].value = values[path]

    def reset(self, batch_size: int | None = None) -> None:
        """Reset the model's hidden states and the traces (between sequences).

        Each module's own ``reset_state`` runs (through brainstate); a hidden state
        that no ``reset_state`` resets (one created in ``__init__`` or ``init_state``
        of a module without ``reset_state``) is restored to its value when the learner
        was built. `batch_size` defaults to the one given to `etrax.compile`. The graph
        was compiled for that batch size: resetting to another one makes the next
        `etrace_grad` raise a `StepInputError` (compile a new learner instead).
        """
        size = self.batch_size if batch_size is None else batch_size
        refs = dict(
            zip(self.graph.module_info.paths, self.graph.module_info.state_refs.states, strict=True)
        )
        before = {p: refs[p].value for p in self._initial_hidden}
        brainstate.nn.reset_all_states(self.model, batch_size=size)
        if size == self.batch_size:
            for path, initial in self._initial_hidden.items():
                if refs[path].value is before[path]:  # no reset_state touched it
                    refs[path].value = initial
        self.traces = self.algorithm.init(self.graph, state_of(self.graph))

    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: LossFn | None = None,
        *,
        step_fn: LossFn | None = None,
        mask: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        window: int | None = None,
        modulators: PyTree | None = None,
        return_value: bool = False,
    ) -> Any:
        """Online gradient of the (masked) sum or mean of ``loss_fn(y_t, target_t)``
        over one sequence.

        The model's hidden states and the learner's traces carry over from the
        previous call (call `reset` between independent sequences).

        **Arguments:**

        - `xs`, `ys`: inputs and targets with a leading time axis.
        - `loss_fn` (or `step_fn`): ``loss(y_t, target_t) -> scalar``.
        - `mask`: per-step weights ``(T,)`` (e.g. 0/1: which steps are scored); the
          traces still advance at every step.
        - `reduction`: ``"sum"`` (default: ``Σ_t mask_t loss_t``) or ``"mean"``
          (divided by ``max(Σ_t mask_t, 1)``, or by ``T`` without a mask).
        - `window`: optional truncation window (see `etrax.online_grad`).
        - `modulators`: per-step modulators for a modulated rule (`etrax.ThreeFactor`),
          with a leading time axis (see `etrax.online_grad`).
        - `return_value`: also return the per-step (weighted) losses.

        **Returns:** the gradients (a `PathDict` like `params`), or ``(grads, losses)``.
        """
        fn = loss_fn if loss_fn is not None else step_fn
        if fn is None:
            raise TypeError("etrace_grad needs loss_fn(y_t, target_t) -> scalar")
        targets, fn = self._weighted(xs, ys, fn, mask, reduction)
        grads, aux = online_grad(
            self.graph,
            self.algorithm,
            state_of(self.graph),
            self.traces,
            xs,
            targets,
            fn,
            window=window,
            modulators=modulators,
        )
        self._warn_if_silent(state_of(self.graph), aux["state"], grads)
        write_back(self.graph, aux["state"])
        self.traces = aux["traces"]
        return (grads, aux["losses"]) if return_value else grads

    def _warn_if_silent(
        self, before: ModelState, after: ModelState, grads: PathDict[PyTree]
    ) -> None:
        """Warn (`SilentNetworkWarning`) when a hidden group did not change over the
        sequence, or every gradient is exactly zero."""
        still = [
            g.index
            for g in self.graph.hidden_groups
            if all(
                bool(jnp.array_equal(a, b))  # leaf by leaf: values may carry units
                for p in g.hidden_paths
                for a, b in zip(
                    jax.tree.leaves(before.hidden[p]), jax.tree.leaves(after.hidden[p]), strict=True
                )
            )
        ]
        if still:
            warnings.warn(
                f"hidden group(s) {still} did not change over the sequence: the inputs may "
                "not reach them, or a layer is saturated",
                SilentNetworkWarning,
                stacklevel=3,
            )
        leaves = jax.tree.leaves(grads)
        if leaves and not any(bool(jnp.any(g != 0)) for g in leaves):
            warnings.warn(
                "every gradient is exactly zero over this sequence: a spiking layer may be "
                "silent (no membrane near threshold; see etrax.nn.LIF's R and the input "
                "scale) or the loss does not depend on the parameters",
                SilentNetworkWarning,
                stacklevel=3,
            )

    def _weighted(
        self, xs: Any, ys: Any, loss_fn: LossFn, mask: Any, reduction: str
    ) -> tuple[Any, LossFn]:
        """Targets and loss with the per-step weights of `mask` and `reduction` folded
        in as data (so new masks never recompile)."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        if mask is None and reduction == "sum":
            return ys, loss_fn
        T = int(jnp.shape(jax.tree.leaves(xs)[0])[0])
        dtype = jnp.result_type(*jax.tree.leaves(state_of(self.graph).hidden))
        w = jnp.ones((T,), dtype) if mask is None else jnp.asarray(mask, dtype)
        if w.shape != (T,):
            raise StepInputError(f"mask must have one weight per step, shape ({T},), got {w.shape}")
        if reduction == "mean":
            w = w / jnp.maximum(jnp.sum(w), 1.0)
        return (ys, w), self._weighted_loss(loss_fn)

    def _weighted_loss(self, loss_fn: LossFn) -> LossFn:
        """``(y, (target, w)) ↦ w · loss_fn(y, target)``, one function per loss (so the
        compiled program is reused)."""
        if loss_fn not in self._weighted_losses:

            def weighted(y: PyTree, target_and_weight: Any) -> Any:
                target, w = target_and_weight
                return w * loss_fn(y, target)

            self._weighted_losses[loss_fn] = weighted
        return self._weighted_losses[loss_fn]

    def etrace_evolve(self, xs: Any, *, return_outputs: bool = False) -> Any:
        """Advance the model's hidden states and the traces over `xs` with no gradient
        (see `etrax.online_evolve`); returns the stacked outputs if asked."""
        state, traces, outs = online_evolve(
            self.graph,
            self.algorithm,
            state_of(self.graph),
            self.traces,
            xs,
            return_outputs=return_outputs,
        )
        write_back(self.graph, state)
        self.traces = traces
        return outs if return_outputs else None

    def __call__(self, *x: Any) -> PyTree:
        """One step on input `x` (the model's ``update`` arguments): advances the hidden
        states and the traces, and returns the step's output."""
        one = x[0] if len(x) == 1 else x
        outs = self.etrace_evolve(
            jax.tree.map(lambda a: jnp.asarray(a)[None], one), return_outputs=True
        )
        return jax.tree.map(lambda a: a[0], outs)

    def bptt_grad(self, xs: Any, ys: Any, loss_fn: LossFn, *, return_value: bool = False) -> Any:
        """The exact BPTT gradient from the current state (hidden states are advanced)."""
        grads, aux = bptt_grad(self.graph, state_of(self.graph), xs, ys, loss_fn)
        write_back(self.graph, aux["state"])
        return (grads, aux["losses"]) if return_value else grads

    def save(self, path: str | pathlib.Path | BinaryIO, opt_state: PyTree = None) -> None:
        """Save the model's parameters and states, the traces and `opt_state` (see
        `etrax.save_checkpoint`)."""
        save_checkpoint(path, Checkpoint(state_of(self.graph), self.traces, opt_state))

    def load(self, path: str | pathlib.Path | BinaryIO, opt_state_like: PyTree = None) -> PyTree:
        """Load a checkpoint written by `save` into the model and the learner, and
        return the saved optimiser state (read into the structure of `opt_state_like`,
        e.g. ``opt.init(learner.params)``). The learner must be built from the same
        model class, rule and batch size."""
        like = Checkpoint(state_of(self.graph), self.traces, opt_state_like)
        loaded = load_checkpoint(path, like)
        self.params = loaded.state.params
        write_back(self.graph, loaded.state)
        self.traces = loaded.traces
        return loaded.opt_state

    def report(self) -> CompilationReport:
        """The compilation report: hidden groups, relations and diagnostics."""
        return CompilationReport(self.graph)

    def weight_rules(self) -> dict[Path, Any]:
        """How each parameter learns (traced or instantaneous), and why."""
        return self.graph.weight_rules()


def compile(
    model: brainstate.nn.Module,
    algorithm: OnlineAlgorithm[Any] | str | Callable[[], OnlineAlgorithm[Any]],
    *example_inputs: Any,
    batch_size: int | None = None,
    policy: CompilePolicy | None = None,
    seed: int | None = None,
    verbose: bool = False,
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
    - `policy`: the compiler's `CompilePolicy` (weight-op recognition, if-conversion,
      loop unrolling); the default policy when `None`.
    - `seed`: seeds brainstate's random generator before the states are created
      (reproducible initial states); `None` leaves it as it is.
    - `verbose`: print the compilation report.
    """
    algo = _algorithm(algorithm)
    if seed is not None:
        brainstate.random.seed(seed)
    brainstate.nn.init_all_states(model, batch_size=batch_size)
    graph = compile_etrace_graph(model, *example_inputs, policy=policy)
    if verbose:
        print(CompilationReport(graph))
    check_relations(graph, algo.name)
    return OnlineLearner(model, algo, graph, batch_size)
