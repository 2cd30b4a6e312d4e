"""Layers built on the op zoo: convolutions, sparse, grouped and low-rank linear
maps, and embeddings."""

import brainstate
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from ..ops import SparsePattern, conv, embedding, grouped_matmul, lora_matmul, sparse_matmul
from ._common import Initializer, init_param, positive_int

__all__ = ["Conv1d", "Conv2d", "Conv3d", "Embedding", "GroupedLinear", "LoRA", "SparseLinear"]


def _int_tuple(value: int | tuple[int, ...], n: int, name: str) -> tuple[int, ...]:
    values = tuple(value) if isinstance(value, tuple | list) else (value,) * n
    if len(values) != n:
        raise ValueError(f"{name} must be a positive int or {n} positive ints, got {value!r}")
    return tuple(positive_int(name, v) for v in values)  # 2.5 is refused, not truncated


class _ConvNd(brainstate.nn.Module):
    """Shared implementation of `Conv1d`/`Conv2d`/`Conv3d` (not public)."""

    spatial: int = 0

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: str = "SAME",
        dilation: int | tuple[int, ...] = 1,
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        n = self.spatial
        in_channels = positive_int(f"{type(self).__name__}: in_channels", in_channels)
        out_channels = positive_int(f"{type(self).__name__}: out_channels", out_channels)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _int_tuple(kernel_size, n, "kernel_size")
        self.stride = _int_tuple(stride, n, "stride")
        self.dilation = _int_tuple(dilation, n, "dilation")
        self.padding = padding
        if w_init is None:
            w_init = brainstate.nn.init.KaimingNormal()
        params = {"weight": init_param(w_init, (*self.kernel_size, in_channels, out_channels))}
        if b_init is not None:
            if isinstance(b_init, str) and b_init == "zeros":
                b_init = brainstate.nn.init.ZeroInit()
            params["bias"] = init_param(b_init, (out_channels,))
        self.weight = brainstate.ParamState(params)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        unbatched = x.ndim == self.spatial + 1  # one sample: a batch axis of 1 around it
        if not (unbatched or x.ndim == self.spatial + 2):
            raise ValueError(
                f"{type(self).__name__} expects (batch, *spatial, channels) or "
                f"(*spatial, channels) with {self.spatial} spatial axes, got {x.shape}"
            )
        p = self.weight.value
        y = conv(
            x[None] if unbatched else x,
            p["weight"],
            p.get("bias"),
            strides=self.stride,
            padding=self.padding,
            rhs_dilation=self.dilation,
        )
        return y[0] if unbatched else y


class Conv1d(_ConvNd):
    """1-D convolution on ``(batch, length, in_channels)`` (channel-last), traced
    per output position. Kernel ``(kernel_size, in, out)``, bias ``(out,)``.

    ``y[b, p, o] = bias[o] + Σ_{k, i} x[b, s·p + d·k − pad, i] · W[k, i, o]`` over
    the kernel offsets ``k`` (``s``: `stride`, ``d``: `dilation`). D-RTRL keeps
    one trace per output position ``p``, so a state fed by the convolution learns
    the kernel exactly when its own recurrence is element-wise.

    **Arguments:**

    - `in_channels`, `out_channels`: channels of ``x`` and ``y`` (the last axis).
    - `kernel_size`, `stride`, `dilation`: an int (same for every spatial axis) or
      one int per spatial axis.
    - `padding`: ``"SAME"`` (default: output length ``⌈n / stride⌉``) or ``"VALID"``.
    - `w_init`: kernel initialiser (default Kaiming normal); `b_init`: bias
      initialiser (default zeros; `None` for no bias).

    One sample ``(length, in_channels)`` is convolved as a batch of one (and the
    axis dropped again), so per-sample models (``etrax.compile(..., vmap=True)``)
    work too. Parameters live in one ``ParamState`` ``weight`` holding
    ``{'weight': kernel, 'bias': bias}``.
    """

    spatial = 1


class Conv2d(_ConvNd):
    """2-D convolution on ``(batch, height, width, in_channels)``, traced per output
    position. Kernel ``(kh, kw, in, out)``, bias ``(out,)``; the equation and
    arguments are those of `Conv1d` with ``p`` and ``k`` ranging over 2-D offsets.
    """

    spatial = 2


class Conv3d(_ConvNd):
    """3-D convolution on ``(batch, depth, height, width, in_channels)``, traced per
    output position. Kernel ``(kd, kh, kw, in, out)``, bias ``(out,)``; the equation
    and arguments are those of `Conv1d` with ``p`` and ``k`` ranging over 3-D offsets.
    """

    spatial = 3


class SparseLinear(brainstate.nn.Module):
    """``y = x · S + b`` with a fixed sparsity pattern; only the stored values learn,
    and their traces hold one entry per stored value.

    **Arguments:**

    - `in_size`, `out_size`: the dense shape of ``S``.
    - `mask`: a boolean ``(in, out)`` mask of the stored entries, or `None` to draw
      one with density `density` from `seed`.
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        mask: ArrayLike | None = None,
        density: float = 0.2,
        seed: int = 0,
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        in_size = positive_int("SparseLinear: in_size", in_size)
        out_size = positive_int("SparseLinear: out_size", out_size)
        if mask is None:
            if not 0.0 < density <= 1.0:
                raise ValueError(f"density must be in (0, 1], got {density}")
            mask = np.random.default_rng(seed).random((in_size, out_size)) < density
        m = np.asarray(mask, dtype=bool)
        if m.shape != (in_size, out_size):
            raise ValueError(f"mask must be ({in_size}, {out_size}), got {m.shape}")
        self.pattern = SparsePattern.from_mask(m)
        if w_init is None:
            w_init = brainstate.nn.init.Normal(
                scale=float(np.sqrt(2.0 / max(1.0, m.sum(0).mean())))
            )
        params = {"weight": init_param(w_init, (self.pattern.nnz,))}
        if b_init is not None:
            if isinstance(b_init, str) and b_init == "zeros":
                b_init = brainstate.nn.init.ZeroInit()
            params["bias"] = init_param(b_init, (out_size,))
        self.weight = brainstate.ParamState(params)
        self.in_size = (in_size,)
        self.out_size = (out_size,)

    def update(self, x: ArrayLike) -> Array:
        p = self.weight.value
        return sparse_matmul(jnp.asarray(x), p["weight"], self.pattern, p.get("bias"))


class GroupedLinear(brainstate.nn.Module):
    """Block-diagonal linear map on ``(..., groups, in)`` → ``(..., groups, out)``:
    ``y[..., g, o] = b[g, o] + Σ_i x[..., g, i] · W[g, i, o]``.

    Traces are ``(groups, in, out)`` per state slot, the size of ``W`` (not of the
    equivalent dense ``(groups·in, groups·out)`` matrix).

    **Arguments:**

    - `groups`, `in_size`, `out_size`: the block count and each block's shape.
    - `w_init`: initialiser of ``W`` (default Kaiming normal); `b_init`: of ``b``
      (default zeros; `None` for no bias).
    """

    def __init__(
        self,
        groups: int,
        in_size: int,
        out_size: int,
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        groups = positive_int("GroupedLinear: groups", groups)
        in_size = positive_int("GroupedLinear: in_size", in_size)
        out_size = positive_int("GroupedLinear: out_size", out_size)
        if w_init is None:
            w_init = brainstate.nn.init.KaimingNormal()
        params = {"weight": init_param(w_init, (groups, in_size, out_size))}
        if b_init is not None:
            if isinstance(b_init, str) and b_init == "zeros":
                b_init = brainstate.nn.init.ZeroInit()
            params["bias"] = init_param(b_init, (groups, out_size))
        self.weight = brainstate.ParamState(params)
        self.in_size = (groups, in_size)
        self.out_size = (groups, out_size)

    def update(self, x: ArrayLike) -> Array:
        p = self.weight.value
        return grouped_matmul(jnp.asarray(x), p["weight"], p.get("bias"))


class LoRA(brainstate.nn.Module):
    """A low-rank linear map ``y = α · x · B · A`` (``B``: ``(in, rank)``, ``A``:
    ``(rank, out)``), plus ``base(x)`` when a base module is given. ``A`` starts at
    zero, so the map starts at zero. Traces follow the effective ``in × out`` weight
    ``W = α·B·A``; gradients map back to ``B`` and ``A`` by the chain rule.

    **Arguments:**

    - `in_size`, `rank`, `out_size`: the shapes of ``B`` and ``A``.
    - `alpha`: the scale ``α`` (default ``1 / rank``).
    - `base_module`: an optional (usually frozen) module added to the output.
    - `b_init`: initialiser of ``B`` (default Kaiming normal).
    """

    def __init__(
        self,
        in_size: int,
        rank: int,
        out_size: int,
        alpha: float | None = None,
        base_module: brainstate.nn.Module | None = None,
        b_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        in_size = positive_int("LoRA: in_size", in_size)
        rank = positive_int("LoRA: rank", rank)
        out_size = positive_int("LoRA: out_size", out_size)
        if b_init is None:
            b_init = brainstate.nn.init.KaimingNormal()
        self.alpha = 1.0 / rank if alpha is None else float(alpha)
        self.weight = brainstate.ParamState(
            {
                "lora_b": init_param(b_init, (in_size, rank)),
                "lora_a": init_param(brainstate.nn.init.ZeroInit(), (rank, out_size)),
            }
        )
        self.base_module = base_module
        self.in_size = (in_size,)
        self.out_size = (out_size,)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        p = self.weight.value
        y = lora_matmul(x, p["lora_b"], p["lora_a"], alpha=self.alpha)
        if self.base_module is not None:
            y = y + self.base_module(x)
        return y


class Embedding(brainstate.nn.Module):
    """A learnable lookup table: ``y[..., :] = E[indices[...], :]`` with ``E`` of shape
    ``(num_embeddings, embedding_dim)``.

    The indices must be integers (float indices raise a `TypeError` when the
    layer is called); an index's trace is its one-hot row, so traces have the size
    of ``E`` per state slot.

    **Arguments:**

    - `num_embeddings`, `embedding_dim`: the table's shape.
    - `w_init`: initialiser of ``E`` (default standard normal).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        w_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        num_embeddings = positive_int("Embedding: num_embeddings", num_embeddings)
        embedding_dim = positive_int("Embedding: embedding_dim", embedding_dim)
        if w_init is None:
            w_init = brainstate.nn.init.Normal()
        self.weight = brainstate.ParamState(init_param(w_init, (num_embeddings, embedding_dim)))
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    def update(self, indices: ArrayLike) -> Array:
        return embedding(indices, self.weight.value)
