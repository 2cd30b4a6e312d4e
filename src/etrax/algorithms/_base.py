"""The online-algorithm interface."""

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._errors import CompilationError
from .._pathdict import PathDict
from .._typing import Path, PyTree
from ..compiler import ETraceGraph
from ..executor import ModelState, StepJacobians
from ._plan import plan_of
from ._weights import operand_values, operands_to_params

__all__ = [
    "EffGrads",
    "OnlineAlgorithm",
    "Weights",
    "check_chunk_steps",
    "check_relations",
    "zeros_eff",
]

EffGrads = tuple[dict[str, Array], ...]
"""Gradients with respect to each relation's effective trainable operands."""

Weights = Sequence[Mapping[str, Array]]
"""Each relation's trainable operand values (`operand_values(graph, params)`)."""


def check_chunk_steps(name: str, steps: object) -> None:
    """Raise `ValueError` unless `steps` (an algorithm's ``chunk_steps``) is a positive int."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"{name}: chunk_steps must be a positive int, got {steps!r}")


def check_relations(graph: ETraceGraph, name: str) -> None:
    if not graph.hidden_param_op_relations:
        raise CompilationError(
            f"{name} needs at least one weight traced into a hidden state, but this graph has "
            "no relations (see graph.report()). Use etrax.bptt_grad, or build the model from "
            "ETP ops (etrax.nn.Linear, etrax.matmul, ...) feeding brainstate.HiddenState values."
        )


def zeros_eff(graph: ETraceGraph, dtype: Any) -> EffGrads:
    """Zero effective-operand gradients, one dict per relation."""
    plan = plan_of(graph)
    out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
    for slot in plan.slots:
        for k in slot.keys:
            out[slot.relation][k] = jnp.zeros(slot.eff_shapes[k], dtype)
    return tuple(out)


def add_eff(a: EffGrads, b: EffGrads, sign: float = 1.0) -> EffGrads:
    return tuple(
        {k: x[k] + sign * y[k] if k in y else x[k] for k in x} for x, y in zip(a, b, strict=True)
    )


class OnlineAlgorithm(eqx.Module):
    """A pure online learning rule over an `ETraceGraph`.

    `init`, `update` and `eff_grads` are pure; `grads` maps effective-operand
    gradients back to the parameters. Hyper-parameters are fields.
    """

    @abc.abstractmethod
    def init(self, graph: ETraceGraph, state: ModelState) -> PyTree:
        """Zero traces for `graph` (their shapes follow the graph)."""

    @abc.abstractmethod
    def update(
        self, graph: ETraceGraph, traces: PyTree, jac: StepJacobians, weights: Weights | None = None
    ) -> PyTree:
        """Advance the traces by one step given that step's Jacobians."""

    @abc.abstractmethod
    def eff_grads(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        dl_dh: Sequence[Array],
        weights: Weights | None = None,
    ) -> EffGrads:
        """Effective-operand gradients for a loss-to-hidden signal (one per group)."""

    @abc.abstractmethod
    def chunk(
        self,
        graph: ETraceGraph,
        traces: PyTree,
        jacs: StepJacobians,
        signals: Sequence[Array],
        weights: Weights,
        olds: Sequence[Array] | None = None,
    ) -> tuple[PyTree, EffGrads]:
        """Over the K stacked steps of `jacs` / `signals`: accumulate `eff_grads` of the
        traces *before* each step with `olds` (if given), apply `update`, then
        accumulate `eff_grads` with `signals`; returns the new traces and the sum."""

    @property
    @abc.abstractmethod
    def chunk_size(self) -> int:
        """Steps the sequence driver groups into one `chunk` call (1: per step)."""

    def grads(
        self,
        graph: ETraceGraph,
        traces: PyTree,
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
    algo: OnlineAlgorithm,
    graph: ETraceGraph,
    traces: PyTree,
    jacs: StepJacobians,
    signals: Sequence[Array],
    weights: Weights,
    dtype: Any,
    olds: Sequence[Array] | None = None,
) -> tuple[PyTree, EffGrads]:
    """`chunk` as a scan of per-step `update` and `eff_grads` (the reference form)."""

    def body(carry: Any, inp: Any) -> Any:
        tr, acc = carry
        jac, sig, old = inp
        if old is not None:
            acc = add_eff(acc, algo.eff_grads(graph, tr, old, weights))
        tr = algo.update(graph, tr, jac, weights)
        acc = add_eff(acc, algo.eff_grads(graph, tr, sig, weights))
        return (tr, acc), None

    olds_in = None if olds is None else tuple(olds)
    (traces, acc), _ = jax.lax.scan(
        body, (traces, zeros_eff(graph, dtype)), (jacs, tuple(signals), olds_in)
    )
    return traces, acc
