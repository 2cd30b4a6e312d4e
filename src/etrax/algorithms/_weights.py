"""Between parameters and the operands ETP ops receive.

Each trainable operand is a function of ParamState leaves (the relation's weight
program); gradients found for operands are pulled back to the parameters with
the VJP of that program (and of the op's own ``weight_fn``, through `chain`).
Both maps are linear and constant over a sequence, so they are applied once.
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._pathdict import PathDict
from .._typing import Path, PyTree
from ..compiler import ETraceGraph, ParamUse

__all__ = [
    "LeafGrads",
    "add_param_grads",
    "differentiable",
    "leaf_grads_to_params",
    "operand_leaf_grads",
    "operand_values",
    "operands_to_params",
    "use_leaf_grads",
    "use_value",
    "zeros_like_params",
]

EffGrads = tuple[dict[str, Array], ...]


def _leaf(params: Mapping[Path, PyTree], path: Path, index: int) -> Array:
    return jax.tree.leaves(params[path])[index]  # type: ignore[no-any-return]


def _consts(graph: ETraceGraph, ids: Sequence[int]) -> list[Any]:
    consts = graph.module_info.closed_jaxpr.consts
    return [consts[i] for i in ids]


def operand_values(
    graph: ETraceGraph, params: Mapping[Path, PyTree]
) -> tuple[dict[str, Array], ...]:
    """The raw trainable operands each relation's op receives, from parameter values."""
    out = []
    for rel in graph.hidden_param_op_relations:
        values = {}
        for t in rel.trainables:
            leaves = [_leaf(params, p, i) for p, i in t.param_leaves]
            (values[t.key],) = t.program(*_consts(graph, t.consts), *leaves)
        out.append(values)
    return tuple(out)


def zeros_like_params(params: Mapping[Path, PyTree]) -> PathDict[PyTree]:
    return PathDict((p, jax.tree.map(jnp.zeros_like, v)) for p, v in params.items())


def add_param_grads(a: Mapping[Path, PyTree], b: Mapping[Path, PyTree]) -> PathDict[PyTree]:
    """``a + b`` over the paths of `a` (paths missing from `b` count as zero)."""
    return PathDict((p, jax.tree.map(jnp.add, v, b[p]) if p in b else v) for p, v in a.items())


LeafGrads = dict[tuple[Path, int], Array]
"""Gradients keyed by ``(parameter path, leaf index)``; absent leaves are zero."""


def _accumulate(into: LeafGrads, keys: Sequence[tuple[Path, int]], grads: Sequence[Array]) -> None:
    for key, g in zip(keys, grads, strict=True):
        into[key] = into[key] + g if key in into else g


def _run_program(program: Callable[..., Any], consts: Sequence[Any], *leaves: Array) -> Array:
    """The single value a weight program computes from its constants and leaves."""
    (value,) = program(*consts, *leaves)
    return value  # type: ignore[no-any-return]


def operand_leaf_grads(
    graph: ETraceGraph,
    eff: Sequence[Mapping[str, Array]],
    params: Mapping[Path, PyTree],
    operands: Sequence[Mapping[str, Array]],
    into: LeafGrads | None = None,
) -> LeafGrads:
    """Effective-operand gradients (one dict per relation) pulled back to the
    parameter leaves they come from, summed per leaf (into `into`, if given)."""
    leaf_grads: LeafGrads = {} if into is None else into
    for rel, g_eff, ops in zip(graph.hidden_param_op_relations, eff, operands, strict=True):
        if not g_eff:
            continue
        rules = rel.spec.rules
        assert rules is not None
        raw = rules.chain(g_eff, ops, rel.params)
        for t in rel.trainables:
            if t.key not in raw:
                continue
            leaves = [_leaf(params, p, i) for p, i in t.param_leaves]
            program = functools.partial(_run_program, t.program, _consts(graph, t.consts))
            _, vjp = jax.vjp(program, *leaves)
            _accumulate(leaf_grads, t.param_leaves, vjp(raw[t.key].astype(ops[t.key].dtype)))
    return leaf_grads


def leaf_grads_to_params(params: Mapping[Path, PyTree], leaf_grads: LeafGrads) -> PathDict[PyTree]:
    """Per-leaf gradients as a gradient of `params` (zero where a leaf has none)."""
    out = PathDict[PyTree]()
    for p, v in params.items():
        leaves, treedef = jax.tree.flatten(v)
        new = [
            leaf_grads[(p, i)] if (p, i) in leaf_grads else jnp.zeros_like(leaf)
            for i, leaf in enumerate(leaves)
        ]
        out[p] = jax.tree.unflatten(treedef, new)
    return out


def operands_to_params(
    graph: ETraceGraph,
    eff: Sequence[Mapping[str, Array]],
    params: Mapping[Path, PyTree],
    operands: Sequence[Mapping[str, Array]],
) -> PathDict[PyTree]:
    """Pull effective-operand gradients (one dict per relation) back to the parameters."""
    return leaf_grads_to_params(params, operand_leaf_grads(graph, eff, params, operands))


def use_value(graph: ETraceGraph, use: ParamUse, params: Mapping[Path, PyTree]) -> Array:
    """The weight value `use` reads, from parameter values (through its program)."""
    leaves = [_leaf(params, p, i) for p, i in use.param_leaves]
    return _run_program(use.program, _consts(graph, use.consts), *leaves)


def use_leaf_grads(
    graph: ETraceGraph,
    uses: Sequence[ParamUse],
    grads: Sequence[Array],
    params: Mapping[Path, PyTree],
    into: LeafGrads | None = None,
) -> LeafGrads:
    """Gradients with respect to the weight values that `uses` read, pulled back to
    the parameter leaves (through each use's weight program), summed per leaf (into
    `into`, if given)."""
    leaf_grads: LeafGrads = {} if into is None else into
    for use, g in zip(uses, grads, strict=True):
        if not differentiable(use):
            continue  # a comparison's result, say: no gradient flows through it
        leaves = [_leaf(params, p, i) for p, i in use.param_leaves]
        program = functools.partial(_run_program, use.program, _consts(graph, use.consts))
        _, vjp = jax.vjp(program, *leaves)
        _accumulate(leaf_grads, use.param_leaves, vjp(g.astype(use.dtype)))
    return leaf_grads


def differentiable(use: ParamUse) -> bool:
    """Whether a use's weight value carries a gradient: a floating (or complex) value;
    not a boolean or integer one computed from the weight (``w > 0.2``)."""
    return bool(jnp.issubdtype(use.dtype, jnp.inexact))
