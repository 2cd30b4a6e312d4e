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

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

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

__all__ = [
    "Align",
    "AlignMap",
    "Mixed",
    "PositionRule",
    "analyse",
    "elementwise_rule",
    "identity_align",
    "mixing_rule",
    "positions_rule",
    "register_position_rule",
]

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
        "add_any",  # the sum of cotangents (a model's own `jax.grad` / `vector_grad`)
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
        "exprel",  # brainunit's (exp(x) - 1) / x (brainstate's `exp_euler_step`)
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
        "stop_gradient",
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


def _axes_all_ok(axes_ok: Callable[[int], bool], what: str, a: Align) -> Align | str:
    return a if all(axes_ok(ax) for ax in a) else what


def _full_extent(
    eqn: JaxprEqn, axes_ok: Callable[[int], bool], what: str
) -> Callable[[Align], Align | str]:
    return functools.partial(_axes_all_ok, axes_ok, what)


Recurse: TypeAlias = Callable[[ClosedJaxpr, Sequence[AlignMap]], list[AlignMap]]
PositionRule: TypeAlias = Callable[[JaxprEqn, Sequence[AlignMap], Recurse], list[AlignMap]]
"""``(equation, input alignment maps, recurse) -> one alignment map per output``.

An alignment map sends each source (an index) to the output axes that carry the
source's position axes (an `Align` tuple), or to `Mixed` when an output value
depends on several positions of it. `recurse(closed_jaxpr, maps)` analyses a
sub-jaxpr (a loop or branch body)."""

_RULES: dict[Any, PositionRule] = {}


def _register(*names: str) -> Callable[[PositionRule], PositionRule]:
    def deco(rule: PositionRule) -> PositionRule:
        for n in names:
            _RULES[n] = rule
        return rule

    return deco


def _first(in_maps: Sequence[AlignMap]) -> AlignMap:
    return in_maps[0] if in_maps else {}


def _n_out(eqn: JaxprEqn) -> int:
    return len(eqn.outvars)


def elementwise_rule(
    eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse
) -> list[AlignMap]:
    """Every output position reads the same position of every operand."""
    return [_elementwise(in_maps, str(eqn.primitive.name))] * _n_out(eqn)


def mixing_rule(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    """Every output may read every position of every operand (the safe default)."""
    sources = {s for m in in_maps for s in m}
    reason = f"primitive '{eqn.primitive.name}' is declared to mix positions"
    return [{s: Mixed(reason) for s in sorted(sources)} for _ in range(_n_out(eqn))]


for _name in ELEMENTWISE:
    _RULES[_name] = elementwise_rule


@_register("broadcast_in_dim")
def _broadcast_in_dim(
    eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse
) -> list[AlignMap]:
    bd = eqn.params["broadcast_dimensions"]
    return [_remap(_first(in_maps), lambda a: tuple(bd[x] for x in a))]


@_register("reshape")
def _reshape(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    mapping = _reshape_map(_aval_shape(eqn.invars[0]), _aval_shape(eqn.outvars[0]))

    def fn(a: Align) -> Align | str:
        if all(x in mapping for x in a):
            return tuple(mapping[x] for x in a)
        return "reshape merges or splits a position axis"

    return [_remap(_first(in_maps), fn)]


@_register("squeeze")
def _squeeze(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    dims = set(eqn.params["dimensions"])
    return [_remap(_first(in_maps), lambda a: tuple(x - sum(d < x for d in dims) for x in a))]


@_register("expand_dims")
def _expand_dims(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    new_axes = sorted(eqn.params["dimensions"])

    def fn(a: Align) -> Align:
        out = []
        for x in a:
            y = x
            for d in new_axes:
                if d <= y:
                    y += 1
            out.append(y)
        return tuple(out)

    return [_remap(_first(in_maps), fn)]


@_register("transpose")
def _transpose(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    perm = list(eqn.params["permutation"])
    return [_remap(_first(in_maps), lambda a: tuple(perm.index(x) for x in a))]


def _reduced_align(name: str, axes: frozenset[int], a: Align) -> Align | str:
    if any(x in axes for x in a):
        return f"{name} reduces over a position axis"
    return tuple(x - sum(d < x for d in axes) for x in a)


@_register(*_REDUCTIONS)
def _reduce(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    fn = functools.partial(_reduced_align, eqn.primitive.name, frozenset(eqn.params["axes"]))
    return [_remap(_first(in_maps), fn)] * _n_out(eqn)


def _along(axis_of: Callable[[JaxprEqn], set[int]], verb: str, merge: bool = False) -> PositionRule:
    """A primitive that runs along some axes: positions on other axes stay apart."""

    def rule(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
        axes = axis_of(eqn)
        src = _elementwise(in_maps, str(eqn.primitive.name)) if merge else _first(in_maps)
        what = f"{eqn.primitive.name} {verb} a position axis"
        return [_remap(src, _full_extent(eqn, lambda x: x not in axes, what))] * _n_out(eqn)

    return rule


for _name in _CUMULATIVE:
    _RULES[_name] = _along(lambda e: {e.params["axis"]}, "runs along")
_RULES["sort"] = _along(lambda e: {e.params["dimension"]}, "runs along", merge=True)
_RULES["top_k"] = _along(lambda e: {len(_aval_shape(e.invars[0])) - 1}, "runs along")
_RULES["rev"] = _along(lambda e: set(e.params["dimensions"]), "reverses")
_RULES["concatenate"] = _along(lambda e: {e.params["dimension"]}, "joins along", merge=True)
_RULES["split"] = _along(lambda e: {e.params["axis"]}, "cuts")


@_register("slice")
def _slice(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    shape = _aval_shape(eqn.invars[0])
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)

    def ok(x: int) -> bool:
        return starts[x] == 0 and limits[x] == shape[x] and strides[x] == 1

    return [_remap(_first(in_maps), _full_extent(eqn, ok, "slice cuts a position axis"))]


def _mixed_by_index(out: AlignMap, in_maps: Sequence[AlignMap], what: str) -> AlignMap:
    for m in in_maps:
        for s in m:
            out[s] = Mixed(what)
    return out


@_register("dynamic_slice")
def _dynamic_slice(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    shape, sizes = _aval_shape(eqn.invars[0]), eqn.params["slice_sizes"]
    ok = _full_extent(eqn, lambda x: sizes[x] == shape[x], "dynamic_slice cuts a position axis")
    out = _remap(_first(in_maps), ok)
    return [_mixed_by_index(out, in_maps[1:], "dynamic_slice index depends on a source")]


@_register("dynamic_update_slice")
def _dynamic_update_slice(
    eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse
) -> list[AlignMap]:
    shape, ushape = _aval_shape(eqn.invars[0]), _aval_shape(eqn.invars[1])
    what = "dynamic_update_slice writes part of a position axis"
    ok = _full_extent(eqn, lambda x: ushape[x] == shape[x], what)
    out = _elementwise([_remap(in_maps[0], ok), _remap(in_maps[1], ok)], "dynamic_update_slice")
    return [_mixed_by_index(out, in_maps[2:], "dynamic_update_slice index depends on a source")]


@_register("pad")
def _pad(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    cfg = eqn.params["padding_config"]
    ok = _full_extent(eqn, lambda x: tuple(cfg[x]) == (0, 0, 0), "pad pads a position axis")
    return [_remap(_elementwise(in_maps, "pad"), ok)]


@_register("stack")
def _stack(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    axis = eqn.params["axis"]
    return [_remap(_elementwise(in_maps, "stack"), lambda a: tuple(x + (x >= axis) for x in a))]


@_register("iota")
def _iota(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    return [{}]


@_register("dot_general")
def _dot_general_rule(
    eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse
) -> list[AlignMap]:
    return [_dot_general(eqn, in_maps)]


@_register("gather")
def _gather_rule(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    return [_gather(eqn, in_maps)]


_SCATTERS: tuple[str, ...] = ("scatter", "scatter-add", "scatter_add", "scatter-mul")
_SCATTERS += ("scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max")


@_register(*_SCATTERS)
def _scatter_rule(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    return [_scatter(eqn, in_maps)]


@_register("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
def _custom_call(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    body = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    if isinstance(body, ClosedJaxpr) and len(body.jaxpr.invars) == len(in_maps):
        return recurse(body, in_maps)
    return _unknown(eqn, in_maps)


@_register("cond")
def _cond(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    results = [recurse(b, in_maps[1:]) for b in eqn.params["branches"]]
    outs: list[AlignMap] = []
    for k in range(_n_out(eqn)):
        merged = _elementwise([r[k] for r in results], "cond")
        outs.append(_mixed_by_index(merged, in_maps[:1], "cond predicate depends on a source"))
    return outs


def _shift(m: AlignMap, by: int, what: str) -> AlignMap:
    """Alignments moved by `by` axes (a loop's stacked axis added or removed)."""

    def fn(a: Align) -> Align | str:
        if by < 0 and 0 in a:
            return what
        return tuple(x + by for x in a)

    return _remap(m, fn)


@_register("scan")
def _scan(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    """A loop: its body is analysed with each carry's alignment widened to a fixed point
    (the carry's alignment at entry merged with what the body makes of it)."""
    p = eqn.params
    n_c, n_carry = int(p["num_consts"]), int(p["num_carry"])
    consts, carry = list(in_maps[:n_c]), list(in_maps[n_c : n_c + n_carry])
    xs = [_shift(m, -1, "scan runs along a position axis") for m in in_maps[n_c + n_carry :]]
    fixed = _widen_carry(p["jaxpr"], consts, carry, xs, recurse)
    if fixed is None:
        return _unknown(eqn, in_maps)
    carry, outs = fixed
    ys = [_shift(m, 1, "") for m in outs[n_carry:]]
    return [*carry, *ys]


def _widen_carry(
    body: ClosedJaxpr,
    consts: list[AlignMap],
    carry: list[AlignMap],
    rest: list[AlignMap],
    recurse: Recurse,
) -> tuple[list[AlignMap], list[AlignMap]] | None:
    """A loop body analysed with its carry alignments widened to a fixed point (the
    carry at entry merged with what the body makes of it): ``(carry, body outputs)``,
    or `None` when no fixed point is reached."""
    n = len(carry)
    for _ in range(n + 2):
        outs = recurse(body, [*consts, *carry, *rest])
        widened = [_elementwise([c, o], "loop") for c, o in zip(carry, outs[:n], strict=True)]
        if widened == carry:
            return carry, outs
        carry = widened
    return None


@_register("while")
def _while(eqn: JaxprEqn, in_maps: Sequence[AlignMap], recurse: Recurse) -> list[AlignMap]:
    """A loop of run-time length: the body's carry widened to a fixed point; when the
    predicate reads a source, the trip count depends on every position of it."""
    p = eqn.params
    n_cc, n_bc = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cond_consts, body_consts = list(in_maps[:n_cc]), list(in_maps[n_cc : n_cc + n_bc])
    fixed = _widen_carry(p["body_jaxpr"], body_consts, list(in_maps[n_cc + n_bc :]), [], recurse)
    if fixed is None:
        return _unknown(eqn, in_maps)
    carry, _ = fixed
    (pred,) = recurse(p["cond_jaxpr"], [*cond_consts, *carry])
    return [
        _mixed_by_index(dict(c), [pred], "while_loop's trip count depends on a source")
        for c in carry
    ]


def _unknown(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> list[AlignMap]:
    sources = {s for m in in_maps for s in m}
    reason = (
        f"primitive '{eqn.primitive.name}' is not known to keep positions apart (declare how "
        "it moves positions with etrax.register_position_rule)"
    )
    return [{s: Mixed(reason) for s in sorted(sources)} for _ in range(_n_out(eqn))]


def register_position_rule(
    primitive: Any, rule: PositionRule | Literal["elementwise", "mixing"]
) -> None:
    """Declare how a primitive moves positions, for the compiler's position analysis.

    The analysis decides whether a hidden state's transition and each weight op's
    path to a hidden state keep positions apart (diagonal: exact, cheap traces) or
    mix them. Primitives it does not know are treated as mixing, with a diagnostic
    naming them; register a rule to change that.

    **Arguments:**

    - `primitive`: a JAX `Primitive` (matched by identity) or a primitive name
      (matched by ``eqn.primitive.name``).
    - `rule`: ``"elementwise"`` (every output position reads only the same position
      of every operand, all of the output's shape), ``"mixing"``, or a
      `PositionRule` function ``(eqn, in_maps, recurse) -> list of maps``.

    A rule registered for a name etrax already knows replaces etrax's rule.
    """
    if rule == "elementwise":
        _RULES[primitive] = elementwise_rule
    elif rule == "mixing":
        _RULES[primitive] = mixing_rule
    elif callable(rule):
        _RULES[primitive] = rule
    else:
        raise ValueError(
            f"register_position_rule: rule must be 'elementwise', 'mixing' or a function, "
            f"got {rule!r}"
        )


def positions_rule(
    eqn: JaxprEqn,
    in_maps: Sequence[AlignMap],
    recurse: Recurse,
) -> list[AlignMap]:
    """Alignment of an equation's outputs given its inputs' alignments: the rule
    registered for its primitive (by identity, then by name), or a call body's own
    analysis, or the conservative default."""
    rule = _RULES.get(eqn.primitive) or _RULES.get(str(eqn.primitive.name))
    if rule is not None:
        return rule(eqn, in_maps, recurse)
    body = call_body(eqn)
    if body is not None and len(body.jaxpr.invars) == len(in_maps):
        return recurse(body, in_maps)
    return _unknown(eqn, in_maps)


def _analyse_body(body: ClosedJaxpr, inner_maps: Sequence[AlignMap]) -> list[AlignMap]:
    """The alignment maps of a sub-jaxpr's (loop or branch body's) outputs."""
    inner_seeds = {v: m for v, m in zip(body.jaxpr.invars, inner_maps, strict=True) if m}
    inner, _ = analyse(body.jaxpr, inner_seeds, lambda i, e, m: False)
    return [inner.get(v, {}) if isinstance(v, Var) else {} for v in body.jaxpr.outvars]


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

    for i, eqn in enumerate(jaxpr.eqns):
        in_maps = [
            maps.get(v, {}) if isinstance(v, Var) and v not in cuts else {} for v in eqn.invars
        ]
        if not any(in_maps):
            continue
        if is_boundary(i, eqn, in_maps):
            boundaries.add(i)
            continue
        outs = positions_rule(eqn, in_maps, _analyse_body)
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
