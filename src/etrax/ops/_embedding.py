"""Embedding lookup as an ETP primitive: ``y = f(T)[idx]`` for integer indices."""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._compat import Primitive, bind
from .._errors import OpArgumentError
from .._typing import Params, Shape
from ._common import x_batch_rule
from ._primitive import ETPRules, Factorization, register_primitive
from ._util import chain_transform, check_transform, operand

__all__ = ["embedding", "embedding_p"]

Transform = Callable[[Array], Array] | None


def _impl(idx: Array, table: Array, *, weight_fn: Transform, vocab: int) -> Array:
    t = table if weight_fn is None else weight_fn(table)
    return t[idx]


def _one_hot(x: Array, vocab: int, dtype: Any) -> Array:
    """Indices → one-hot rows; a float ``x`` already is a (filtered) one-hot code."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jax.nn.one_hot(x, vocab, dtype=dtype)
    return x


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    u = _one_hot(x, params["vocab"], cot.dtype)
    return {"weight": u[..., :, None] * cot[..., None, :]}


def _scale(hvec: Array, trace: Mapping[str, Array], params: Params) -> dict[str, Array]:
    return {"weight": trace["weight"] * hvec[..., None, :]}


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    vocab = params["vocab"]
    if jnp.issubdtype(x.dtype, jnp.integer):
        grad = (
            jnp.zeros((vocab, cot.shape[-1]), cot.dtype)
            .at[x.reshape(-1)]
            .add(cot.reshape(-1, cot.shape[-1]))
        )
    else:
        grad = x.reshape(-1, vocab).T @ cot.reshape(-1, cot.shape[-1])
    return {"weight": grad}


def _chain(
    grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    return {"weight": chain_transform(params["weight_fn"], weights["weight"], grads["weight"])}


def _factor(x: Array | None, params: Params) -> Factorization:
    assert x is not None
    u = _one_hot(x, params["vocab"], jnp.result_type(float))
    return Factorization(batch_ndim=u.ndim - 1, inputs={"weight": u})


def _input_repr(x: Array, weights: Mapping[str, Array], params: Params) -> Array:
    return _one_hot(x, params["vocab"], jnp.result_type(float))


def _trace_shapes(
    x: jax.ShapeDtypeStruct | None,
    y: jax.ShapeDtypeStruct,
    weights: Mapping[str, jax.ShapeDtypeStruct],
    params: Params,
) -> dict[str, Shape]:
    assert x is not None
    return {"weight": tuple(x.shape) + tuple(weights["weight"].shape)}


EMBEDDING_RULES = ETPRules(
    instant=_instant,
    scale=_scale,
    param_trace_shapes=_trace_shapes,
    contract_rule=_contract,
    chain_rule=_chain,
    factor=_factor,
    input_repr=_input_repr,
)

embedding_p: Primitive = register_primitive(
    "etp_embedding",
    _impl,
    rules=EMBEDDING_RULES,
    batch_rule=x_batch_rule(lambda: embedding_p, _impl, 1),
)


def embedding(indices: ArrayLike, table: ArrayLike, *, weight_fn: Transform = None) -> Array:
    """Look up rows of a learnable table: ``y = weight_fn(table)[indices]``.

    `indices` is an integer scalar or ``(batch,)``; `table` is ``(vocab, dim)``. The
    per-parameter trace scales with the vocabulary (``vocab × dim`` per sample).
    Indices follow JAX's indexing: a negative one counts from the end, and one out of
    range is clamped to the first or last row (the row that is read is the row that
    learns).
    """
    idx = operand("embedding", "indices", indices)
    table = operand("embedding", "table", table)
    check_transform("embedding: weight_fn", weight_fn, table)
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise OpArgumentError(
            f"embedding: indices must be integers, got dtype {idx.dtype}; cast them with "
            "jnp.asarray(indices, jnp.int32)"
        )
    if idx.ndim > 1:
        raise OpArgumentError(f"embedding: indices must be a scalar or (batch,), got {idx.shape}")
    if table.ndim != 2:
        raise OpArgumentError(f"embedding: table must be (vocab, dim), got {table.shape}")
    vocab = int(table.shape[0])
    # one row per index everywhere (the lookup, its traces and its gradients)
    idx = jnp.clip(jnp.where(idx < 0, idx + vocab, idx), 0, vocab - 1)
    return bind(embedding_p, idx, table, weight_fn=weight_fn, vocab=vocab)
