"""N-d convolution as an ETP primitive: ``y = conv(x, f(K)) + g(b)``.

Each kernel element reaches every output position, so the per-parameter trace is
kept *per output position* (``batch × positions × patch × out``). With the
output's channel axis last (the default layouts ``NHC`` / ``NHWC`` / ``NDHWC``) a
position's instantaneous trace is the outer product of its input patch and
``∂h/∂y`` there, so the op factorises like a dense matmul whose batch axes are
the batch and the output positions, and whose effective weight is the kernel
laid out as ``(in_channels · kernel_size, out_channels)``.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .._compat import bind
from .._errors import NotSupportedError, OpArgumentError
from .._typing import Params, Shape
from ._primitive import ETPRules, Factorization, register_primitive
from ._util import (
    bias_trainable,
    chain_transform,
    check_transform,
    dense_scale,
    operand,
    outer_instant,
)

__all__ = ["conv", "conv_p", "default_dimension_numbers"]

Transform = Callable[[Array], Array] | None

_LAYOUTS = {
    1: ("NHC", "HIO", "NHC"),
    2: ("NHWC", "HWIO", "NHWC"),
    3: ("NDHWC", "DHWIO", "NDHWC"),
}


def default_dimension_numbers(spatial_ndim: int) -> tuple[str, str, str]:
    """Channel-last layouts: ``('NHC', 'HIO', 'NHC')`` for 1-D, and so on."""
    if spatial_ndim not in _LAYOUTS:
        raise OpArgumentError(f"conv supports 1, 2 or 3 spatial dimensions, got {spatial_ndim}")
    return _LAYOUTS[spatial_ndim]


def _dn(x_shape: Shape, k_shape: Shape, params: Params) -> Any:
    return jax.lax.conv_dimension_numbers(x_shape, k_shape, params["dimension_numbers"])


def _impl(
    x: Array,
    kernel: Array,
    *bias: Array,
    strides: tuple[int, ...],
    padding: Any,
    lhs_dilation: tuple[int, ...],
    rhs_dilation: tuple[int, ...],
    feature_group_count: int,
    dimension_numbers: tuple[str, str, str],
    has_bias: bool,
    kernel_fn: Transform,
    bias_fn: Transform,
    kernel_shape: Shape,
) -> Array:
    k = kernel if kernel_fn is None else kernel_fn(kernel)
    y = jax.lax.conv_general_dilated(
        x,
        k,
        window_strides=strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
    )
    if has_bias:
        b = bias[0] if bias_fn is None else bias_fn(bias[0])
        out_spec = _dn(x.shape, kernel.shape, dict(dimension_numbers=dimension_numbers)).out_spec
        shape = [1] * y.ndim
        shape[out_spec[1]] = b.shape[0]
        y = y + b.reshape(shape)
    return y


def _check_traceable(x_ndim: int, k_shape: Shape, params: Params) -> None:
    if params["feature_group_count"] != 1:
        raise NotSupportedError(
            f"online algorithms do not support grouped convolutions yet (feature_group_count="
            f"{params['feature_group_count']}): use feature_group_count=1, or train this model "
            "with etrax.bptt_grad."
        )
    dn = _dn((1,) * x_ndim, k_shape, params)
    if tuple(dn.out_spec) == (0, x_ndim - 1, *range(1, x_ndim - 1)):
        return
    numbers = params["dimension_numbers"]
    example = default_dimension_numbers(x_ndim - 2)
    if dn.out_spec[0] != 0 or dn.out_spec[1] != x_ndim - 1:
        raise NotSupportedError(
            "online algorithms trace convolutions whose output has its batch axis first and "
            f"its channel axis last (e.g. {example}); got dimension_numbers={numbers}. Use "
            "such an output layout and transpose after the op."
        )
    out_spatial = numbers[2][1:-1]
    kernel_spatial = "".join(c for c in numbers[1] if c not in "IO")
    raise NotSupportedError(
        "online algorithms trace convolutions whose output has its spatial axes in the "
        f"kernel's order; got dimension_numbers={numbers}: the output's spatial axes "
        f"{out_spatial!r} against the kernel's {kernel_spatial!r}. Give the kernel (or the "
        f"output) the other's spatial order (e.g. {example}) and transpose it."
    )


def _patches(x: Array, k_shape: Shape, params: Params) -> Array:
    """Input patches ``(N, *positions, in_channels · kernel_size)``."""
    dn = _dn(x.shape, k_shape, params)
    filt = [k_shape[d] for d in dn.rhs_spec[2:]]
    return jax.lax.conv_general_dilated_patches(
        x,
        filt,
        params["strides"],
        params["padding"],
        lhs_dilation=params["lhs_dilation"],
        rhs_dilation=params["rhs_dilation"],
        dimension_numbers=params["dimension_numbers"],
    )


def _kernel_shape(weights: Mapping[str, Any], params: Params) -> Shape:
    return tuple(params["kernel_shape"])


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    u = _patches(x, _kernel_shape(weights, params), params)
    return outer_instant(u, cot, params["has_bias"])


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    u = _patches(x, _kernel_shape(weights, params), params)
    out = {"weight": jnp.einsum("...p,...o->po", u, cot)}
    if params["has_bias"]:
        out["bias"] = jnp.sum(cot.reshape(-1, cot.shape[-1]), axis=0)
    return out


def _eff_to_kernel(g: Array, k_shape: Shape, params: Params) -> Array:
    dn = _dn((1,) * len(k_shape), k_shape, params)
    order = (dn.rhs_spec[1], *dn.rhs_spec[2:], dn.rhs_spec[0])  # (in, *spatial, out)
    laid = g.reshape(tuple(k_shape[d] for d in order))
    return jnp.transpose(laid, tuple(int(i) for i in np.argsort(order)))


def _chain(
    grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    k_shape = _kernel_shape(weights, params)
    out: dict[str, Array] = {}
    if "weight" in grads:
        g = _eff_to_kernel(grads["weight"], k_shape, params)
        out["weight"] = chain_transform(params["kernel_fn"], weights["weight"], g)
    if "bias" in grads:
        out["bias"] = chain_transform(params["bias_fn"], weights["bias"], grads["bias"])
    return out


def _factor(x: Array | None, params: Params) -> Factorization:
    assert x is not None
    u = _patches(x, tuple(params["kernel_shape"]), params)
    inputs: dict[str, Array | None] = {"weight": u}
    if params["has_bias"]:
        inputs["bias"] = None
    return Factorization(batch_ndim=u.ndim - 1, inputs=inputs)


def _patch_out(params: Params) -> tuple[int, int]:
    """``(in_channels · kernel_size, out_channels)``: the effective kernel's shape."""
    k_shape = tuple(params["kernel_shape"])
    dn = _dn((1,) * len(k_shape), k_shape, params)
    p = k_shape[dn.rhs_spec[1]] * int(np.prod([k_shape[d] for d in dn.rhs_spec[2:]]))
    return p, k_shape[dn.rhs_spec[0]]


def _effective(weights: Mapping[str, jax.ShapeDtypeStruct], params: Params) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    if "weight" in weights:
        out["weight"] = _patch_out(params)
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
    k_shape = tuple(params["kernel_shape"])
    _check_traceable(len(x.shape), k_shape, params)
    positions = tuple(y.shape[:-1])
    p, o = _patch_out(params)
    shapes: dict[str, Shape] = {"weight": (*positions, p, o)}
    if params["has_bias"]:
        shapes["bias"] = (*positions, o)
    return shapes


CONV_RULES = ETPRules(
    instant=_instant,
    scale=dense_scale,
    param_trace_shapes=_trace_shapes,
    contract_rule=_contract,
    chain_rule=_chain,
    factor=_factor,
    effective_shape_rule=_effective,
)

conv_p = register_primitive("etp_conv", _impl, trainable=bias_trainable, rules=CONV_RULES)


def _tuple(
    value: int | Sequence[int] | None, n: int, name: str, default: int = 1
) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    if isinstance(value, int):
        value = (value,) * n
    out = tuple(int(v) for v in value)
    if len(out) != n:
        raise OpArgumentError(f"conv: {name} needs {n} entries, got {out}")
    if any(v < 1 for v in out):
        raise OpArgumentError(f"conv: {name} must be positive integers, got {out}")
    return out


def conv(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    strides: int | Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] = "SAME",
    lhs_dilation: int | Sequence[int] | None = None,
    rhs_dilation: int | Sequence[int] | None = None,
    feature_group_count: int = 1,
    dimension_numbers: tuple[str, str, str] | None = None,
    kernel_fn: Transform = None,
    bias_fn: Transform = None,
) -> Array:
    """A batched 1-, 2- or 3-D convolution whose kernel and bias are traced online.

    `x` is ``(batch, *spatial, in)`` and `kernel` ``(*kernel_size, in, out)`` in the
    default channel-last layouts; `bias` is ``(out,)``. Other `dimension_numbers`
    work for the forward pass; online traces need the output's channel axis last.
    """
    x = operand("conv", "x", x)
    kernel = operand("conv", "kernel", kernel)
    check_transform("conv: kernel_fn", kernel_fn, kernel)
    check_transform("conv: bias_fn", bias_fn, None if bias is None else jnp.asarray(bias))
    n = kernel.ndim - 2
    if n not in (1, 2, 3) or x.ndim != kernel.ndim:
        raise OpArgumentError(
            f"conv: x {x.shape} and kernel {kernel.shape} must both have 2 + (1, 2 or 3) axes; "
            "x needs a leading batch axis (add one with x[None])"
        )
    dn = dimension_numbers if dimension_numbers is not None else default_dimension_numbers(n)
    lhs = _tuple(lhs_dilation, n, "lhs_dilation")
    if isinstance(padding, str):
        pad: Any = padding.upper()
        if pad not in ("SAME", "VALID", "SAME_LOWER"):
            raise OpArgumentError(
                f"conv: padding must be 'SAME', 'VALID', 'SAME_LOWER' or one (low, high) pair "
                f"per spatial axis, got {padding!r}"
            )
        if any(d != 1 for d in lhs):
            raise OpArgumentError(
                f"conv: lhs_dilation {lhs} needs explicit padding, one (low, high) pair per "
                f"spatial axis, not {padding!r}"
            )
    else:
        pad = tuple((int(a), int(b)) for a, b in padding)
        if len(pad) != n:
            raise OpArgumentError(
                f"conv: padding needs one (low, high) pair per spatial axis ({n}), got {pad}"
            )
    given: object = feature_group_count
    groups = 0
    if isinstance(given, int | np.integer) and not isinstance(given, bool):
        groups = int(given)
    if groups < 1:
        raise OpArgumentError(
            f"conv: feature_group_count must be a positive int, got {feature_group_count!r}"
        )
    params = dict(
        strides=_tuple(strides, n, "strides"),
        padding=pad,
        lhs_dilation=lhs,
        rhs_dilation=_tuple(rhs_dilation, n, "rhs_dilation"),
        feature_group_count=groups,
        dimension_numbers=tuple(dn),
        kernel_fn=kernel_fn,
        bias_fn=bias_fn,
        kernel_shape=tuple(kernel.shape),
    )
    try:
        numbers = jax.lax.conv_dimension_numbers(x.shape, kernel.shape, tuple(dn))
    except (TypeError, ValueError) as err:
        raise OpArgumentError(f"conv: dimension_numbers {dn!r} do not fit: {err}") from err
    channels = x.shape[numbers.lhs_spec[1]] // int(feature_group_count)
    if channels != kernel.shape[numbers.rhs_spec[1]]:
        raise OpArgumentError(
            f"conv: x has {x.shape[numbers.lhs_spec[1]]} input channels (in "
            f"{feature_group_count} group(s)) but the kernel {kernel.shape} expects "
            f"{kernel.shape[numbers.rhs_spec[1]]} per group"
        )
    operands = [x, kernel]
    if bias is not None:
        bias = operand("conv", "bias", bias)
        out_ch = kernel.shape[jax.lax.conv_dimension_numbers(x.shape, kernel.shape, dn).rhs_spec[0]]
        if bias.shape != (out_ch,):
            raise OpArgumentError(f"conv: bias must be ({out_ch},), got {bias.shape}")
        operands.append(bias)
    return bind(conv_p, *operands, has_bias=bias is not None, **params)


def shared_product(
    x: ArrayLike, weight: ArrayLike, bias: ArrayLike | None = None, kernel_fn: Transform = None
) -> Array:
    """``x · weight + bias`` for ``x`` of shape ``(batch, *positions, in)`` (one to three
    position axes sharing the ``(in, out)`` weight), as a width-1 `conv`: each
    position's output is traced to the weight on its own, so it lines up with a hidden
    state of shape ``(batch, *positions, out)`` (`etrax.matmul` takes one row axis
    only). `kernel_fn` acts on the ``(1, …, 1, in, out)`` kernel."""
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    k = x.ndim - 2
    if k not in (1, 2, 3) or weight.ndim != 2:
        raise OpArgumentError(
            f"shared_product: x must be (batch, *positions, in) with 1 to 3 position axes and "
            f"weight (in, out), got x {x.shape} and weight {weight.shape}"
        )
    kernel = jnp.reshape(weight, (1,) * k + weight.shape)
    return conv(x, kernel, bias, strides=(1,) * k, padding=((0, 0),) * k, kernel_fn=kernel_fn)
