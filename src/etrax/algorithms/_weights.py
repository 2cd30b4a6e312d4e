"""Between parameters and the operands ETP ops receive.

Each trainable operand is a function of ParamState leaves (the relation's weight
program); gradients found for operands are pulled back to the parameters with
the VJP of that program (and of the op's own ``weight_fn``, through `chain`).
Both maps are linear and constant over a sequence, so they are applied once.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._pathdict import PathDict
from .._typing import Path, PyTree
from ..compiler import ETraceGraph, ParamUse

__all__ = [
    "add_param_grads",
    "operand_values",
    "operands_to_params",
    "use_value",
    "uses_to_params",
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


def operands_to_params(
    graph: ETraceGraph,
    eff: Sequence[Mapping[str, Array]],
    params: Mapping[Path, PyTree],
    operands: Sequence[Mapping[str, Array]],
) -> PathDict[PyTree]:
    """Pull effective-operand gradients (one dict per relation) back to the parameters."""
    grads = zeros_like_params(params)
    leaf_grads: dict[tuple[Path, int], Array] = {}
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
            consts = _consts(graph, t.consts)

            def program(*ls: Array, _t: Any = t, _c: Any = consts) -> Array:
                (value,) = _t.program(*_c, *ls)
                return value  # type: ignore[no-any-return]

            _, vjp = jax.vjp(program, *leaves)
            for (p, i), g in zip(
                t.param_leaves, vjp(raw[t.key].astype(ops[t.key].dtype)), strict=True
            ):
                leaf_grads[(p, i)] = leaf_grads[(p, i)] + g if (p, i) in leaf_grads else g
    out = PathDict[PyTree]()
    for p, v in grads.items():
        leaves, treedef = jax.tree.flatten(v)
        new = [leaf_grads.get((p, i), leaf) for i, leaf in enumerate(leaves)]
        out[p] = jax.tree.unflatten(treedef, new)
    return out


def use_value(graph: ETraceGraph, use: ParamUse, params: Mapping[Path, PyTree]) -> Array:
    """The weight value `use` reads, from parameter values (through its program)."""
    leaves = [_leaf(params, p, i) for p, i in use.param_leaves]
    (value,) = use.program(*_consts(graph, use.consts), *leaves)
    return value  # type: ignore[no-any-return]


def uses_to_params(
    graph: ETraceGraph,
    uses: Sequence[ParamUse],
    grads: Sequence[Array],
    params: Mapping[Path, PyTree],
) -> PathDict[PyTree]:
    """Pull gradients with respect to the weight values that `uses` read back to the
    parameters (through each use's weight program), summed per leaf."""
    leaf_grads: dict[tuple[Path, int], Array] = {}
    for use, g in zip(uses, grads, strict=True):
        leaves = [_leaf(params, p, i) for p, i in use.param_leaves]
        consts = _consts(graph, use.consts)

        def program(*ls: Array, _u: ParamUse = use, _c: Sequence[Any] = consts) -> Array:
            (value,) = _u.program(*_c, *ls)
            return value  # type: ignore[no-any-return]

        _, vjp = jax.vjp(program, *leaves)
        for key, lg in zip(use.param_leaves, vjp(g.astype(use.dtype)), strict=True):
            leaf_grads[key] = leaf_grads[key] + lg if key in leaf_grads else lg
    out = PathDict[PyTree]()
    for p, v in params.items():
        leaves, treedef = jax.tree.flatten(v)
        new = [
            leaf_grads[(p, i)] if (p, i) in leaf_grads else jnp.zeros_like(leaf)
            for i, leaf in enumerate(leaves)
        ]
        out[p] = jax.tree.unflatten(treedef, new)
    return out
