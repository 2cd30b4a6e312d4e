"""Low-rank adaptation as an ETP primitive: ``y = α · x · b(B) · a(A) + c(bias)``.

Traces describe the *effective* weight ``W = α · b(B) · a(A)`` (``in × out``): the
recursion is that of a dense matmul, and gradients for ``B`` and ``A`` follow by
the chain rule when they are read out.
"""

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._compat import Primitive, bind
from .._errors import OpArgumentError
from .._typing import Params, Shape
from ._common import x_batch_rule
from ._primitive import ETPRules, Factorization, register_primitive
from ._util import (
    chain_transform,
    check_transform,
    dense_scale,
    operand,
    outer_instant,
    sum_leading,
)

__all__ = ["lora_matmul", "lora_matmul_p"]

Transform = Callable[[Array], Array] | None


def _fn(f: Transform, v: Array) -> Array:
    return v if f is None else f(v)


def _impl(
    x: Array,
    b: Array,
    a: Array,
    *bias: Array,
    alpha: float,
    has_bias: bool,
    b_fn: Transform,
    a_fn: Transform,
    bias_fn: Transform,
) -> Array:
    y = alpha * ((x @ _fn(b_fn, b)) @ _fn(a_fn, a))
    if has_bias:
        y = y + _fn(bias_fn, bias[0])
    return y


def _trainable(params: Params) -> Mapping[str, int]:
    keys = {"lora_b": 1, "lora_a": 2}
    if params["has_bias"]:
        keys["bias"] = 3
    return keys


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    return outer_instant(x, cot, params["has_bias"])


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    g = jnp.outer(x, cot) if x.ndim == 1 else jnp.einsum("bi,bo->io", x, cot)
    out = {"weight": g}
    if params["has_bias"]:
        out["bias"] = sum_leading(cot, 1)
    return out


def _chain(
    grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    alpha = params["alpha"]
    b, a = weights["lora_b"], weights["lora_a"]
    eff_b, eff_a = _fn(params["b_fn"], b), _fn(params["a_fn"], a)
    out: dict[str, Array] = {}
    if "weight" in grads:
        G = grads["weight"]
        out["lora_b"] = chain_transform(params["b_fn"], b, alpha * (G @ eff_a.T))
        out["lora_a"] = chain_transform(params["a_fn"], a, alpha * (eff_b.T @ G))
    if "bias" in grads:
        out["bias"] = chain_transform(params["bias_fn"], weights["bias"], grads["bias"])
    return out


def _factor(x: Array | None, params: Params) -> Factorization:
    assert x is not None
    inputs: dict[str, Array | None] = {"weight": x}
    if params["has_bias"]:
        inputs["bias"] = None
    return Factorization(batch_ndim=x.ndim - 1, inputs=inputs)


def _effective(weights: Mapping[str, jax.ShapeDtypeStruct], params: Params) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    if "lora_b" in weights and "lora_a" in weights:
        out["weight"] = (weights["lora_b"].shape[0], weights["lora_a"].shape[1])
    if "bias" in weights:
        out["bias"] = tuple(weights["bias"].shape)
    return out


def _trace_shapes(
    x: jax.ShapeDtypeStruct | None,
    y: jax.ShapeDtypeStruct,
    weights: Mapping[str, jax.ShapeDtypeStruct],
    params: Params,
) -> dict[str, Shape]:
    assert x is not None
    batch = tuple(x.shape[:-1])
    shapes: dict[str, Shape] = {"weight": (*batch, x.shape[-1], y.shape[-1])}
    if params["has_bias"]:
        shapes["bias"] = (*batch, y.shape[-1])
    return shapes


LORA_RULES = ETPRules(
    instant=_instant,
    scale=dense_scale,
    param_trace_shapes=_trace_shapes,
    contract_rule=_contract,
    chain_rule=_chain,
    factor=_factor,
    effective_shape_rule=_effective,
)

lora_matmul_p: Primitive = register_primitive(
    "etp_lora_matmul",
    _impl,
    trainable=_trainable,
    rules=LORA_RULES,
    batch_rule=x_batch_rule(lambda: lora_matmul_p, _impl, 2),
)


def lora_matmul(
    x: ArrayLike,
    lora_b: ArrayLike,
    lora_a: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    alpha: float = 1.0,
    b_fn: Transform = None,
    a_fn: Transform = None,
    bias_fn: Transform = None,
) -> Array:
    """Low-rank linear map ``y = α · x · b_fn(B) · a_fn(A) + bias_fn(bias)``.

    `x` is ``(in,)`` or ``(batch, in)``; `lora_b` is ``(in, rank)``; `lora_a` is
    ``(rank, out)``; `bias` is ``(out,)``.
    """
    x = operand("lora_matmul", "x", x)
    b = operand("lora_matmul", "lora_b", lora_b)
    a = operand("lora_matmul", "lora_a", lora_a)
    given = None if bias is None else jnp.asarray(bias)
    for name, f, v in (("b_fn", b_fn, b), ("a_fn", a_fn, a), ("bias_fn", bias_fn, given)):
        check_transform(f"lora_matmul: {name}", f, v)
    if b.ndim != 2 or a.ndim != 2:
        raise OpArgumentError(
            f"lora_matmul: lora_b must be (in, rank) and lora_a (rank, out), got {b.shape} "
            f"and {a.shape}"
        )
    if b.shape[1] != a.shape[0]:
        raise OpArgumentError(
            f"lora_matmul: mismatched LoRA ranks: lora_b {b.shape} has rank {b.shape[1]} but "
            f"lora_a {a.shape} has rank {a.shape[0]}"
        )
    if x.ndim not in (1, 2) or x.shape[-1] != b.shape[0]:
        raise OpArgumentError(
            f"lora_matmul: x must be (in,) or (batch, in) with in={b.shape[0]}, got {x.shape}"
        )
    operands = [x, b, a]
    if bias is not None:
        bias = operand("lora_matmul", "bias", bias)
        if bias.shape != (a.shape[1],):
            raise OpArgumentError(f"lora_matmul: bias must be ({a.shape[1]},), got {bias.shape}")
        operands.append(bias)
    return bind(
        lora_matmul_p,
        *operands,
        alpha=float(alpha),
        has_bias=bias is not None,
        b_fn=b_fn,
        a_fn=a_fn,
        bias_fn=bias_fn,
    )
