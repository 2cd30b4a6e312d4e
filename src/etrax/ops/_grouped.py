"""Block-diagonal (grouped) matrix multiplication: ``y[..., g, :] = x[..., g, :] · W[g]``."""

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._compat import Primitive, bind
from .._errors import OpArgumentError
from .._typing import Params, Shape
from ._common import x_batch_rule
from ._primitive import ETPRules, register_primitive
from ._util import (
    bias_trainable,
    chain_weight_bias,
    check_transform,
    operand,
    sum_leading,
)

__all__ = ["grouped_matmul", "grouped_matmul_p"]

Transform = Callable[[Array], Array] | None


def _impl(
    x: Array,
    w: Array,
    *bias: Array,
    has_bias: bool,
    weight_fn: Transform,
    bias_fn: Transform,
    merge_groups: bool = False,
) -> Array:
    weight = w if weight_fn is None else weight_fn(w)
    y = jnp.einsum("...gk,gkn->...gn", x, weight)
    if has_bias:
        (b,) = bias
        y = y + (b if bias_fn is None else bias_fn(b))
    return y.reshape(*y.shape[:-2], -1) if merge_groups else y


def _split(value: Array, weight_shape: tuple[int, ...], params: Params) -> Array:
    """An output-shaped value with its groups on an axis of their own, ``(..., G, N)``:
    split back from ``(..., G·N)`` when the op merges them (`weight_shape` ends in the
    weight's ``(G, K, N)``)."""
    if not params.get("merge_groups", False):
        return value
    groups, n = weight_shape[-3], weight_shape[-1]
    return value.reshape(*value.shape[:-1], groups, n)


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    cot = _split(cot, weights["weight"].shape, params)
    out = {"weight": x[..., :, :, None] * cot[..., :, None, :]}
    if params["has_bias"]:
        out["bias"] = cot
    return out


def _scale(hvec: Array, trace: Mapping[str, Array], params: Params) -> dict[str, Array]:
    hvec = _split(hvec, trace["weight"].shape, params)
    out = {"weight": trace["weight"] * hvec[..., :, None, :]}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hvec
    return out


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    cot = _split(cot, weights["weight"].shape, params)
    out = {"weight": jnp.einsum("...gk,...gn->gkn", x, cot)}
    if params["has_bias"]:
        out["bias"] = sum_leading(cot, 2)
    return out


def _trace_shapes(
    x: jax.ShapeDtypeStruct | None,
    y: jax.ShapeDtypeStruct,
    weights: Mapping[str, jax.ShapeDtypeStruct],
    params: Params,
) -> dict[str, Shape]:
    """The weight's trace: the weight per batch element of ``x``; the bias's: the bias
    ``(G, N)`` per batch element (``y``'s groups split apart when it merges them)."""
    assert x is not None
    batch = tuple(x.shape[:-2])
    shapes: dict[str, Shape] = {"weight": batch + tuple(weights["weight"].shape)}
    if params["has_bias"]:
        groups, _, n = weights["weight"].shape
        shapes["bias"] = (*batch, groups, n)
    return shapes


GROUPED_RULES = ETPRules(
    instant=_instant,
    scale=_scale,
    param_trace_shapes=_trace_shapes,
    contract_rule=_contract,
    chain_rule=chain_weight_bias,
)

grouped_matmul_p: Primitive = register_primitive(
    "etp_grouped_matmul",
    _impl,
    trainable=bias_trainable,
    rules=GROUPED_RULES,
    batch_rule=x_batch_rule(lambda: grouped_matmul_p, _impl, 3),
)


def grouped_matmul(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    weight_fn: Transform = None,
    bias_fn: Transform = None,
    merge_groups: bool = False,
) -> Array:
    """Block-diagonal linear map: ``y[..., g, n] = Σ_k x[..., g, k] W[g, k, n] + b[g, n]``.

    `x` is ``(G, K)`` or ``(batch, G, K)``; `weight` is ``(G, K, N)``; `bias` ``(G, N)``.
    Traces are ``G`` times smaller than those of the equivalent dense block matrix.
    With ``merge_groups=True`` the output is ``(..., G·N)``, the groups merged into one
    axis (``y.reshape(..., G * N)``): it lines up with a flat hidden state of ``G``
    heads of ``N`` units each.
    """
    x = operand("grouped_matmul", "x", x)
    weight = operand("grouped_matmul", "weight", weight)
    check_transform("grouped_matmul: weight_fn", weight_fn, weight)
    check_transform("grouped_matmul: bias_fn", bias_fn, None if bias is None else jnp.asarray(bias))
    if weight.ndim != 3:
        raise OpArgumentError(
            f"grouped_matmul: weight must be (groups, in, out), got {weight.shape}"
        )
    if x.ndim not in (2, 3) or x.shape[-2:] != weight.shape[:2]:
        raise OpArgumentError(
            f"grouped_matmul: x must be (groups, in) or (batch, groups, in) matching weight "
            f"{weight.shape[:2]}, got {x.shape}"
        )
    operands = [x, weight]
    if bias is not None:
        bias = operand("grouped_matmul", "bias", bias)
        if bias.shape != (weight.shape[0], weight.shape[2]):
            raise OpArgumentError(
                f"grouped_matmul: bias must be {(weight.shape[0], weight.shape[2])}, "
                f"got {bias.shape}"
            )
        operands.append(bias)
    return bind(
        grouped_matmul_p,
        *operands,
        has_bias=bias is not None,
        weight_fn=weight_fn,
        bias_fn=bias_fn,
        merge_groups=merge_groups,
    )
