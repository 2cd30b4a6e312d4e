"""Sparse matrix multiplication with a fixed sparsity pattern as an ETP primitive.

The weight is the vector of its ``nnz`` stored values; the pattern (row and
column of each value) is static metadata. etrax uses its own coordinate (COO)
pattern rather than `jax.experimental.sparse` or brainevent: the values are then
an ordinary array in a `ParamState` (so they are traced and optimised like any
weight), the pattern is hashable and part of the compiled graph, batching is a
plain leading axis, and the per-parameter trace holds exactly one entry per
stored value (``nnz × S`` per sample). A BCOO array keeps its indices as a traced
leaf (they would be differentiated, batched and carried through `jit` as data),
and brainevent adds a dependency for event-driven kernels that only pay off with
binary spike inputs. `SparsePattern.from_bcoo` converts a BCOO matrix.
"""

from collections.abc import Callable, Mapping
from typing import Any, final

import jax
import jax.numpy as jnp
import numpy as np
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

__all__ = ["SparsePattern", "sparse_matmul", "sparse_matmul_p"]

Transform = Callable[[Array], Array] | None


@final
class SparsePattern:
    """The positions of a sparse ``(in, out)`` matrix's stored values (immutable)."""

    __slots__ = ("_key", "cols", "rows", "shape")

    rows: np.ndarray[Any, Any]
    cols: np.ndarray[Any, Any]
    shape: tuple[int, int]
    _key: tuple[Any, ...]

    def __init__(self, rows: ArrayLike, cols: ArrayLike, shape: tuple[int, int]) -> None:
        r = np.asarray(rows, dtype=np.int32).reshape(-1)
        c = np.asarray(cols, dtype=np.int32).reshape(-1)
        if r.shape != c.shape:
            raise OpArgumentError(
                f"SparsePattern: rows {r.shape} and cols {c.shape} differ in length"
            )
        n_in, n_out = (int(s) for s in shape)
        if r.size and (r.min() < 0 or r.max() >= n_in or c.min() < 0 or c.max() >= n_out):
            raise OpArgumentError(f"SparsePattern: indices fall outside the shape {(n_in, n_out)}")
        r.setflags(write=False)
        c.setflags(write=False)
        object.__setattr__(self, "rows", r)
        object.__setattr__(self, "cols", c)
        object.__setattr__(self, "shape", (n_in, n_out))
        object.__setattr__(self, "_key", (r.tobytes(), c.tobytes(), (n_in, n_out)))

    @classmethod
    def from_mask(cls, mask: ArrayLike) -> "SparsePattern":
        """The pattern of the non-zero entries of a dense ``(in, out)`` mask."""
        m = np.asarray(mask)
        rows, cols = np.nonzero(m)
        return cls(rows, cols, (m.shape[0], m.shape[1]))

    @classmethod
    def from_bcoo(cls, matrix: Any) -> tuple["SparsePattern", Array]:
        """The pattern and stored values of a 2-D `jax.experimental.sparse.BCOO` matrix.

        **Returns:** ``(pattern, values)``: put `values` in a `ParamState` and call
        ``sparse_matmul(x, values, pattern)``. The matrix's indices must be concrete
        (not traced), as the pattern is static; duplicate indices are kept and summed.
        """
        from jax.experimental import sparse

        if not isinstance(matrix, sparse.BCOO):
            raise OpArgumentError(
                f"SparsePattern.from_bcoo: expected a jax.experimental.sparse.BCOO, got "
                f"{type(matrix).__name__}"
            )
        if matrix.ndim != 2 or matrix.n_batch != 0 or matrix.n_dense != 0:
            raise OpArgumentError(
                "SparsePattern.from_bcoo: need a 2-D BCOO matrix without batch or dense "
                f"dimensions, got shape {matrix.shape} (n_batch={matrix.n_batch}, "
                f"n_dense={matrix.n_dense})"
            )
        try:
            indices = np.asarray(matrix.indices)
        except jax.errors.TracerArrayConversionError as err:
            raise OpArgumentError(
                "SparsePattern.from_bcoo: the matrix's indices are traced; build the pattern "
                "outside jit (the pattern is static)"
            ) from err
        pattern = cls(indices[:, 0], indices[:, 1], (matrix.shape[0], matrix.shape[1]))
        return pattern, jnp.asarray(matrix.data)

    @property
    def nnz(self) -> int:
        """The number of stored values."""
        return int(self.rows.size)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("SparsePattern is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SparsePattern) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"SparsePattern(shape={self.shape}, nnz={self.nnz})"


def _impl(
    x: Array,
    data: Array,
    *bias: Array,
    pattern: SparsePattern,
    has_bias: bool,
    weight_fn: Transform,
    bias_fn: Transform,
) -> Array:
    w = data if weight_fn is None else weight_fn(data)
    vals = x[..., pattern.rows] * w
    y = jnp.zeros((*x.shape[:-1], pattern.shape[1]), vals.dtype).at[..., pattern.cols].add(vals)
    if has_bias:
        y = y + (bias[0] if bias_fn is None else bias_fn(bias[0]))
    return y


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    p: SparsePattern = params["pattern"]
    out = {"weight": x[..., p.rows] * cot[..., p.cols]}
    if params["has_bias"]:
        out["bias"] = cot
    return out


def _scale(hvec: Array, trace: Mapping[str, Array], params: Params) -> dict[str, Array]:
    p: SparsePattern = params["pattern"]
    out = {"weight": trace["weight"] * hvec[..., p.cols]}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hvec
    return out


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    p: SparsePattern = params["pattern"]
    out = {"weight": sum_leading(x[..., p.rows] * cot[..., p.cols], 1)}
    if params["has_bias"]:
        out["bias"] = sum_leading(cot, 1)
    return out


SPARSE_RULES = ETPRules(
    instant=_instant,
    scale=_scale,
    param_trace_shapes=weight_bias_trace_shapes(1, 1),
    contract_rule=_contract,
    chain_rule=chain_weight_bias,
)

sparse_matmul_p: Primitive = register_primitive(
    "etp_sparse_matmul",
    _impl,
    trainable=bias_trainable,
    rules=SPARSE_RULES,
    batch_rule=x_batch_rule(lambda: sparse_matmul_p, _impl, 2),
)


def sparse_matmul(
    x: ArrayLike,
    data: ArrayLike,
    pattern: SparsePattern,
    bias: ArrayLike | None = None,
    *,
    weight_fn: Transform = None,
    bias_fn: Transform = None,
) -> Array:
    """``y = x · S + b`` for a sparse ``S`` whose stored values are `data` at the
    positions of `pattern` (``y[o] = Σ_{n: col_n = o} x[row_n] · data[n]``).

    `x` is ``(in,)`` or ``(batch, in)``; `data` is ``(nnz,)``; `bias` is ``(out,)``.
    """
    if not isinstance(pattern, SparsePattern):
        raise OpArgumentError(
            "sparse_matmul: pattern must be an etrax.ops.SparsePattern, got "
            f"{type(pattern).__name__}"
        )
    x = operand("sparse_matmul", "x", x)
    data = operand("sparse_matmul", "data", data)
    check_transform("sparse_matmul: weight_fn", weight_fn, data)
    check_transform("sparse_matmul: bias_fn", bias_fn, None if bias is None else jnp.asarray(bias))
    if data.shape != (pattern.nnz,):
        raise OpArgumentError(
            f"sparse_matmul: data must be ({pattern.nnz},) for {pattern}, got {data.shape}"
        )
    if x.ndim not in (1, 2) or x.shape[-1] != pattern.shape[0]:
        raise OpArgumentError(
            f"sparse_matmul: x must be (in,) or (batch, in) with in={pattern.shape[0]}, "
            f"got {x.shape}"
        )
    operands = [x, data]
    if bias is not None:
        bias = operand("sparse_matmul", "bias", bias)
        if bias.shape != (pattern.shape[1],):
            raise OpArgumentError(
                f"sparse_matmul: bias must be ({pattern.shape[1]},), got {bias.shape}"
            )
        operands.append(bias)
    return bind(
        sparse_matmul_p,
        *operands,
        pattern=pattern,
        has_bias=bias is not None,
        weight_fn=weight_fn,
        bias_fn=bias_fn,
    )
