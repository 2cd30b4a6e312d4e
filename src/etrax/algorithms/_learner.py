"""`etrax.compile`: a brainstate-facing online learner (a thin facade).

It owns the compiled graph, the algorithm and the current traces; every
computation goes through the pure `online_grad` / `bptt_grad`. Hidden states live
in the model (read before, written after each call); traces live in the learner.
"""

import pathlib
from collections.abc import Callable
from typing import Any, BinaryIO

import brainstate

from .._checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .._pathdict import PathDict
from .._typing import Path, PyTree
from ..compiler import CompilationReport, CompilePolicy, ETraceGraph, compile_etrace_graph
from ..executor import ModelState, state_of, write_back
from ._base import OnlineAlgorithm, check_relations
from ._drivers import LossFn, bptt_grad, online_grad
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

        `batch_size` defaults to the one given to `etrax.compile`. The graph was
        compiled for that batch size: resetting to another one makes the next
        `etrace_grad` raise a `StepInputError` (compile a new learner instead).
        """
        size = self.batch_size if batch_size is None else batch_size
        brainstate.nn.reset_all_states(self.model, batch_size=size)
        self.traces = self.algorithm.init(self.graph, state_of(self.graph))

    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: LossFn | None = None,
        *,
        step_fn: LossFn | None = None,
        window: int | None = None,
        modulators: PyTree | None = None,
        return_value: bool = False,
    ) -> Any:
        """Online gradient of ``Σ_t loss_fn(y_t, target_t)`` over one sequence.

        The model's hidden states and the learner's traces carry over from the
        previous call (call `reset` between independent sequences).

        **Arguments:**

        - `xs`, `ys`: inputs and targets with a leading time axis.
        - `loss_fn` (or `step_fn`): ``loss(y_t, target_t) -> scalar``.
        - `window`: optional truncation window (see `etrax.online_grad`).
        - `modulators`: per-step modulators for a modulated rule (`etrax.ThreeFactor`),
          with a leading time axis (see `etrax.online_grad`).
        - `return_value`: also return the per-step losses.

        **Returns:** the gradients (a `PathDict` like `params`), or ``(grads, losses)``.
        """
        fn = loss_fn if loss_fn is not None else step_fn
        if fn is None:
            raise TypeError("etrace_grad needs loss_fn(y_t, target_t) -> scalar")
        grads, aux = online_grad(
            self.graph,
            self.algorithm,
            state_of(self.graph),
            self.traces,
            xs,
            ys,
            fn,
            window=window,
            modulators=modulators,
        )
        write_back(self.graph, aux["state"])
        self.traces = aux["traces"]
        return (grads, aux["losses"]) if return_value else grads

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
    """
    algo = _algorithm(algorithm)
    brainstate.nn.init_all_states(model, batch_size=batch_size)
    graph = compile_etrace_graph(model, *example_inputs, policy=policy)
    check_relations(graph, algo.name)
    return OnlineLearner(model, algo, graph, batch_size)
