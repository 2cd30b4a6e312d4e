"""A learnable element-wise parameter as an ETP primitive: ``y = f(w)``."""

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._compat import bind
from .._typing import Params, Shape
from ._primitive import ETPRules, Factorization, register_primitive
from ._util import chain_transform, check_transform, operand, sum_leading

__all__ = ["element_wise", "element_wise_p"]

Transform = Callable[[Array], Array] | None


def _impl(w: Array, *, weight_fn: Transform) -> Array:
    return w if weight_fn is None else weight_fn(w)


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    return {"weight": cot}


def _scale(hvec: Array, trace: Mapping[str, Array], params: Params) -> dict[str, Array]:
    return {"weight": trace["weight"] * hvec}


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    return {"weight": sum_leading(cot, jnp.ndim(weights["weight"]))}


def _chain(
    grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    return {"weight": chain_transform(params["weight_fn"], weights["weight"], grads["weight"])}


def _factor(x: Array | None, params: Params) -> Factorization:
    return Factorization(batch_ndim=0, inputs={"weight": None})


def _trace_shapes(
    x: jax.ShapeDtypeStruct | None,
    y: jax.ShapeDtypeStruct,
    weights: Mapping[str, jax.ShapeDtypeStruct],
    params: Params,
) -> dict[str, Shape]:
    return {"weight": tuple(y.shape)}


ELEMENT_WISE_RULES = ETPRules(
    instant=_instant,
    scale=_scale,
    param_trace_shapes=_trace_shapes,
    contract_rule=_contract,
    chain_rule=_chain,
    factor=_factor,
)


def _batch(
    args: tuple[Array, ...], dims: tuple[int | None, ...], **params: object
) -> tuple[Array, int]:
    (w,) = args
    (d,) = dims
    assert d is not None
    return bind(element_wise_p, w, **params), d


element_wise_p = register_primitive(
    "etp_element_wise",
    _impl,
    trainable={"weight": 0},
    x_index=None,
    gradient_enabled=True,
    rules=ELEMENT_WISE_RULES,
    batch_rule=_batch,
)


def element_wise(weight: ArrayLike, *, weight_fn: Transform = None) -> Array:
    """A learnable per-element parameter ``y = weight_fn(weight)`` (e.g. a leak, a
    threshold, a gate bias) whose influence on hidden states is traced online.

    `weight_fn` must be element-wise and shape-preserving (default: identity). The
    op has no data input, so it never cuts a path between other operations.
    """
    w = operand("element_wise", "weight", weight)
    check_transform("element_wise: weight_fn", weight_fn, w)
    return bind(element_wise_p, w, weight_fn=weight_fn)
