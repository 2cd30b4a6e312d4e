"""Dense matrix multiplication as an ETP primitive: ``y = x · f(W) + g(b)``."""

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._compat import bind
from .._errors import OpArgumentError
from .._typing import Params
from ._primitive import ETPRules, Factorization, register_primitive
from ._util import (
    bias_trainable,
    chain_weight_bias,
    check_transform,
    dense_scale,
    operand,
    outer_instant,
    sum_leading,
    weight_bias_trace_shapes,
)

__all__ = ["matmul", "matmul_p"]

Transform = Callable[[Array], Array] | None


def _matmul_impl(
    x: Array, w: Array, *bias: Array, has_bias: bool, weight_fn: Transform, bias_fn: Transform
) -> Array:
    weight = w if weight_fn is None else weight_fn(w)
    y = jnp.matmul(x, weight)
    if has_bias:
        (b,) = bias
        y = y + (b if bias_fn is None else bias_fn(b))
    return y


def _matmul_batch(
    args: tuple[Array, ...], dims: tuple[int | None, ...], **params: object
) -> tuple[Array, int]:
    x, *weights = args
    x_dim, *weight_dims = dims
    if x_dim is not None and all(d is None for d in weight_dims):
        x = jnp.moveaxis(x, x_dim, 0)
        if x.ndim == 2:
            return bind(matmul_p, x, *weights, **params), 0
        lead = x.shape[:-1]
        y = bind(matmul_p, x.reshape(-1, x.shape[-1]), *weights, **params)
        return y.reshape(*lead, y.shape[-1]), 0
    out = jax.vmap(lambda *ops: _matmul_impl(*ops, **params), in_axes=dims)(*args)  # type: ignore[arg-type]
    return out, 0


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    return outer_instant(x, cot, params["has_bias"])


def _solve(
    signal: Array, trace: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    grads = {"weight": sum_leading(trace["weight"] * signal[..., None, :], 2)}
    if "bias" in trace:
        grads["bias"] = sum_leading(trace["bias"] * signal, 1)
    return grads


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    g_w = jnp.outer(x, cot) if x.ndim == 1 else jnp.einsum("bi,bo->io", x, cot)
    grads = {"weight": g_w}
    if params["has_bias"]:
        grads["bias"] = sum_leading(cot, 1)
    return grads


def _factor(x: Array | None, params: Params) -> Factorization:
    assert x is not None
    inputs: dict[str, Array | None] = {"weight": x}
    if params["has_bias"]:
        inputs["bias"] = None
    return Factorization(batch_ndim=x.ndim - 1, inputs=inputs)


MATMUL_RULES = ETPRules(
    instant=_instant,
    scale=dense_scale,
    param_trace_shapes=weight_bias_trace_shapes(1, 1),
    solve_rule=_solve,
    contract_rule=_contract,
    chain_rule=chain_weight_bias,
    factor=_factor,
)

matmul_p = register_primitive(
    "etp_matmul",
    _matmul_impl,
    trainable=bias_trainable,
    x_index=0,
    rules=MATMUL_RULES,
    batch_rule=_matmul_batch,
)


def matmul(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    weight_fn: Transform = None,
    bias_fn: Transform = None,
) -> Array:
    """Dense ``y = x · weight_fn(weight) + bias_fn(bias)`` as a traceable weight operation.

    `x` is ``(in,)`` or batched ``(batch, in)``; `weight` is ``(in, out)``; `bias` is
    ``(out,)``. `weight_fn` / `bias_fn` are optional transforms applied inside the
    op (a mask, a sign constraint, a standardisation); gradients and traces are
    taken with respect to the raw stored arrays. Pass the same function object on
    every call (a fresh ``lambda`` per call forces a retrace).

    **Returns:** ``(out,)`` or ``(batch, out)``.
    """
    x = operand("matmul", "x", x)
    weight = operand("matmul", "weight", weight)
    check_transform("matmul: weight_fn", weight_fn, weight)
    check_transform("matmul: bias_fn", bias_fn, bias)
    if x.ndim not in (1, 2):
        raise OpArgumentError(
            f"matmul: x must have shape (in,) or (batch, in), got {x.shape}; "
            "for (batch, *positions, in) use etrax.nn.Linear (a width-1 etrax.conv, traced "
            "per position) or reshape the leading axes into one batch axis."
        )
    if weight.ndim != 2:
        raise OpArgumentError(f"matmul: weight must have shape (in, out), got {weight.shape}.")
    if x.shape[-1] != weight.shape[0]:
        raise OpArgumentError(
            f"matmul: x has {x.shape[-1]} input features but weight expects {weight.shape[0]} "
            f"(x {x.shape}, weight {weight.shape})."
        )
    operands = [x, weight]
    if bias is not None:
        bias = operand("matmul", "bias", bias)
        if bias.shape != (weight.shape[1],):
            raise OpArgumentError(
                f"matmul: bias must have shape ({weight.shape[1]},), got {bias.shape}."
            )
        operands.append(bias)
    return bind(
        matmul_p, *operands, has_bias=bias is not None, weight_fn=weight_fn, bias_fn=bias_fn
    )
