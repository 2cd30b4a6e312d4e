"""`evaluate`: run a compiled model over a sequence, forward only (no Jacobians, no
traces, no gradient) — for held-out accuracy, validation losses and inference."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._errors import StepInputError
from .._typing import ArrayTree, PyTree
from ..compiler import ETraceGraph
from ..executor import (
    ModelState,
    as_args,
    check_sequence_length,
    fast_check_state,
    forward_pure,
    require_graph,
)
from ._drivers import _cast_sequence, check_time_major

__all__ = ["Evaluation", "evaluate"]


class Evaluation(NamedTuple):
    """What `evaluate` returns: unpacks as ``ys, state``.

    **Arguments:**

    - `ys`: the model's outputs at every step, stacked along a leading time axis
      ``(T, ...)`` (an array for a model that returns one array; narrow it with
      ``isinstance(ys, jax.Array)`` in typed code).
    - `state`: the `ModelState` after the last step (pass it on to continue the
      sequence).
    """

    ys: ArrayTree
    state: ModelState


def _evaluate_impl(graph: ETraceGraph, state: ModelState, xs: Any) -> tuple[PyTree, ModelState]:
    def body(carry: ModelState, x: Any) -> tuple[ModelState, PyTree]:
        out, new = forward_pure(graph, carry, as_args(graph, x))
        return new, out

    final, ys = jax.lax.scan(body, state, xs)
    return ys, final


_evaluate_jit = jax.jit(_evaluate_impl, static_argnums=0)


def evaluate(graph: ETraceGraph, state: ModelState, xs: Any) -> Evaluation:
    """Run the model over a sequence without learning: outputs and final state only.

    One jitted `lax.scan` of the plain forward step: no Jacobians, traces or
    gradients are computed, so it costs what the model itself costs (`etrax.step`
    and `etrax.multi_step` also return every step's Jacobians). Use it for held-out
    accuracy, validation losses or inference with trained parameters.

    **Arguments:**

    - `graph`: the `ETraceGraph` (static: compiled once per graph and input shapes).
    - `state`: the `ModelState` at the start of the sequence, e.g.
      ``etrax.state_of(graph)`` or, after training,
      ``etrax.ModelState(params, start.hidden, start.other)``.
    - `xs`: per-step inputs with a leading time axis, ``(T, ...)``; for a batched
      model ``(T, B, ...)``. NumPy float64 inputs are cast to a float32 graph's
      dtype as `etrax.step` casts them.

    **Returns:** an `Evaluation` that unpacks as ``(ys, state)``: the outputs stacked
    over time ``(T, ...)`` and the state after the last step. The outputs are stacked,
    so memory grows with ``T`` only by the outputs themselves.

    **Raises:** `StepInputError` before tracing when `xs` has no leading time axis,
    or its steps or `state` do not fit the graph.

    !!! Example

        ```python
        state = etrax.ModelState(params, start.hidden, start.other)
        ys, final = etrax.evaluate(graph, state, xs)   # ys: (T, B, classes)
        accuracy = jnp.mean(jnp.argmax(ys[-1], axis=-1) == labels)
        ```
    """
    require_graph(graph, "evaluate")
    xs = _cast_sequence(graph, xs)
    state = fast_check_state(graph, state)
    leaves = jax.tree.leaves(xs)
    if not leaves or any(jnp.ndim(a) == 0 for a in leaves):
        raise StepInputError("xs needs a leading time axis (one slice per step): (T, ...)")
    lengths = {int(jnp.shape(a)[0]) for a in leaves}
    if len(lengths) != 1:
        raise StepInputError(
            f"every leaf of xs needs the same leading time axis, got lengths {sorted(lengths)}"
        )
    check_sequence_length(lengths.pop())
    check_time_major(graph, xs, "xs is")
    ys, final = _evaluate_jit(graph, state, xs)
    return Evaluation(ys, final)
