"""Jaxpr plumbing for the compiler: stable variable ids, call inlining, program
slicing and a hashable program wrapper.

Artifacts never hold `Var` objects as keys: a variable is named by its `VarId`, its
position in the order constvars, invars, equation outputs of the step's jaxpr.
"""

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, final

import jax
import jax.numpy as jnp
import numpy as np

from .._compat import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    array_key,
    aval_of,
    bind_equation,
    call_body,
    derivative_rules_key,
    differentiable_positions,
    equation_context,
    equation_vjp,
    eval_jaxpr,
    has_user_frame,
    inner_closed_jaxprs,
    replace_jaxpr,
    shape_struct,
    struct_of,
    with_traceback_of,
)
from .._errors import OpArgumentError
from .._typing import VarId
from ..ops import SparsePattern, sparse_matmul

__all__ = [
    "Program",
    "VarTable",
    "custom_vjp_as_jvp",
    "drop_dead_equations",
    "eval_equations",
    "event_products_as_ops",
    "fold_cuts_of_joins",
    "inline_calls",
    "library_product",
    "merge_heads_first",
    "retraced",
    "slice_program",
    "split_products_read_head_by_head",
]


@final
class Program:
    """An immutable, hashable wrapper of a closed jaxpr used as a static sub-program.

    `input_ids` / `output_ids` name, in the step's `VarId` numbering, the values the
    program reads and produces (an output that is a literal has id `None`).
    Equality is structural (the printed jaxpr and its constants), so two compiles of
    the same model give equal programs. A whole step's program (``rules=True``: the
    one `extract` traces) also compares its custom derivative rules
    (`derivative_rules_key`), which its printed jaxpr names but does not show, so a
    model whose surrogate changed gives another program and so another graph; the
    programs sliced out of that step are only ever compared inside the graph that
    holds it, and skip that key (it traces each rule). `rules` may also carry a key
    already computed, for a program extended from another (`rules_key`).
    """

    __slots__ = ("_key", "_rules", "closed", "input_ids", "output_ids")

    _key: tuple[Any, ...] | None
    _rules: bool | tuple[Any, ...]

    closed: Final[ClosedJaxpr]  # type: ignore[misc]
    input_ids: Final[tuple[VarId, ...]]  # type: ignore[misc]
    output_ids: Final[tuple[VarId | None, ...]]  # type: ignore[misc]

    def __init__(
        self,
        closed: ClosedJaxpr,
        input_ids: Sequence[VarId],
        output_ids: Sequence[VarId | None],
        *,
        rules: bool | tuple[Any, ...] = False,
    ) -> None:
        object.__setattr__(self, "closed", closed)
        object.__setattr__(self, "input_ids", tuple(input_ids))
        object.__setattr__(self, "output_ids", tuple(output_ids))
        object.__setattr__(self, "_key", None)
        object.__setattr__(self, "_rules", rules)

    def rules_key(self) -> tuple[Any, ...]:
        """The key of the program's custom derivative rules (empty unless the program
        was built with ``rules``), computed once."""
        rules = self._rules
        if rules is True:
            rules = derivative_rules_key(self.closed.jaxpr)
            object.__setattr__(self, "_rules", rules)
        return () if rules is False else rules

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Program is immutable")

    @property
    def jaxpr(self) -> Jaxpr:
        """The open jaxpr (its constants are in `closed.consts`)."""
        jaxpr: Jaxpr = self.closed.jaxpr
        return jaxpr

    @property
    def primitives(self) -> tuple[str, ...]:
        """Names of the primitives of the program's equations, in order."""
        return tuple(str(e.primitive.name) for e in self.closed.jaxpr.eqns)

    @property
    def num_equations(self) -> int:
        return len(self.closed.jaxpr.eqns)

    def key(self) -> tuple[Any, ...]:
        """The structural identity used for equality and hashing."""
        key = self._key
        if key is None:
            key = (
                str(self.closed.jaxpr),
                tuple(array_key(c) for c in self.closed.consts),
                self.input_ids,
                self.output_ids,
                self.rules_key(),
            )
            object.__setattr__(self, "_key", key)
        return key

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Program):
            return NotImplemented
        return self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key()[0])

    def __call__(self, *args: Any) -> list[Any]:
        """Evaluate the program on its inputs (in `input_ids` order)."""
        return eval_equations(self.closed.jaxpr, self.closed.consts, args)

    def __repr__(self) -> str:
        n_in = len(self.closed.jaxpr.invars)
        n_out = len(self.closed.jaxpr.outvars)
        return f"Program(inputs={n_in}, outputs={n_out}, equations={self.num_equations})"


class VarTable:
    """`VarId` numbering, producers and consumers of one jaxpr (a local helper)."""

    def __init__(self, jaxpr: Jaxpr) -> None:
        self.jaxpr = jaxpr
        self.vars: list[Var] = []
        self.ids: dict[Var, VarId] = {}
        self.producer: dict[Var, int] = {}
        self.consumers: dict[Var, list[int]] = {}
        for v in (*jaxpr.constvars, *jaxpr.invars):
            self._add(v)
        for i, eqn in enumerate(jaxpr.eqns):
            for a in eqn.invars:
                if isinstance(a, Var):
                    self.consumers.setdefault(a, []).append(i)
            for v in eqn.outvars:
                if not isinstance(v, DropVar):
                    self._add(v)
                    self.producer[v] = i

    def _add(self, v: Var) -> None:
        if v not in self.ids:
            self.ids[v] = len(self.vars)
            self.vars.append(v)

    def id_of(self, atom: Any) -> VarId | None:
        """The id of a Var, or `None` for a literal."""
        if isinstance(atom, Literal):
            return None
        return self.ids[atom]

    def var(self, vid: VarId) -> Var:
        return self.vars[vid]


def eval_equations(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate a jaxpr (a thin, explicit version of `jax.core.eval_jaxpr`)."""
    return eval_jaxpr(jaxpr, consts, *args)


def _read(env: dict[Var, Any], atom: Any) -> Any:
    """The value of a Var in `env`, or a Literal's own value."""
    return atom.val if isinstance(atom, Literal) else env[atom]


def _eval_inlining(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    site: Any = None,
    products: bool = False,
) -> list[Any]:
    """`jaxpr` evaluated with the bodies of its calls spliced in. An equation of a
    body whose traceback has no user frame (a library traced it inside its own `jit`)
    is located at `site`, the source info of the outermost call that has one, so that
    diagnostics name the user's line. With `products`, a library's product call that
    `library_product` knows is written as the product it stands for instead."""
    env: dict[Var, Any] = {}
    for v, val in zip(jaxpr.constvars, consts, strict=True):
        env[v] = val
    for v, val in zip(jaxpr.invars, args, strict=True):
        env[v] = val
    for eqn in jaxpr.eqns:
        invals = [_read(env, a) for a in eqn.invars]
        if site is not None and not has_user_frame(eqn):
            eqn = with_traceback_of(eqn, site)
        body = call_body(eqn)
        known = library_product(eqn, body, invals) if products and body is not None else None
        if known is not None:
            with equation_context(eqn):
                outs = [known()]
        elif body is not None:
            inner = eqn.source_info if site is None and has_user_frame(eqn) else site
            outs = _eval_inlining(body.jaxpr, body.consts, invals, inner, products)
        else:
            outs = bind_equation(eqn, invals)
        for v, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, DropVar):
                env[v] = val
    return [_read(env, a) for a in jaxpr.outvars]


def _has_calls(jaxpr: Jaxpr) -> bool:
    return any(call_body(e) is not None for e in jaxpr.eqns)


def drop_dead_equations(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` without the top-level equations whose outputs nothing reads (the
    step's outputs, hidden and other states included, count as read) and that have
    no effects: a value computed and left unused (``_ = jnp.split(x @ W, 3)``) is no
    use of its weights, and does not stop the compiler from cutting the ops it reads.
    Invariant: invars and outvars are kept, with their order."""
    jaxpr = closed.jaxpr
    live = {v for v in jaxpr.outvars if isinstance(v, Var)}
    kept: list[JaxprEqn] = []
    for eqn in reversed(jaxpr.eqns):
        used = any(isinstance(o, Var) and not isinstance(o, DropVar) and o in live
                   for o in eqn.outvars)  # fmt: skip
        if used or eqn.effects:
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, Var))
    if len(kept) == len(jaxpr.eqns):
        return closed
    return ClosedJaxpr(replace_jaxpr(jaxpr, eqns=kept[::-1]), closed.consts)


def inline_calls(closed: ClosedJaxpr, products: bool = False) -> ClosedJaxpr:
    """Splice every nested `jit` / `closed_call` / `remat` body into one flat jaxpr.

    Done by re-tracing the jaxpr through an evaluator that descends into call
    bodies, so every call site gets fresh variables. Invariant: invars and outvars
    keep their order, avals and meaning. Custom-derivative calls are kept whole.
    With `products`, a library's jitted product that `library_product` knows (the
    fixed connections of ``brainstate.nn.FixedNumConn``) is written as the product it
    stands for instead of its body.
    """
    if not _has_calls(closed.jaxpr):
        return closed
    avals = [struct_of(v) for v in closed.jaxpr.invars]
    jaxpr, consts = closed.jaxpr, closed.consts

    def flat(*args: Any) -> list[Any]:
        return _eval_inlining(jaxpr, consts, args, products=products)

    return jax.make_jaxpr(flat)(*avals)


_Outputs = Callable[[int, JaxprEqn, dict[Var, Any]], list[Any] | None]


def retraced(closed: ClosedJaxpr, outputs: _Outputs) -> ClosedJaxpr:
    """`closed` traced again equation by equation: each equation's outputs are
    ``outputs(index, eqn, env)`` (`env` holding every value so far), or the equation
    re-bound where that is `None`. An equation whose outputs nothing reads any more
    may give placeholders. Invariant: invars and outvars keep their order and avals."""
    jaxpr, consts = closed.jaxpr, closed.consts

    def run(*args: Any) -> list[Any]:
        env: dict[Var, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for i, eqn in enumerate(jaxpr.eqns):
            outs = outputs(i, eqn, env)
            if outs is None:
                outs = bind_equation(eqn, [_read(env, a) for a in eqn.invars])
            for v, val in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, DropVar):
                    env[v] = val
        return [_read(env, a) for a in jaxpr.outvars]

    return jax.make_jaxpr(run)(*(struct_of(v) for v in jaxpr.invars))


_Range = tuple[int, int]
_Piece = tuple[Any, int, int]
"""An atom and the range ``[lo, hi)`` of it along the cut axis."""


def _cut_ranges(eqn: JaxprEqn) -> tuple[int, list[_Range]] | None:
    """The axis a ``split``, or a ``slice`` that cuts one axis with stride 1, cuts
    along, and the range each of its outputs takes; `None` for any other equation."""
    name = eqn.primitive.name
    if name == "split":
        bounds = list(itertools.accumulate((int(n) for n in eqn.params["sizes"]), initial=0))
        return int(eqn.params["axis"]), list(itertools.pairwise(bounds))
    if name != "slice":
        return None
    shape = tuple(aval_of(eqn.invars[0]).shape)
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    if any(s != 1 for s in eqn.params["strides"] or ()):
        return None
    cut = [d for d, n in enumerate(shape) if (starts[d], limits[d]) != (0, n)]
    if len(cut) != 1:
        return None
    (axis,) = cut
    return axis, [(int(starts[axis]), int(limits[axis]))]


def _joined_from(eqn: JaxprEqn, axis: int, lo: int, hi: int) -> _Piece | None:
    """The operand of a ``concatenate`` or ``tile`` along `axis` that ``[lo, hi)`` of its
    output lies in, with the range in that operand; `None` when the range spans two."""
    name = eqn.primitive.name
    if name == "concatenate" and eqn.params["dimension"] == axis:
        start = 0
        for atom in eqn.invars:
            width = int(aval_of(atom).shape[axis])
            if start <= lo and hi <= start + width:
                return atom, lo - start, hi - start
            start += width
        return None
    if name == "tile":
        (atom,) = eqn.invars
        reps = tuple(eqn.params["reps"])
        shape = tuple(aval_of(atom).shape)
        if len(reps) != len(shape) or any(r != 1 for d, r in enumerate(reps) if d != axis):
            return None
        width = int(shape[axis])
        first = width * (lo // width) if width else 0
        if width and hi - first <= width:
            return atom, lo - first, hi - first
    return None


def _innermost_piece(
    producers: Mapping[Var, JaxprEqn], atom: Any, axis: int, lo: int, hi: int
) -> _Piece | None:
    """Where ``[lo, hi)`` of `atom` along `axis` comes from, following joins (a
    ``concatenate`` of a ``concatenate``) as deep as the range stays in one operand;
    `None` when `atom` is not such a join."""
    found: _Piece | None = None
    while lo < hi and isinstance(atom, Var) and atom in producers:
        piece = _joined_from(producers[atom], axis, lo, hi)
        if piece is None:
            break
        found = piece
        atom, lo, hi = piece
    return found


def fold_cuts_of_joins(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with every part that a ``slice`` or ``split`` cuts out of a joined
    value read from the operand it lies in: ``concatenate([h, h])[..., n:]`` and
    ``tile(h, 2)[..., n:]`` are ``h``, and ``concatenate([a, b])[..., :k]`` is
    ``a[..., :k]``. Fused gates on a tiled state (``split(concatenate([h] * 3) * u,
    3)``, cut part by part by `normalise`) then read `h` element-wise, and the
    position analysis sees a diagonal transition instead of a join of positions.
    The joins left unread are for `drop_dead_equations`. Invariant: invars,
    outvars and values are kept; `closed` itself when nothing folds."""
    jaxpr = closed.jaxpr
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars if not isinstance(v, DropVar)}
    folds: dict[int, tuple[int, list[_Piece | None]]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        cut = _cut_ranges(eqn)
        if cut is None:
            continue
        axis, ranges = cut
        pieces = [_innermost_piece(producers, eqn.invars[0], axis, lo, hi) for lo, hi in ranges]
        if any(p is not None for p in pieces):
            folds[i] = axis, pieces
    if not folds:
        return closed

    def folded(i: int, eqn: JaxprEqn, env: dict[Var, Any]) -> list[Any] | None:
        if i not in folds:
            return None
        axis, pieces = folds[i]
        if all(p is not None for p in pieces):
            outs: list[Any] = [None] * len(pieces)  # the cut itself is not needed
        else:
            outs = bind_equation(eqn, [_read(env, a) for a in eqn.invars])
        for k, piece in enumerate(pieces):
            if piece is not None:
                atom, lo, hi = piece
                value = _read(env, atom)
                if (lo, hi) != (0, jnp.shape(value)[axis]):
                    with equation_context(eqn):
                        value = jax.lax.slice_in_dim(value, lo, hi, axis=axis)
                outs[k] = value
        return outs

    return retraced(closed, folded)


def _merges_last_two(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a ``reshape`` that merges its operand's last two axes,
    ``(..., G, O) → (..., G·O)``."""
    if eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
        return False
    if len(eqn.invars) != 1 or not isinstance(eqn.invars[0], Var):
        return False
    shape = tuple(aval_of(eqn.invars[0]).shape)
    merged = (*shape[:-2], shape[-2] * shape[-1]) if len(shape) >= 2 else None
    return tuple(aval_of(eqn.outvars[0]).shape) == merged


def merge_heads_first(
    closed: ClosedJaxpr, element_wise: frozenset[str], is_product: Callable[[JaxprEqn], bool]
) -> ClosedJaxpr:
    """`closed` with each reshape that merges the last two axes of an element-wise
    combination of products applied to the combination's values first:
    ``(a + b).reshape(..., G * O)`` is computed as ``a.reshape(..., G * O) +
    b.reshape(..., G * O)``, so that each per-head product ``a`` (an equation
    `is_product` accepts, or a transpose of one) has its heads merged right after it,
    and the compiler reads it as one product onto the flat state. The combination
    (equations whose primitive is in `element_wise`, each read only by the next) is
    moved only when one of its values is such a product. Invariant: invars, outvars
    and values are kept; `closed` itself when nothing moves."""
    jaxpr = closed.jaxpr
    producers = {
        v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars if not isinstance(v, DropVar)
    }
    reads: dict[Var, int] = {}
    for eqn in jaxpr.eqns:
        for a in eqn.invars:
            if isinstance(a, Var):
                reads[a] = reads.get(a, 0) + 1
    outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}

    def producer(atom: Any) -> int | None:
        return producers.get(atom) if isinstance(atom, Var) else None

    def product(v: Var) -> bool:
        i = producer(v)
        if i is not None and jaxpr.eqns[i].primitive.name == "transpose":
            i = producer(jaxpr.eqns[i].invars[0])
        return i is not None and is_product(jaxpr.eqns[i])

    def combination(v: Var, shape: tuple[int, ...], inner: set[int]) -> bool:
        """Whether `v` reaches a product through element-wise equations read only here
        (their indices collected in `inner`)."""
        i = producer(v)
        if i is None or jaxpr.eqns[i].primitive.name not in element_wise:
            return product(v)
        eqn = jaxpr.eqns[i]
        if len(eqn.outvars) != 1 or reads.get(v, 0) != 1 or v in outputs:
            return product(v)
        if any(
            isinstance(a, Var) and tuple(aval_of(a).shape) not in (shape, ()) for a in eqn.invars
        ):
            return product(v)
        inner.add(i)
        found = False
        for a in eqn.invars:
            if isinstance(a, Var) and tuple(aval_of(a).shape) == shape:
                found = combination(a, shape, inner) or found
        return found

    moved: dict[int, set[int]] = {}  # reshape index → the combination it merges
    for i, eqn in enumerate(jaxpr.eqns):
        if not _merges_last_two(eqn):
            continue
        v = eqn.invars[0]
        inner: set[int] = set()
        if combination(v, tuple(aval_of(v).shape), inner) and inner:
            moved[i] = inner
    if not moved:
        return closed
    skipped = set().union(*moved.values())

    def merged(atom: Any, reshape: JaxprEqn, inner: set[int], env: dict[Var, Any]) -> Any:
        i = producer(atom)
        if i is not None and i in inner:
            eqn = jaxpr.eqns[i]
            (out,) = bind_equation(eqn, [merged(a, reshape, inner, env) for a in eqn.invars])
            return out
        value = _read(env, atom)
        if jnp.ndim(value) == 0:
            return value
        (out,) = bind_equation(reshape, [value])
        return out

    def merged_first(i: int, eqn: JaxprEqn, env: dict[Var, Any]) -> list[Any] | None:
        if i in skipped:
            return [None] * len(eqn.outvars)  # read only by the combination, now merged
        if i in moved:
            return [merged(eqn.invars[0], eqn, moved[i], env)]
        return None

    return retraced(closed, merged_first)


def _heads_product(eqn: JaxprEqn) -> tuple[int, list[str]] | None:
    """A dot_general of data ``(in,)`` or ``(batch, in)`` (contracted on its last axis)
    with a 3-D weight of one contracted and two free axes (heads, features): the
    weight's operand index and the output's axes named ``"g"`` (heads), ``"o"``
    (features) and ``"b"`` (the data's batch); `None` for any other equation."""
    if eqn.primitive.name != "dot_general":
        return None
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    if lb or len(lc) != 1:
        return None
    ndim = [len(aval_of(a).shape) for a in eqn.invars]
    for slot in (0, 1):
        x_contract = (rc if slot == 0 else lc)[0]
        x_ndim = ndim[1 - slot]
        if ndim[slot] == 3 and x_ndim in (1, 2) and x_contract == x_ndim - 1:
            batch = ["b"] * (x_ndim - 1)
            return slot, (["g", "o", *batch] if slot == 0 else [*batch, "g", "o"])
    return None


def _one_head(
    jaxpr_eqns: Sequence[JaxprEqn], reads: Mapping[Var, list[int]], value: Var, axis: int
) -> list[tuple[int, int, int]] | None:
    """``(slice index, squeeze index, head)`` for every read of `value`, when each takes
    one head: a stride-1 ``slice`` of one element along `axis` (the whole of every
    other axis) whose only read is a ``squeeze`` of that axis; `None` otherwise."""
    shape = tuple(aval_of(value).shape)
    found = []
    for i in reads.get(value, []):
        eqn = jaxpr_eqns[i]
        if eqn.primitive.name != "slice" or any(s != 1 for s in eqn.params["strides"] or ()):
            return None
        starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
        if limits[axis] - starts[axis] != 1:
            return None
        if any((starts[d], limits[d]) != (0, n) for d, n in enumerate(shape) if d != axis):
            return None
        later = reads.get(eqn.outvars[0], [])
        if len(later) != 1 or jaxpr_eqns[later[0]].primitive.name != "squeeze":
            return None
        if tuple(jaxpr_eqns[later[0]].params["dimensions"]) != (axis,):
            return None
        found.append((i, later[0], int(starts[axis])))
    return found or None


def split_products_read_head_by_head(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with each product onto several heads (``einsum('...i,gio->g...o', x,
    W)``) whose every read takes one head (``gates[k]``: gates stacked on a leading
    axis) computed one head at a time, ``x @ W[k]``: each head then is a plain
    product that lines up with the state it feeds, as gates computed one by one do.
    Invariant: invars, outvars and values are kept; `closed` itself when nothing
    splits."""
    jaxpr = closed.jaxpr
    reads: dict[Var, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for a in eqn.invars:
            if isinstance(a, Var):
                reads.setdefault(a, []).append(i)
    outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    plans: dict[int, tuple[JaxprEqn, int, list[str]]] = {}  # squeeze → product, head, axes
    skipped: set[int] = set()
    for i, eqn in enumerate(jaxpr.eqns):
        found = _heads_product(eqn)
        if found is None:
            continue
        _, axes = found
        value, chain = eqn.outvars[0], [i]
        later = reads.get(value, [])
        if len(later) == 1 and jaxpr.eqns[later[0]].primitive.name == "transpose":
            perm = jaxpr.eqns[later[0]].params["permutation"]
            axes = [axes[p] for p in perm]
            chain.append(later[0])
            value = jaxpr.eqns[later[0]].outvars[0]
        if value in outputs or any(v in outputs for v in (eqn.outvars[0], value)):
            continue
        heads = _one_head(jaxpr.eqns, reads, value, axes.index("g"))
        if heads is None:
            continue
        rest = [a for a in axes if a != "g"]
        skipped.update(chain)
        for cut, squeeze, head in heads:
            skipped.add(cut)
            plans[squeeze] = eqn, head, rest
    if not plans:
        return closed

    def one_head(env: dict[Var, Any], eqn: JaxprEqn, head: int, rest: list[str]) -> Any:
        slot, _ = _heads_product(eqn) or (0, [])
        (lc, rc), _ = eqn.params["dimension_numbers"]
        w_contract, x_contract = (lc[0], rc[0]) if slot == 0 else (rc[0], lc[0])
        w, x = _read(env, eqn.invars[slot]), _read(env, eqn.invars[1 - slot])
        w_heads = next(d for d in range(3) if d != w_contract)  # the output's "g"
        w_k = jax.lax.index_in_dim(w, head, axis=w_heads, keepdims=False)
        k_contract = w_contract - (w_contract > w_heads)
        y = jax.lax.dot_general(
            x,
            w_k,
            (((x_contract,), (k_contract,)), ((), ())),
            preferred_element_type=eqn.params.get("preferred_element_type"),
        )  # ([b,] o)
        return jnp.transpose(y) if rest == ["o", "b"] else y

    def split(i: int, eqn: JaxprEqn, env: dict[Var, Any]) -> list[Any] | None:
        if i in skipped:
            return [None] * len(eqn.outvars)  # the whole product, read only by its heads
        if i in plans:
            product, head, rest = plans[i]
            with equation_context(product):
                return [one_head(env, product, head, rest)]
        return None

    return retraced(closed, split)


def slice_program(
    closed: ClosedJaxpr,
    table: VarTable,
    inputs: Sequence[Var],
    outputs: Sequence[Any],
    allowed: Callable[[int], bool],
) -> tuple[Program, tuple[VarId, ...]]:
    """Cut a sub-program out of the step's jaxpr.

    Walking back from `outputs`, every equation that `allowed` accepts and that
    produces a needed value is kept; every other needed value (read by a kept
    equation but produced elsewhere) becomes a *constant input*.

    **Returns:** the `Program`, whose inputs are the constant inputs (in order of
    first use) followed by `inputs`, and the ids of those constant inputs.
    """
    jaxpr = closed.jaxpr
    input_set = set(inputs)
    needed: set[Var] = {v for v in outputs if isinstance(v, Var)}
    kept: list[int] = []
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        produces = [v for v in eqn.outvars if not isinstance(v, DropVar) and v in needed]
        if not produces or any(v in input_set for v in produces) or not allowed(i):
            continue
        kept.append(i)
        for v in produces:
            needed.discard(v)
        needed.update(v for v in eqn.invars if isinstance(v, Var))
    kept.reverse()
    eqns: list[JaxprEqn] = [jaxpr.eqns[i] for i in kept]
    produced = {v for e in eqns for v in e.outvars if not isinstance(v, DropVar)}
    const_inputs: list[Var] = []
    seen: set[Var] = set()
    for v in (*(a for e in eqns for a in e.invars), *outputs):
        if isinstance(v, Var) and v not in produced and v not in input_set and v not in seen:
            seen.add(v)
            const_inputs.append(v)
    invars = [*const_inputs, *inputs]
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    sub = replace_jaxpr(
        jaxpr, constvars=[], invars=invars, outvars=list(outputs), eqns=eqns, effects=effects
    )
    program = Program(
        ClosedJaxpr(sub, ()),
        [table.ids[v] for v in invars],
        [table.id_of(v) for v in outputs],
    )
    return program, tuple(table.ids[v] for v in const_inputs)


def forward_closure(
    table: VarTable, sources: Iterable[Var], crosses: Callable[[int], bool]
) -> set[Var]:
    """Every variable reachable from `sources` through equations `crosses` accepts."""
    reached = set(sources)
    stack = list(reached)
    while stack:
        v = stack.pop()
        for i in table.consumers.get(v, ()):
            if not crosses(i):
                continue
            for out in table.jaxpr.eqns[i].outvars:
                if not isinstance(out, DropVar) and out not in reached:
                    reached.add(out)
                    stack.append(out)
    return reached


CUSTOM_VJP = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})


def _forward_rule(eqn: JaxprEqn) -> Callable[..., list[Any]] | None:
    """The function of a ``custom_vjp_call`` equation as a `jax.custom_jvp` function:
    the call's own body, with the JVP ``t ↦ J t`` that is the transpose of the user's
    pullback ``c ↦ Jᵀ c`` (a surrogate spike's ``c ↦ c · σ'(x)`` gives ``t ↦ σ'(x) · t``).
    Reverse mode through it transposes that back to the user's pullback, so gradients
    are the ones `jax.grad` gives the call. The JVP rule is traced once, here, and
    evaluated from its jaxpr (without the primal call that `jax.vjp` leaves in it and
    nothing reads), so that the recognition can cut an element-wise one into parts.
    `None` where the call has no body to evaluate or its pullback cannot be
    transposed (a backward rule that is not linear in the cotangent)."""
    body = eqn.params.get("call_jaxpr")
    if not isinstance(body, ClosedJaxpr) or len(body.jaxpr.invars) != len(eqn.invars):
        return None
    wrt, outs = differentiable_positions(eqn)
    if not wrt or not outs:
        return None

    def primal(*args: Any) -> list[Any]:
        return eval_jaxpr(body.jaxpr, body.consts, *args)

    def pushforward(primals: list[Any], tangents: list[Any]) -> tuple[list[Any], list[Any]]:
        floats, pullback = equation_vjp(eqn, primals)  # the user's backward rule
        structs = [struct_of(f) for f in floats]
        (pushed,) = jax.linear_transpose(pullback, structs)(tuple(tangents))
        return primal(*primals), list(pushed)

    try:  # a pullback JAX cannot transpose fails here
        traced = jax.make_jaxpr(pushforward)(
            [struct_of(v) for v in eqn.invars], [struct_of(eqn.invars[i]) for i in wrt]
        )
    except Exception:
        return None
    traced = drop_dead_equations(traced)
    n_values = len(eqn.outvars)

    def rule(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
        flat = eval_jaxpr(traced.jaxpr, traced.consts, *primals, *(tangents[i] for i in wrt))
        values, pushed = flat[:n_values], iter(flat[n_values:])
        out_tangents = [
            next(pushed) if k in outs else jnp.zeros(aval_of(v).shape, jax.dtypes.float0)
            for k, v in enumerate(eqn.outvars)
        ]  # an integer or boolean output has no tangent
        return values, out_tangents

    fun = jax.custom_jvp(primal)
    fun.defjvp(rule)

    def call(*args: Any) -> list[Any]:
        return list(fun(*args))

    return call


def custom_vjp_as_jvp(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with each top-level `jax.custom_vjp` call (a surrogate spike written
    with `jax.custom_vjp` or `jax.custom_gradient`) made a `jax.custom_jvp` call of the
    same function, whose forward-mode derivative is the transpose of the user's
    backward rule (`_forward_rule`): etrax takes the Jacobians of transitions and
    tails in forward mode, which JAX does not give a custom_vjp function. The values,
    and the gradients reverse mode gives, are the call's own. A call whose backward
    rule cannot be transposed is left as it is (and refused where it sits on a
    traced path, `refuse_custom_vjp`). Returns `closed` itself when nothing changes."""
    rules = {
        i: rule
        for i, eqn in enumerate(closed.jaxpr.eqns)
        if eqn.primitive.name in CUSTOM_VJP and (rule := _forward_rule(eqn)) is not None
    }
    bodies = {
        i: new
        for i, eqn in enumerate(closed.jaxpr.eqns)
        if i not in rules and (new := _with_bodies_converted(eqn)) is not None
    }
    if not rules and not bodies:
        return closed

    def converted(i: int, eqn: JaxprEqn, env: dict[Var, Any]) -> list[Any] | None:
        invals = [_read(env, a) for a in eqn.invars]
        if i in bodies:
            return bind_equation(bodies[i], invals)
        rule = rules.get(i)
        if rule is None:
            return None
        with equation_context(eqn):
            return rule(*invals)

    return retraced(closed, converted)


def _with_bodies_converted(eqn: JaxprEqn) -> JaxprEqn | None:
    """`eqn` with the custom_vjp calls in the jaxprs it holds (the body of a loop, the
    branches of a ``cond``, that the compiler keeps whole) converted by
    `custom_vjp_as_jvp`; `None` where nothing changes. The bodies of custom-derivative
    calls are left as they are: their rules stand for them."""
    if eqn.primitive.name in CUSTOM_VJP or eqn.primitive.name == "custom_jvp_call":
        return None
    params = dict(eqn.params)
    for name, value in eqn.params.items():
        if isinstance(value, ClosedJaxpr):
            params[name] = custom_vjp_as_jvp(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, ClosedJaxpr) for v in value):
            new = tuple(custom_vjp_as_jvp(v) for v in value)
            if any(a is not b for a, b in zip(new, value, strict=True)):
                params[name] = new
    if all(params[n] is v for n, v in eqn.params.items()):
        return None
    replaced: JaxprEqn = eqn.replace(params=params)
    return replaced


def _nested_equations(jaxpr: Jaxpr) -> Iterable[JaxprEqn]:
    """The equations of `jaxpr` and of the jaxprs they hold (a loop's body), but not
    those inside a custom-derivative call, whose rules stand for them."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in CUSTOM_VJP or eqn.primitive.name == "custom_jvp_call":
            continue
        for inner in inner_closed_jaxprs(eqn):
            yield from _nested_equations(inner.jaxpr)


def refuse_custom_vjp(program: Program, what: str) -> None:
    """A `NotSupportedError` if `program` (a transition or a tail, whose Jacobians are
    taken in forward mode) still calls a `jax.custom_vjp` function: one that
    `custom_vjp_as_jvp` could not give a forward-mode rule, as its backward rule is
    not linear in the cotangent (or not traceable on abstract values)."""
    from .._compat import equation_location
    from .._errors import NotSupportedError

    for eqn in _nested_equations(program.closed.jaxpr):
        if eqn.primitive.name in CUSTOM_VJP:
            raise NotSupportedError(
                f"The {what} calls a jax.custom_vjp function at {equation_location(eqn)} "
                "whose backward rule etrax cannot turn into a forward-mode one. etrax takes "
                "the Jacobians of transitions and tails in forward mode, and derives a "
                "custom_vjp function's from its backward rule by transposing it, which "
                "needs the rule to be linear in the cotangent (ct * surrogate(x), not "
                "jnp.sign(ct)) and traceable on abstract values. Make it so, define the "
                "surrogate gradient with jax.custom_jvp instead (etrax.nn's spiking "
                "neurons do), or keep the function off the paths from the previous hidden "
                "values and the weight operations to the new ones."
            )


# ----- brainevent's event-driven products as the products they stand for --------------


def _spike_values(spikes: Any, dtype: Any) -> Any:
    """A binary dense product's spikes as numbers: booleans as 0 / 1, floats as they
    are (what brainevent's pure-JAX kernel multiplies, and what its rules
    differentiate: the tangent and cotangent rules of both operands are those of
    the plain product)."""
    return spikes.astype(dtype) if spikes.dtype == jnp.bool_ else spikes


def _spike_activity(spikes: Any, dtype: Any) -> Any:
    """A fixed-connection binary product's spikes as events: booleans as 0 / 1, a float
    as 1 where it is above zero (the product's value on every backend), with the
    float's own tangent (its rule for the spikes is the plain product's)."""
    if spikes.dtype == jnp.bool_:
        return spikes.astype(dtype)
    events = (spikes > 0).astype(dtype)
    return events + (spikes - jax.lax.stop_gradient(spikes))


def _connections(weights: Any, indices: Any, shape: tuple[int, int]) -> Any:
    """The dense ``(pre, post)`` matrix of a fixed number of connections per row:
    ``indices[i, k]`` is row ``i``'s ``k``-th column, ``weights`` its value (or one
    value for all, shape ``(1,)``); repeated connections add up."""
    rows = jnp.broadcast_to(jnp.arange(indices.shape[0])[:, None], indices.shape)
    values = jnp.broadcast_to(weights, indices.shape)
    return jnp.zeros(shape, weights.dtype).at[rows, indices].add(values)


def _fixed_pattern(indices: Any, shape: tuple[int, int], transpose: bool) -> SparsePattern | None:
    """The stored connections of a fixed-connection product as an `etrax.ops` pattern,
    laid out for ``spikes @ S`` (``(pre, post)``, or ``(post, pre)`` for the gathering
    ``transpose=False`` form); `None` when the indices are not known at compile time
    (a state's) or fall outside the shape."""
    if isinstance(indices, jax.core.Tracer):
        return None
    columns = np.asarray(indices, dtype=np.int64)
    rows = np.repeat(np.arange(columns.shape[0]), columns.shape[1])
    n_pre, n_post = shape
    try:
        if transpose:
            return SparsePattern(rows, columns.reshape(-1), (n_pre, n_post))
        return SparsePattern(columns.reshape(-1), rows, (n_post, n_pre))
    except OpArgumentError:
        return None


def _fixed_product(
    params: Mapping[str, Any], weights: Any, indices: Any, spikes: Any, events: bool = True
) -> Any:
    """``spikes @ S`` for the connections' matrix ``S`` (``spikes``: ``(in,)`` or
    ``(batch, in)``; their events, `_spike_activity`, or with ``events=False`` their
    values): an `etrax.ops.sparse_matmul` over the stored connections when their
    indices are known at compile time, so that D-RTRL traces only those, else a
    product with the dense matrix."""
    shape, transpose = tuple(params["shape"]), bool(params["transpose"])
    s = _spike_activity(spikes, weights.dtype) if events else spikes
    pattern = _fixed_pattern(indices, shape, transpose)
    if pattern is not None:
        data = jnp.broadcast_to(weights, indices.shape).reshape(-1)
        return sparse_matmul(s, data, pattern)
    matrix = _connections(weights, indices, shape)
    return s @ matrix if transpose else s @ matrix.T


def _dense_mv(params: Mapping[str, Any], weights: Any, spikes: Any) -> Any:
    s = _spike_values(spikes, weights.dtype)
    return s @ weights if params["transpose"] else s @ weights.T


def _dense_mm(params: Mapping[str, Any], weights: Any, spikes: Any) -> Any:
    # brainevent holds the batch on the spikes' last axis; the product is written with
    # it first, as ``x @ W`` (the transposes around it cancel the caller's own)
    s = _spike_values(spikes, weights.dtype).T
    return (s @ weights if params["transpose"] else s @ weights.T).T


def _fixed_mv(params: Mapping[str, Any], weights: Any, indices: Any, spikes: Any) -> Any:
    return _fixed_product(params, weights, indices, spikes)


def _fixed_mm(params: Mapping[str, Any], weights: Any, indices: Any, spikes: Any) -> Any:
    # the batch on the spikes' last axis, as in `_dense_mm`
    return _fixed_product(params, weights, indices, spikes.T).T


EVENT_PRODUCTS: Final[Mapping[str, Callable[..., Any]]] = {
    "binary_densemv": _dense_mv,  # brainstate.nn.EventLinear, one sample
    "binary_densemm": _dense_mm,  # ... a batch
    "ell_binary_matvec": _fixed_mv,  # brainstate.nn.EventFixedProb, one sample
    "binary_fcnmm": _fixed_mm,  # ... a batch
}
"""brainevent 0.2's event-driven products (their primitives' names) and what each
stands for, ``rule(params, *operands) -> value``: a product of the spikes and a
dense weight, or of the spikes and the sparse matrix of a fixed number of connections
per row (an `etrax.ops.sparse_matmul` over them, `_fixed_product`). The weights operand
comes first and the spikes last, as brainevent binds them."""


def _event_product_rule(eqn: JaxprEqn) -> Callable[..., Any] | None:
    """`eqn`'s plain-JAX rule, for an event-driven product `EVENT_PRODUCTS` names whose
    operands and parameters are as brainevent 0.2 binds them; `None` otherwise."""
    rule = EVENT_PRODUCTS.get(eqn.primitive.name)
    if rule is None or len(eqn.outvars) != 1 or "transpose" not in eqn.params:
        return None
    fixed = rule in (_fixed_mv, _fixed_mm)
    if len(eqn.invars) != (3 if fixed else 2) or (fixed and "shape" not in eqn.params):
        return None
    try:  # a dry run on the operands' shapes: a future release's layout falls through
        out = jax.eval_shape(lambda *a: rule(eqn.params, *a), *(struct_of(v) for v in eqn.invars))
    except (TypeError, ValueError, IndexError):
        return None
    want = aval_of(eqn.outvars[0])
    if out.shape != want.shape or out.dtype != want.dtype:
        return None
    return rule


def event_products_as_ops(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with each top-level event-driven product of brainevent
    (`EVENT_PRODUCTS`: ``brainstate.nn.EventLinear``'s and ``EventFixedProb``'s) written
    as the product it stands for: a plain one with a dense weight, which weight
    recognition then traces, or an `etrax.ops.sparse_matmul` over fixed connections
    (whose indices are constants of the step; a dense product with the matrix built
    from their weights where they are not). The value is the product's own for spikes
    that are 0 or 1 (its intended input; a dense product multiplies float spikes by
    their values, a fixed-connection one counts those above zero, as brainevent's
    kernels do), and the derivatives are its rules'. Returns `closed` itself when
    there is none."""
    rules = {
        i: rule
        for i, eqn in enumerate(closed.jaxpr.eqns)
        if (rule := _event_product_rule(eqn)) is not None
    }
    if not rules:
        return closed

    def converted(i: int, eqn: JaxprEqn, env: dict[Var, Any]) -> list[Any] | None:
        rule = rules.get(i)
        if rule is None:
            return None
        with equation_context(eqn):
            return [rule(eqn.params, *(_read(env, a) for a in eqn.invars))]

    return retraced(closed, converted)


_FIXED_CALLS: Final = {"brainevent.fcnmv": 1, "brainevent.fcnmm": 2}
"""brainevent's jitted float products over a fixed number of connections per row
(``brainstate.nn.FixedNumConn`` on float inputs: ``fcnmv(weights, indices, x)``,
``fcnmm(weights, indices, matrix)``, written in plain JAX as a scatter or a gather),
by the call's name, with the rank of their data operand."""


def _fixed_call_params(eqn: JaxprEqn, body: ClosedJaxpr) -> dict[str, Any] | None:
    """``shape`` and ``transpose`` of a fixed-connection call (`_FIXED_CALLS`), read from
    its operands and its body (a scatter to the columns: ``transpose=True``; a gather
    from them: ``False``); `None` for any other call."""
    rank = _FIXED_CALLS.get(str(eqn.params.get("name")))
    if rank is None or len(eqn.invars) != 3 or len(eqn.outvars) != 1:
        return None
    indices, data = (aval_of(v) for v in eqn.invars[1:])
    out = aval_of(eqn.outvars[0])
    if (
        len(indices.shape) != 2
        or not jnp.issubdtype(indices.dtype, jnp.integer)
        or not jnp.issubdtype(data.dtype, jnp.floating)
        or len(data.shape) != rank
        or len(out.shape) != rank
    ):
        return None
    used = {e.primitive.name for e in body.jaxpr.eqns}
    scatter, gather = "scatter-add" in used, "gather" in used
    if scatter == gather:
        return None
    n_post = out.shape[0] if scatter else data.shape[0]
    return {"shape": (indices.shape[0], n_post), "transpose": scatter}


def _fixed_call_value(params: Mapping[str, Any], weights: Any, indices: Any, data: Any) -> Any:
    """What a fixed-connection call (`_FIXED_CALLS`) computes, from its operands: the
    product of the data's values (``(in,)``, or ``(in, batch)`` with the batch last)
    with the connections' matrix (`_fixed_product`)."""
    if len(data.shape) == 1:
        return _fixed_product(params, weights, indices, data, events=False)
    return _fixed_product(params, weights, indices, data.T, events=False).T


def library_product(
    eqn: JaxprEqn, body: ClosedJaxpr, invals: Sequence[Any]
) -> Callable[[], Any] | None:
    """What a library's jitted product call (`_FIXED_CALLS`) stands for, as a thunk
    that computes it from `invals` (an `etrax.ops.sparse_matmul` over the fixed
    connections, `_fixed_product`); `None` where the call is no such product, its
    indices are not constants of the step, or the product does not give the body's
    values on random weights and data (`_fixed_call_checked`, at compile time: a
    library release that changed the call's meaning is inlined as it is)."""
    params = _fixed_call_params(eqn, body)
    if params is None:
        return None
    weights, indices, data = invals
    if isinstance(indices, jax.core.Tracer):
        return None

    if not _fixed_call_checked(body, params, weights, indices, data):
        return None
    return lambda: _fixed_call_value(params, weights, indices, data)


_CHECKS: dict[tuple[Any, ...], Callable[..., Any]] = {}
"""`_fixed_call_checked`'s compiled comparisons, by the body's printed jaxpr and the
operands' shapes and dtypes (every layer of one size shares one; at most 64)."""


def _fixed_call_checked(
    body: ClosedJaxpr, params: Mapping[str, Any], weights: Any, indices: Any, data: Any
) -> bool:
    """Whether a fixed-connection call's body (`_FIXED_CALLS`) gives `_fixed_call_value`
    on random weights and data and the call's own indices (traced in the check, so
    the product with the connections' dense matrix, which the sparse one equals):
    one compiled program per body and shapes, not an eager op each."""
    structs = tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in (weights, indices, data))
    key = (str(body.jaxpr), len(body.consts), tuple(params["shape"]), params["transpose"], structs)
    check = _CHECKS.get(key)
    if check is None:

        def both(w: Any, idx: Any, x: Any, consts: Sequence[Any]) -> tuple[Any, Any]:
            want = eval_jaxpr(body.jaxpr, consts, w, idx, x)[0]
            return want, _fixed_call_value(params, w, idx, x)  # traced indices: dense

        # compiled ahead of time: called inside a trace (the inlining's), a jitted
        # function would be staged into it rather than run
        args = (*(shape_struct(*a) for a in structs), [struct_of(c) for c in body.consts])
        try:
            check = jax.jit(both).lower(*args).compile()
        except (TypeError, ValueError):  # shapes that do not fit
            return False
        if len(_CHECKS) >= 64:  # a bounded cache: many layer sizes start it again
            _CHECKS.clear()
        _CHECKS[key] = check
    rng = np.random.default_rng(0)
    w = rng.standard_normal(weights.shape).astype(weights.dtype)
    x = rng.standard_normal(data.shape).astype(data.dtype)
    want, got = (np.asarray(a) for a in check(w, np.asarray(indices), x, list(body.consts)))
    tol = 1e-4 if want.dtype.itemsize < 8 else 1e-10
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=tol, atol=tol))
