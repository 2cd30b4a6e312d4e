"""Block-diagonal (grouped) matrix multiplication: ``y[..., g, :] = x[..., g, :] · W[g]``."""

from collections.abc import Callable, Mapping

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._compat import Primitive, bind
from .._errors import OpArgumentError
from .._typing import Params
from ._common import x_batch_rule
from ._primitive import ETPRules, register_primitive
from ._util import (
    bias_trainable,
    chain_weight_bias,
    check_transform,
    operand,
    sum_leading,
    weight_bias_trace_shapes,
)

__all__ = ["grouped_matmul", "grouped_matmul_p"]

Transform = Callable[[Array], Array] | None


def _impl(
    x: Array, w: Array, *bias: Array, has_bias: bool, weight_fn: Transform, bias_fn: Transform
) -> Array:
    weight = w if weight_fn is None else weight_fn(w)
    y = jnp.einsum("...gk,gkn->...gn", x, weight)
    if has_bias:
        (b,) = bias
        y = y + (b if bias_fn is None else bias_fn(b))
    return y


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    out = {"weight": x[..., :, :, None] * cot[..., :, None, :]}
    if params["has_bias"]:
        out["bias"] = cot
    return out


def _scale(hvec: Array, trace: Mapping[str, Array], params: Params) -> dict[str, Array]:
    out = {"weight": trace["weight"] * hvec[..., :, None, :]}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hvec
    return out


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    out = {"weight": jnp.einsum("...gk,...gn->gkn", x, cot)}
    if params["has_bias"]:
        out["bias"] = sum_leading(cot, 2)
    return out


GROUPED_RULES = ETPRules(
    instant=_instant,
    scale=_scale,
    param_trace_shapes=weight_bias_trace_shapes(2, 2),
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
) -> Array:
    """Block-diagonal linear map: ``y[..., g, n] = Σ_k x[..., g, k] W[g, k, n] + b[g, n]``.

    `x` is ``(G, K)`` or ``(batch, G, K)``; `weight` is ``(G, K, N)``; `bias` ``(G, N)``.
    Traces are ``G`` times smaller than those of the equivalent dense block matrix.
    """
    x = operand("grouped_matmul", "x", x)
    weight = operand("grouped_matmul", "weight", weight)
    check_transform("grouped_matmul: weight_fn", weight_fn, weight)
    check_transform(
        "grouped_matmul: bias_fn", bias_fn, None if bias is None else jnp.asarray(bias)
    )
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
        grouped_matmul_p, *operands, has_bias=bias is not None, weight_fn=weight_fn, bias_fn=bias_fn
    )
