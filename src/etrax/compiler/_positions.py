"""Position analysis: which values of a step depend on which *positions* of which
sources, and whether a computation keeps positions apart.

A *source* is a hidden state ``h^{t-1}`` (whose positions are its ``varshape``) or
the output ``y`` of an ETP op (whose positions are its shape). For every variable
derived from a source the analysis records an `Align`: for each non-trivial
position axis of the source (size > 1), the axis of the variable that carries
it, meaning ``v[..., p, ...]`` depends on the source only at position ``p``. When
that is not provable the entry is `Mixed`, with the reason.

This replaces an assumption with a check: a hidden-state transition or a
``y → h`` tail is position-diagonal exactly when every hidden output is aligned
with the identity. Unknown primitives are conservatively `Mixed`.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

from .._compat import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Var,
    call_body,
    inner_closed_jaxprs,
)
from .._typing import Shape

__all__ = ["Align", "AlignMap", "Mixed", "analyse", "identity_align", "positions_rule"]

Align: TypeAlias = tuple[int, ...]


class Mixed(NamedTuple):
    """A value that depends on several positions of a source."""

    reason: str


Alignment: TypeAlias = Align | Mixed
AlignMap: TypeAlias = dict[int, Alignment]


def identity_align(shape: Shape) -> Align:
    """The alignment of a source with itself: its axes of size > 1."""
    return tuple(i for i, s in enumerate(shape) if s > 1)


ELEMENTWISE = frozenset(
    [
        "abs",
        "acos",
        "acosh",
        "add",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "cbrt",
        "ceil",
        "clamp",
        "complex",
        "conj",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "digamma",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "igamma",
        "igammac",
        "imag",
        "integer_pow",
        "is_finite",
        "le",
        "lgamma",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "or",
        "polygamma",
        "population_count",
        "pow",
        "real",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "sub",
        "tan",
        "tanh",
        "xor",
        "zeta",
        "bessel_i0e",
        "bessel_i1e",
        "random_gamma_grad",
        "regularized_incomplete_beta",
    ]
)
_REDUCTIONS = frozenset(
    [
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
    ]
)
_CUMULATIVE = frozenset(["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"])


def _aval_shape(atom: Any) -> Shape:
    return tuple(atom.aval.shape)


def _merge(aligns: Sequence[Alignment], what: str) -> Alignment:
    first = aligns[0]
    for a in aligns[1:]:
        if isinstance(a, Mixed):
            return a
        if isinstance(first, Mixed):
            return first
        if a != first:
            return Mixed(f"{what} combines values whose positions lie on different axes")
    return first


def _elementwise(in_maps: Sequence[AlignMap], what: str) -> AlignMap:
    out: AlignMap = {}
    sources = {s for m in in_maps for s in m}
    for s in sorted(sources):
        out[s] = _merge([m[s] for m in in_maps if s in m], what)
    return out


def _remap(in_map: AlignMap, fn: Callable[[Align], Align | str]) -> AlignMap:
    out: AlignMap = {}
    for s, a in in_map.items():
        if isinstance(a, Mixed):
            out[s] = a
            continue
        res = fn(a)
        out[s] = Mixed(res) if isinstance(res, str) else res
    return out


def _reshape_map(src: Shape, dst: Shape) -> dict[int, int]:
    """Axes of `src` (size > 1) that survive a reshape to `dst` as a single axis."""
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            break
        if src[i] == dst[j]:
            mapping[i] = j
            i += 1
            j += 1
            continue
        # a block of several axes on one side: advance until the products agree
        pa, pb = src[i], dst[j]
        i += 1
        j += 1
        while pa != pb:
            if pa < pb and i < len(src):
                pa *= src[i]
                i += 1
            elif pb < pa and j < len(dst):
                pb *= dst[j]
                j += 1
            else:
                return mapping
    return mapping


def _dot_general(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> AlignMap:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    l_nd, r_nd = len(_aval_shape(lhs)), len(_aval_shape(rhs))
    l_free = [a for a in range(l_nd) if a not in lc and a not in lb]
    r_free = [a for a in range(r_nd) if a not in rc and a not in rb]

    def side(
        batch: Sequence[int], contract: Sequence[int], free: list[int], offset: int
    ) -> Callable[[Align], Align | str]:
        def fn(a: Align) -> Align | str:
            out = []
            for ax in a:
                if ax in contract:
                    return "dot_general contracts a position axis"
                if ax in batch:
                    out.append(list(batch).index(ax))
                else:
                    out.append(len(batch) + offset + free.index(ax))
            return tuple(out)

        return fn

    maps = [
        _remap(in_maps[0], side(lb, lc, l_free, 0)),
        _remap(in_maps[1], side(rb, rc, r_free, len(l_free))),
    ]
    return _elementwise(maps, "dot_general")


def _gather(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> AlignMap:
    dn = eqn.params["dimension_numbers"]
    slice_sizes = eqn.params["slice_sizes"]
    operand = eqn.invars[0]
    shape = _aval_shape(operand)
    offset_operand_axes = [
        a
        for a in range(len(shape))
        if a not in dn.collapsed_slice_dims and a not in dn.operand_batching_dims
    ]

    def fn(a: Align) -> Align | str:
        out = []
        for ax in a:
            if ax in dn.start_index_map or ax not in offset_operand_axes:
                return "gather indexes along a position axis"
            if slice_sizes[ax] != shape[ax]:
                return "gather takes part of a position axis"
            out.append(dn.offset_dims[offset_operand_axes.index(ax)])
        return tuple(out)

    out = _remap(in_maps[0], fn)
    for s, _ in in_maps[1].items():
        out[s] = Mixed("gather indices depend on a source")
    return out


def _scatter(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> AlignMap:
    dn = eqn.params["dimension_numbers"]
    operand, _, updates = eqn.invars[:3]
    shape = _aval_shape(operand)
    ushape = _aval_shape(updates)
    window_operand_axes = [
        a
        for a in range(len(shape))
        if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims
    ]

    def operand_fn(a: Align) -> Align | str:
        for ax in a:
            if ax in dn.scatter_dims_to_operand_dims or ax not in window_operand_axes:
                return "scatter writes along a position axis"
            uax = dn.update_window_dims[window_operand_axes.index(ax)]
            if ushape[uax] != shape[ax]:
                return "scatter writes part of a position axis"
        return a

    def update_fn(a: Align) -> Align | str:
        out = []
        for ax in a:
            if ax not in dn.update_window_dims:
                return "scatter scatters along a position axis"
            op_ax = window_operand_axes[list(dn.update_window_dims).index(ax)]
            if op_ax in dn.scatter_dims_to_operand_dims or ushape[ax] != shape[op_ax]:
                return "scatter writes part of a position axis"
            out.append(op_ax)
        return tuple(out)

    # The operand's own alignment must also be position-safe.
    op_checked = _remap(in_maps[0], operand_fn)
    maps = [op_checked, _remap(in_maps[2], update_fn)]
    out = _elementwise(maps, "scatter")
    for s in in_maps[1]:
        out[s] = Mixed("scatter indices depend on a source")
    return out


def _full_extent(
    eqn: JaxprEqn, axes_ok: Callable[[int], bool], what: str
) -> Callable[[Align], Align | str]:
    def fn(a: Align) -> Align | str:
        for ax in a:
            if not axes_ok(ax):
                return what
        return a

    return fn


Recurse: TypeAlias = Callable[[ClosedJaxpr, Sequence[AlignMap]], list[AlignMap]]


def _shape_rule(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> list[AlignMap] | None:
    """Element-wise, broadcasting, reshaping, transposing and reducing primitives."""
    name = str(eqn.primitive.name)
    n_out = len(eqn.outvars)
    params = eqn.params
    first: AlignMap = in_maps[0] if in_maps else {}

    if name in ELEMENTWISE:
        return [_elementwise(in_maps, name)] * n_out
    if name == "broadcast_in_dim":
        bd = params["broadcast_dimensions"]
        return [_remap(first, lambda a: tuple(bd[x] for x in a))]
    if name == "reshape":
        mapping = _reshape_map(_aval_shape(eqn.invars[0]), _aval_shape(eqn.outvars[0]))

        def reshape_fn(a: Align) -> Align | str:
            if all(x in mapping for x in a):
                return tuple(mapping[x] for x in a)
            return "reshape merges or splits a position axis"

        return [_remap(first, reshape_fn)]
    if name == "squeeze":
        dims = set(params["dimensions"])
        return [_remap(first, lambda a: tuple(x - sum(d < x for d in dims) for x in a))]
    if name == "expand_dims":
        new_axes = sorted(params["dimensions"])

        def expand_fn(a: Align) -> Align:
            out = []
            for x in a:
                y = x
                for d in new_axes:
                    if d <= y:
                        y += 1
                out.append(y)
            return tuple(out)

        return [_remap(first, expand_fn)]
    if name == "transpose":
        perm = list(params["permutation"])
        return [_remap(first, lambda a: tuple(perm.index(x) for x in a))]
    if name in _REDUCTIONS:
        axes = set(params["axes"])

        def reduce_fn(a: Align) -> Align | str:
            if any(x in axes for x in a):
                return f"{name} reduces over a position axis"
            return tuple(x - sum(d < x for d in axes) for x in a)

        return [_remap(first, reduce_fn)] * n_out
    return None


def _axis_rule(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> list[AlignMap] | None:
    """Primitives that run along one axis (scans, sorts, reversals)."""
    name = str(eqn.primitive.name)
    n_out = len(eqn.outvars)
    params = eqn.params
    first: AlignMap = in_maps[0] if in_maps else {}

    if name in _CUMULATIVE:
        axis = params["axis"]
        return [
            _remap(
                first, _full_extent(eqn, lambda x: x != axis, f"{name} runs along a position axis")
            )
        ]
    if name == "sort":
        dim = params["dimension"]
        merged = _elementwise(in_maps, name)
        return [
            _remap(merged, _full_extent(eqn, lambda x: x != dim, "sort runs along a position axis"))
        ] * n_out
    if name == "top_k":
        nd = len(_aval_shape(eqn.invars[0]))
        return [
            _remap(
                first, _full_extent(eqn, lambda x: x != nd - 1, "top_k runs along a position axis")
            )
        ] * n_out
    if name == "rev":
        dims = set(params["dimensions"])
        return [
            _remap(
                first, _full_extent(eqn, lambda x: x not in dims, "rev reverses a position axis")
            )
        ]
    return None


def _window_rule(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> list[AlignMap] | None:
    """Primitives that cut, pad, join or stack along axes."""
    name = str(eqn.primitive.name)
    n_out = len(eqn.outvars)
    params = eqn.params
    first: AlignMap = in_maps[0] if in_maps else {}

    if name == "slice":
        shape = _aval_shape(eqn.invars[0])
        starts, limits = params["start_indices"], params["limit_indices"]
        strides = params["strides"] or (1,) * len(shape)

        def slice_ok(x: int) -> bool:
            return starts[x] == 0 and limits[x] == shape[x] and strides[x] == 1

        return [_remap(first, _full_extent(eqn, slice_ok, "slice cuts a position axis"))]
    if name == "dynamic_slice":
        shape = _aval_shape(eqn.invars[0])
        sizes = params["slice_sizes"]
        out = _remap(
            first,
            _full_extent(eqn, lambda x: sizes[x] == shape[x], "dynamic_slice cuts a position axis"),
        )
        for m in in_maps[1:]:
            for s in m:
                out[s] = Mixed("dynamic_slice index depends on a source")
        return [out]
    if name == "dynamic_update_slice":
        shape = _aval_shape(eqn.invars[0])
        ushape = _aval_shape(eqn.invars[1])
        ok = _full_extent(
            eqn,
            lambda x: ushape[x] == shape[x],
            "dynamic_update_slice writes part of a position axis",
        )
        out = _elementwise([_remap(in_maps[0], ok), _remap(in_maps[1], ok)], name)
        for m in in_maps[2:]:
            for s in m:
                out[s] = Mixed("dynamic_update_slice index depends on a source")
        return [out]
    if name == "pad":
        cfg = params["padding_config"]
        ok = _full_extent(eqn, lambda x: tuple(cfg[x]) == (0, 0, 0), "pad pads a position axis")
        merged = _elementwise(in_maps, name)
        return [_remap(merged, ok)]
    if name == "concatenate":
        dim = params["dimension"]
        merged = _elementwise(in_maps, name)
        return [
            _remap(
                merged,
                _full_extent(eqn, lambda x: x != dim, "concatenate joins along a position axis"),
            )
        ]
    if name == "split":
        axis = params["axis"]
        return [
            _remap(first, _full_extent(eqn, lambda x: x != axis, "split cuts a position axis"))
        ] * n_out
    if name == "stack":
        axis = params["axis"]
        merged = _elementwise(in_maps, name)
        return [_remap(merged, lambda a: tuple(x + (x >= axis) for x in a))]
    if name == "iota":
        return [{}]
    return None


def _structured_rule(
    eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse
) -> list[AlignMap]:
    """Contractions, gathers, scatters, calls, ``cond`` and (conservatively) the rest."""
    name = str(eqn.primitive.name)
    n_out = len(eqn.outvars)
    params = eqn.params

    if name == "dot_general":
        return [_dot_general(eqn, in_maps)]
    if name == "gather":
        return [_gather(eqn, in_maps)]
    if name in (
        "scatter",
        "scatter-add",
        "scatter_add",
        "scatter-mul",
        "scatter_mul",
        "scatter-min",
        "scatter_min",
        "scatter-max",
        "scatter_max",
    ):
        return [_scatter(eqn, in_maps)]
    body_of_call = call_body(eqn)
    if body_of_call is not None and len(body_of_call.jaxpr.invars) == len(in_maps):
        return recurse(body_of_call, in_maps)
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        body = params.get("call_jaxpr") or params.get("fun_jaxpr")
        if isinstance(body, ClosedJaxpr) and len(body.jaxpr.invars) == len(in_maps):
            return recurse(body, in_maps)
    if name == "cond":
        branches = params["branches"]
        index_map = in_maps[0]
        results = [recurse(b, in_maps[1:]) for b in branches]
        outs: list[AlignMap] = []
        for k in range(n_out):
            merged = _elementwise([r[k] for r in results], "cond")
            for s in index_map:
                merged[s] = Mixed("cond predicate depends on a source")
            outs.append(merged)
        return outs
    # Unknown or opaque (scan, while, conv, reduce_window, ...): conservative.
    sources = {s for m in in_maps for s in m}
    reason = f"primitive '{name}' is not known to keep positions apart"
    return [{s: Mixed(reason) for s in sorted(sources)} for _ in range(n_out)]


def positions_rule(
    eqn: JaxprEqn,
    in_maps: Sequence[AlignMap],
    recurse: Recurse,
) -> list[AlignMap]:
    """Alignment of an equation's outputs given its inputs' alignments."""
    for rule in (_shape_rule, _axis_rule, _window_rule):
        out = rule(eqn, in_maps)
        if out is not None:
            return out
    return _structured_rule(eqn, in_maps, recurse)


def analyse(
    jaxpr: Jaxpr,
    seeds: Mapping[Var, AlignMap],
    is_boundary: Callable[[int, JaxprEqn, Sequence[AlignMap]], bool],
    cuts: frozenset[Var] = frozenset(),
) -> tuple[dict[Var, AlignMap], set[int]]:
    """Propagate source alignments forward through a jaxpr.

    **Arguments:**

    - `jaxpr`: the step's flat jaxpr.
    - `seeds`: the alignment map of each source variable (a hidden invar, or an
      ETP op's ``y``). A seed overrides what the equation producing it would give.
    - `is_boundary`: ``(index, eqn, input maps) -> bool``; a boundary equation's
      outputs are treated as constants (not derived from any source).
    - `cuts`: variables whose values count as constants where they are read (their
      own alignment is still recorded).

    **Returns:** the alignment map of every derived variable, and the indices of the
    boundary equations that had derived inputs.
    """
    maps: dict[Var, AlignMap] = {v: dict(m) for v, m in seeds.items()}
    boundaries: set[int] = set()

    def recurse(body: ClosedJaxpr, inner_maps: Sequence[AlignMap]) -> list[AlignMap]:
        inner_seeds = {v: m for v, m in zip(body.jaxpr.invars, inner_maps, strict=True) if m}
        inner, _ = analyse(body.jaxpr, inner_seeds, lambda i, e, m: False)
        return [inner.get(v, {}) if isinstance(v, Var) else {} for v in body.jaxpr.outvars]

    for i, eqn in enumerate(jaxpr.eqns):
        in_maps = [
            maps.get(v, {}) if isinstance(v, Var) and v not in cuts else {} for v in eqn.invars
        ]
        if not any(in_maps):
            continue
        if is_boundary(i, eqn, in_maps):
            boundaries.add(i)
            continue
        outs = positions_rule(eqn, in_maps, recurse)
        for v, m in zip(eqn.outvars, outs, strict=True):
            if isinstance(v, DropVar) or not m:
                continue
            if v in seeds:
                merged = dict(m)
                merged.update(seeds[v])
                maps[v] = merged
            else:
                maps[v] = dict(m)
    return maps, boundaries


def contains_primitive(closed: ClosedJaxpr | Jaxpr, pred: Callable[[Any], bool]) -> bool:
    """Whether any equation, at any nesting depth, has a primitive accepted by `pred`."""
    jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
    for eqn in jaxpr.eqns:
        if pred(eqn.primitive):
            return True
        for sub in inner_closed_jaxprs(eqn):
            if contains_primitive(sub, pred):
                return True
    return False
