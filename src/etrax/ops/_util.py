"""Helpers shared by the built-in ETP ops."""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._compat import shape_struct
from .._errors import OpArgumentError
from .._typing import Params, Shape

__all__ = [
    "bias_trainable",
    "chain_transform",
    "chain_weight_bias",
    "check_transform",
    "dense_scale",
    "outer_instant",
    "sum_leading",
    "weight_bias_trace_shapes",
]


def chain_transform(fn: Callable[[Array], Array] | None, raw: Array, grad: Array) -> Array:
    """Pull a gradient with respect to ``fn(raw)`` back to ``raw`` (identity if `fn` is None)."""
    if fn is None:
        return grad
    _, vjp = jax.vjp(fn, raw)
    (out,) = vjp(grad.astype(raw.dtype))
    result: Array = out
    return result


def sum_leading(value: Array, keep: int) -> Array:
    """Sum all but the last `keep` axes."""
    extra = value.ndim - keep
    if extra <= 0:
        return value
    return jnp.sum(value, axis=tuple(range(extra)))


def operand(op: str, name: str, value: object) -> Array:
    """`value` as a JAX array; anything that is not array-like (a dict, a list of arrays
    of different shapes, a string) is an `OpArgumentError` naming the op and argument."""
    if isinstance(value, Mapping):
        raise OpArgumentError(
            f"{op}: {name} must be an array, got a dict with keys {list(value)}; pass the "
            "array itself (an etrax.nn.Linear's ParamState holds {'weight': W, 'bias': b}: "
            "pass value['weight'] and value['bias'])."
        )
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as err:
        raise OpArgumentError(
            f"{op}: {name} must be an array (a JAX or NumPy array, or a number), got "
            f"{type(value).__name__}: {err}"
        ) from None


def check_transform(name: str, fn: object, value: Any = None) -> None:
    """Validate a ``weight_fn``/``bias_fn`` argument; with the `value` it transforms,
    also that it keeps the value's shape (the ops apply it element-wise)."""
    if fn is not None and not callable(fn):
        raise OpArgumentError(f"{name} must be a callable or None, got {type(fn).__name__}.")
    if fn is None or value is None:
        return
    shape, dtype = tuple(jnp.shape(value)), jnp.result_type(value)
    try:
        out = _shape_after(fn, shape, dtype)  # once per (function, shape, dtype)
    except TypeError:  # an unhashable function: traced every time
        out = _shape_after.__wrapped__(fn, shape, dtype)
    if out != shape:
        raise OpArgumentError(
            f"{name} must keep the shape {shape} of the array it transforms (a mask, a sign "
            f"constraint, a standardisation), got {out}; reshape or transpose the stored "
            "array instead."
        )


@functools.lru_cache(maxsize=256)
def _shape_after(fn: Callable[[Any], Any], shape: Shape, dtype: Any) -> Any:
    """The shape of ``fn(x)`` for ``x`` of `shape` and `dtype` (traced, not run)."""
    return getattr(jax.eval_shape(fn, shape_struct(shape, dtype)), "shape", None)


def bias_trainable(params: Params) -> Mapping[str, int]:
    """``{'weight': 1, 'bias': 2}`` for ops ``(x, weight[, bias])`` with a ``has_bias`` param."""
    return {"weight": 1, "bias": 2} if params["has_bias"] else {"weight": 1}


def chain_weight_bias(
    grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    """The `chain` rule of ops applying ``weight_fn`` / ``bias_fn`` element-wise."""
    out = {"weight": chain_transform(params["weight_fn"], weights["weight"], grads["weight"])}
    if "bias" in grads:
        out["bias"] = chain_transform(params["bias_fn"], weights["bias"], grads["bias"])
    return out


def weight_bias_trace_shapes(
    x_features: int, y_features: int
) -> Callable[
    [jax.ShapeDtypeStruct | None, jax.ShapeDtypeStruct, Mapping[str, jax.ShapeDtypeStruct], Params],
    dict[str, Shape],
]:
    """The trace-shape rule of an op whose weight trace is the weight itself per batch
    element of ``x`` (``x``'s axes before its last `x_features`), with a bias shaped
    like ``y``'s last `y_features` axes."""

    def rule(
        x: jax.ShapeDtypeStruct | None,
        y: jax.ShapeDtypeStruct,
        weights: Mapping[str, jax.ShapeDtypeStruct],
        params: Params,
    ) -> dict[str, Shape]:
        assert x is not None
        batch = tuple(x.shape[: len(x.shape) - x_features])
        shapes: dict[str, Shape] = {"weight": batch + tuple(weights["weight"].shape)}
        if params["has_bias"]:
            shapes["bias"] = batch + tuple(y.shape[len(y.shape) - y_features :])
        return shapes

    return rule


def outer_instant(u: Array, cot: Array, has_bias: bool) -> dict[str, Array]:
    """The instantaneous trace of a dense-like op: ``u ⊗ cot`` (``u`` the op's input or
    its patches, ``(..., I)``; ``cot`` ``(..., O)``), plus ``cot`` for a bias."""
    out = {"weight": u[..., :, None] * cot[..., None, :]}
    if has_bias:
        out["bias"] = cot
    return out


def dense_scale(hvec: Array, trace: Mapping[str, Array], params: Params) -> dict[str, Array]:
    """The `scale` rule of a dense-like op: weight ``[i, o]`` feeds output ``o``."""
    out = {"weight": trace["weight"] * hvec[..., None, :]}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hvec
    return out
