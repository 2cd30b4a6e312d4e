"""Normalisation (part of stage 1, `extract`): the step's jaxpr rewritten into the
form the later stages trace.

Three rewrites, each optional through a `CompilePolicy`:

- **Weight operations recognised.** A plain ``dot_general`` (``@``, ``jnp.dot``,
  ``jnp.einsum``, brainunit's ``dot``/``matmul``) or ``conv_general_dilated`` whose
  one operand is a *weight value* (computed from ParamState leaves and constants
  only: the leaf itself, ``abs(w)``, ``w * mask``, a standardised ``w``, …) and whose
  other operand is data becomes the equivalent ETP op (`etrax.matmul`, `etrax.conv`;
  per-group weights, one batch dimension on each side, `etrax.grouped_matmul`).
  A following ``+ b`` with a weight-valued ``b`` along the output features becomes
  the op's bias. Any other weight value along the features that meets data in a
  binary element-wise primitive (a bias ``+ b``, a gain or learned decay ``u * h``, a
  time constant ``x / τ``; `ELEMENT_WISE_PRIMITIVES`) is read through
  `etrax.element_wise`, so its effect on the hidden states is traced too.
- **Fused gates split.** When a value is only ever cut into parts along its feature
  axis (``jnp.split``, slices) and is computed from such ops through element-wise
  functions (``sigmoid(x @ Wx + h @ Wh + b)``: the ops' outputs may meet each other,
  data, constants and weights along the features; `_Region`), each part is computed
  on its own: every op on the matching slice of its weight and bias, a weight along
  the features as one `etrax.element_wise` per part, other data sliced. The parts
  reach hidden states element-wise, so each is traced; the per-use accounting sums
  the parts' gradients into the one ParamState. An op whose whole output lines up
  with no hidden state but whose parts do is cut even where its output is also used
  whole (a layer norm over the fused gates, a penalty on them): it is computed once
  per part, and the whole value is the parts concatenated. A value whose parts (or
  the values computed from it part by part) are cut again later is computed in
  pieces fine enough for every cut, and the later cuts read those pieces
  (``split(sigmoid(g[..., :3n]), 3)``).
- **Control flow flattened.** ``lax.cond`` / ``lax.switch`` are if-converted (every
  branch evaluated, the result selected); a ``lax.scan`` (``fori_loop`` with static
  bounds) of at most `CompilePolicy.unroll_limit` steps is unrolled. Longer scans and
  weight-free ``while_loop`` s stay whole (opaque to tracing); a weight read inside a
  ``while_loop`` is refused, since a loop of unknown length cannot be traced.

Control flow is flattened first, then weight ops are recognised on the flat jaxpr:
an op and what it feeds are seen together wherever they were written (``x @ W``
computed once before a ``fori_loop`` of sub-steps, and cut into the same gates in
every sub-step, is cut once and each sub-step reads its parts). Each pass re-traces
the jaxpr through an interpreter, keeping every equation's source location, so the
result has the same inputs and outputs in the same order; an op that an unrolled
body repeats is recorded once.
"""

import enum
import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import equinox as eqx
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
    aval_of,
    bind_equation,
    bind_in_parts,
    call_body,
    custom_jvp_rules,
    equation_context,
    equation_location,
    struct_of,
)
from .._errors import NotSupportedError, RewriteLimitError
from .._typing import Path
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel, record
from ._jaxpr import (
    custom_vjp_as_jvp,
    drop_dead_equations,
    event_products_as_ops,
    fold_cuts_of_joins,
    inline_calls,
    merge_heads_first,
    retraced,
    split_products_read_head_by_head,
)
from ._positions import ELEMENTWISE

__all__ = ["CompilePolicy", "normalise", "note_dead_reads"]


class CompilePolicy(eqx.Module):
    """How the compiler rewrites a model's step before tracing it.

    **Arguments:**

    - `recognise_weight_ops`: turn plain ``dot_general`` / ``conv_general_dilated``
      on ParamState values into traced weight ops (`etrax.matmul`, `etrax.conv`), with
      a following bias add folded in and fused gates split (default ``True``). With
      ``False``, only ETP ops are traced and plain weight uses get their exact
      instantaneous gradient.
    - `if_convert`: evaluate every branch of ``lax.cond`` / ``lax.switch`` and select
      the result (default ``True``), so operations inside branches are traced. A
      branch whose value is not finite where it is not selected can still give a
      non-finite gradient, as with ``jnp.where``.
    - `unroll_limit`: unroll ``lax.scan`` / ``lax.fori_loop`` with at most this many
      steps (default 16); longer loops stay whole.
    - `max_equations`: a bound on the rewritten step's size; a rewrite past it (deeply
      nested loops) raises `RewriteLimitError` instead of running for ever.
    """

    recognise_weight_ops: bool = eqx.field(static=True, default=True)
    if_convert: bool = eqx.field(static=True, default=True)
    unroll_limit: int = eqx.field(static=True, default=16)
    max_equations: int = eqx.field(static=True, default=200_000)

    def __check_init__(self) -> None:
        if self.unroll_limit < 0:
            raise ValueError(
                f"CompilePolicy.unroll_limit must be an int >= 0, got {self.unroll_limit!r}"
            )
        if self.max_equations < 1:
            raise ValueError(
                f"CompilePolicy.max_equations must be an int >= 1, got {self.max_equations!r}"
            )


class _Kind(enum.IntEnum):
    """What a value is computed from (ordered: a join is the maximum)."""

    CONST = 0
    WEIGHT = 1
    DATA = 2


_Sources = frozenset[int]


def _read_kind(kinds: Mapping[Var, _Kind], atom: Any) -> _Kind:
    return _Kind.CONST if isinstance(atom, Literal) else kinds[atom]


def _static_kinds(
    jaxpr: Jaxpr, in_kinds: Sequence[_Kind], in_sources: Sequence[_Sources]
) -> tuple[dict[Var, _Kind], dict[Var, _Sources]]:
    """The kind of every variable, and the weight inputs each weight value reads."""
    kinds: dict[Var, _Kind] = {v: _Kind.CONST for v in jaxpr.constvars}
    sources: dict[Var, _Sources] = {}
    for v, k, s in zip(jaxpr.invars, in_kinds, in_sources, strict=True):
        kinds[v] = k
        sources[v] = s
    from ..ops import is_etp_primitive

    for eqn in jaxpr.eqns:
        ks = [_read_kind(kinds, a) for a in eqn.invars]
        # an ETP op's output is already a traced quantity, never a weight value
        k = _Kind.DATA if is_etp_primitive(eqn.primitive) else max(ks, default=_Kind.CONST)
        src: _Sources = frozenset().union(
            *(sources.get(a, frozenset()) for a in eqn.invars if isinstance(a, Var))
        )
        for o in eqn.outvars:
            if not isinstance(o, DropVar):
                kinds[o] = k
                sources[o] = src
    return kinds, sources


_PART_WISE = frozenset(
    {
        "logistic", "tanh", "exp", "exp2", "log", "log1p", "expm1", "neg", "abs", "sign",
        "sqrt", "rsqrt", "cbrt", "sin", "cos", "erf", "square", "integer_pow", "mul", "add",
        "sub", "div", "max", "min", "pow", "convert_element_type", "copy", "copy_p",
        "select_n", "clamp", "gt", "lt", "ge", "le", "eq", "ne", "add_any", "exprel",
    }
)  # fmt: skip
"""Element-wise primitives that recognised ops' outputs may pass through, alone or
meeting each other, data, constants or weights along the features, before the result
is cut into parts along its features: each is evaluated part by part."""

_ELEMENT_WISE_BODY = _PART_WISE | {"and", "or", "not", "xor", "is_finite", "stop_gradient"}
"""The primitives a ``custom_jvp_call``'s function and JVP rule may hold for the call to
be evaluated part by part (`_element_wise_call`)."""


def _part_wise(eqn: JaxprEqn) -> bool:
    """Whether `eqn` can be evaluated part by part along its features: a `_PART_WISE`
    primitive, or an element-wise ``custom_jvp_call`` (`_element_wise_call`)."""
    return eqn.primitive.name in _PART_WISE or _element_wise_call(eqn)


def _element_wise_call(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a ``custom_jvp_call`` (`jax.nn.relu`, `jax.nn.softplus`,
    `jnp.logaddexp`, a surrogate spike) whose function and JVP rules are element-wise:
    every value in them has the call's output shape or is a scalar, and every
    equation is an `_ELEMENT_WISE_BODY` primitive, a scalar broadcast to that shape, a
    nested call or such a ``custom_jvp_call``. It is then evaluated on parts of its
    operands with its own JVP rule (`bind_in_parts`)."""
    return _element_wise_call_in(eqn, frozenset())


def _element_wise_call_in(eqn: JaxprEqn, met: frozenset[tuple[str, str]]) -> bool:
    """`_element_wise_call`, where the calls in `met` (by name and function) are
    being checked further up: a JVP rule holds its own call (``relu``'s rule calls
    ``relu``), which counts as element-wise there."""
    if eqn.primitive.name != "custom_jvp_call" or len(eqn.outvars) != 1:
        return False
    whole = tuple(aval_of(eqn.outvars[0]).shape)
    if not whole or any(tuple(aval_of(a).shape) not in ((), whole) for a in eqn.invars):
        return False
    call = eqn.params["call_jaxpr"]
    key = (str(eqn.params.get("name")), str(call.jaxpr))  # a rule's call is a new trace
    if key in met:
        return True
    met = met | {key}
    try:
        rules = custom_jvp_rules(eqn)
    except Exception:  # a rule that cannot be traced here: the call stays whole, as before
        return False
    return all(_element_wise_body(b.jaxpr, whole, met) for b in [call, *rules])


def _element_wise_body(
    jaxpr: Jaxpr, whole: tuple[int, ...], met: frozenset[tuple[str, str]]
) -> bool:
    """Whether every equation of `jaxpr` is element-wise on `whole`-shaped values
    (`_element_wise_call`), and its constants scalars (a constant of the whole shape
    would not be cut with the operands)."""
    if any(tuple(aval_of(v).shape) for v in jaxpr.constvars):
        return False
    for eqn in jaxpr.eqns:
        atoms = [*eqn.invars, *(v for v in eqn.outvars if not isinstance(v, DropVar))]
        if any(tuple(aval_of(a).shape) not in ((), whole) for a in atoms):
            return False
        name = eqn.primitive.name
        body = call_body(eqn)
        if name == "broadcast_in_dim":
            if tuple(aval_of(eqn.invars[0]).shape):
                return False
        elif body is not None:
            if not _element_wise_body(body.jaxpr, whole, met):
                return False
        elif name == "custom_jvp_call":
            if not _element_wise_call_in(eqn, met):
                return False
        elif name not in _ELEMENT_WISE_BODY:
            return False
    return True


@dataclass
class _Fused:
    """A recognised weight op: where it starts, what it absorbs, how it is cut."""

    anchor: int  # the dot_general / conv equation
    weight_slot: int  # which operand of the anchor is the weight
    bias_eqn: int | None = None  # the `add` folded in as the op's bias
    bias_atom: Any = None  # that add's weight-valued operand
    cuts: list[int] = field(default_factory=list)  # split / slice eqns that take parts
    grouped: bool = False  # a per-group weight (one batch dimension): grouped_matmul
    inner: int | None = None  # ``(x @ A) @ B``: the product ``x @ A`` it starts from
    merge: tuple[int, ...] = ()  # a grouped op's transpose / reshape merging its heads

    @property
    def emit_at(self) -> int:
        if self.merge:
            return self.merge[-1]
        return self.bias_eqn if self.bias_eqn is not None else self.anchor

    @property
    def absorbed(self) -> set[int]:
        eqns = {self.anchor} if self.bias_eqn is None else {self.anchor, self.bias_eqn}
        eqns |= set(self.merge)
        return eqns if self.inner is None else eqns | {self.inner}


class _LowRank(NamedTuple):
    """The weights of ``(x @ A) @ B``, in the order they are applied."""

    first: Any
    second: Any


@dataclass
class _Region:
    """Fused gates: recognised ops whose outputs reach one value only through
    `_PART_WISE` equations (``sigmoid(x @ Wx + h @ Wh + b)``), where that value is only
    ever cut into parts along its features. Each part is computed from the parts of
    its inputs: an op on the matching slice of its weight, a slice of data, the slice
    of a weight along the features read through `etrax.element_wise`."""

    root: Var  # the value the cuts take parts of
    features: int
    cuts: list[int]  # split / slice equations on `root`
    pieces: list[tuple[int, int]]  # the feature ranges between every cut's bounds
    allow_whole: bool  # an op also used whole may be cut (see `_plan_regions`)
    refined: bool  # pieces finer than its own cuts, for later cuts (`_later_bounds`)
    eqns: list[int] = field(default_factory=list)  # evaluated per part, in jaxpr order
    anchors: dict[Var, int] = field(default_factory=dict)  # an op's output → its anchor
    weights: dict[Var, int] = field(default_factory=dict)  # weight operand → its equation
    whole: set[Var] = field(default_factory=set)  # root / anchors also used whole
    shared: set[Var] = field(default_factory=set)  # anchors whose pieces an earlier region makes
    values: set[Var] = field(default_factory=set)  # other values an earlier region makes in pieces
    read_whole: bool = False  # one of its own `whole` anchors is read outside every region
    fine: bool = False  # some cut takes several pieces (a later cut needs finer bounds)


_Pieces = list[tuple[tuple[int, int], Any]]
"""A value computed once per piece: each piece's feature range and value."""


def _joined(pieces: _Pieces, lo: int, hi: int) -> Any:
    """The part ``[lo, hi)`` of a value made in `pieces` (whose bounds hold both)."""
    inside = [p for (a, _), p in pieces if lo <= a < hi]
    return inside[0] if len(inside) == 1 else jnp.concatenate(inside, axis=-1)


class _Uses:
    """Consumers of every variable of one jaxpr."""

    def __init__(self, jaxpr: Jaxpr) -> None:
        self.consumers: dict[Var, list[int]] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for a in eqn.invars:
                if isinstance(a, Var):
                    self.consumers.setdefault(a, []).append(i)
        self.outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}

    def only_consumer(self, var: Var) -> int | None:
        users = self.consumers.get(var, [])
        if var in self.outputs or len(set(users)) != 1:
            return None
        return users[0]


MAX_SHARED_AXES = 4
"""The most free data axes a recognised ``x · W`` may have: one is `etrax.matmul`'s
rows; two to four are a batch axis and one to three position axes that share the
weight, written as a width-1 `etrax.conv` (whose spatial axes go up to three)."""


class _Axes(NamedTuple):
    """A dot_general's axes, split by operand (data `x`, weight `w`)."""

    x_free: list[int]
    w_free: list[int]
    x_contract: tuple[int, ...]
    w_contract: tuple[int, ...]


def _free_axes(eqn: JaxprEqn, weight_slot: int) -> _Axes:
    """The free and contracted axes of a dot_general whose weight is operand
    `weight_slot`, the contracted ones in the order the dot_general pairs them."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    ndim = [len(aval_of(a).shape) for a in eqn.invars]
    w_contract = tuple(rc if weight_slot == 1 else lc)
    x_contract = tuple(lc if weight_slot == 1 else rc)
    w_free = [d for d in range(ndim[weight_slot]) if d not in w_contract]
    x_free = [d for d in range(ndim[1 - weight_slot]) if d not in x_contract]
    return _Axes(x_free, w_free, x_contract, w_contract)


def _dense_dims(eqn: JaxprEqn, weight_slot: int) -> bool:
    """Whether a dot_general is ``x · W`` in a form etrax's ops express: no batch
    dimensions, one output feature axis of the weight, and the output laid out as
    ``(*free data axes, features)``, with one free data axis at most (`etrax.matmul`)
    or, for ``x`` on the left, up to `MAX_SHARED_AXES` (a width-1 `etrax.conv`: the
    weight shared along the data's leading axes, e.g. ``(batch, positions, in) @
    (in, out)``)."""
    (_, _), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb:
        return False
    axes = _free_axes(eqn, weight_slot)
    x_free = axes.x_free
    if len(axes.w_free) != 1 or not axes.w_contract:
        return False
    if weight_slot == 0:
        return not x_free
    return len(x_free) <= MAX_SHARED_AXES


def _conv_dims(eqn: JaxprEqn) -> bool:
    """Whether a convolution is one `etrax.conv` traces: its input and output in the
    channel-last layout, one group, and its kernel in any layout (`_kernel_order`
    lays it out as ``(*spatial, in, out)``, as brainstate's ``ConvTranspose`` kernels
    ``(*spatial, out, in)`` need)."""
    from ..ops._conv import default_dimension_numbers

    p = eqn.params
    lhs, rhs = (aval_of(a) for a in eqn.invars)
    n = len(rhs.shape) - 2
    if n not in (1, 2, 3) or len(lhs.shape) != n + 2:
        return False
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return False
    got = p["dimension_numbers"]
    want = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, default_dimension_numbers(n))
    return bool(got.lhs_spec == want.lhs_spec and got.out_spec == want.out_spec)


def _kernel_order(eqn: JaxprEqn) -> tuple[int, ...] | None:
    """The axis order that lays a convolution's kernel out as ``(*spatial, in, out)``
    (`etrax.conv`'s layout, each spatial axis matched to the input's in turn), or
    `None` when it already is."""
    rhs = tuple(eqn.params["dimension_numbers"].rhs_spec)  # (out, in, *spatial)
    order = (*rhs[2:], rhs[1], rhs[0])
    return None if order == tuple(range(len(rhs))) else order


def _along_features(
    jaxpr: Jaxpr, producers: Mapping[Var, int], atom: Any, features: int, out_ndim: int
) -> bool:
    """Whether `atom` is a weight value along the last axis (a bias, a gain, a decay):
    shape ``(F,)``, ``(1, …, 1, F)``, or a ``broadcast_in_dim`` of an ``(F,)`` value
    onto the last axis; or a scalar (of shape ``()``, ``(1,)``, ``(1, 1)``, …), itself or
    broadcast (one weight for every feature, read as ``F`` equal ones)."""
    if not isinstance(atom, Var):
        return False
    shape = tuple(aval_of(atom).shape)
    if all(d == 1 for d in shape):  # a scalar the primitive broadcasts itself
        return len(shape) <= out_ndim
    if shape[-1] == features and all(d == 1 for d in shape[:-1]):
        return len(shape) <= out_ndim
    i = producers.get(atom)
    if i is None or shape[-1] != features:
        return False
    eqn = jaxpr.eqns[i]
    if eqn.primitive.name != "broadcast_in_dim" or not isinstance(eqn.invars[0], Var):
        return False
    src_shape = tuple(aval_of(eqn.invars[0]).shape)
    dims = tuple(eqn.params["broadcast_dimensions"])
    if src_shape[-1:] == (features,) and all(d == 1 for d in src_shape[:-1]):
        return bool(dims) and dims[-1] == len(shape) - 1  # `(1, …, 1, F)` onto the features
    return all(d == 1 for d in src_shape)


def _cut_parts(eqn: JaxprEqn, features: int) -> list[tuple[int, int]] | None:
    """The feature ranges a split / slice equation takes along the last axis, or
    `None` when it cuts anything else."""
    ndim = len(aval_of(eqn.invars[0]).shape)
    name = eqn.primitive.name
    if name == "split":
        if eqn.params["axis"] not in (ndim - 1, -1):
            return None
        parts, start = [], 0
        for size in eqn.params["sizes"]:
            parts.append((start, start + int(size)))
            start += int(size)
        return parts
    if name == "slice":
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        strides = eqn.params["strides"]
        shape = aval_of(eqn.invars[0]).shape
        if strides is not None and any(s != 1 for s in strides):
            return None
        if any(start[d] != 0 or limit[d] != shape[d] for d in range(ndim - 1)):
            return None
        return [(int(start[-1]), int(limit[-1]))]
    return None


def _plan(jaxpr: Jaxpr, kinds: Mapping[Var, _Kind]) -> dict[int, _Fused]:
    """The weight operations to recognise in one jaxpr, keyed by anchor equation."""
    uses = _Uses(jaxpr)
    producers = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    plans: dict[int, _Fused] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if name not in ("dot_general", "conv_general_dilated"):
            continue
        k = [_read_kind(kinds, a) for a in eqn.invars]
        if sorted(k) != [_Kind.WEIGHT, _Kind.DATA]:
            continue
        slot = k.index(_Kind.WEIGHT)
        if name == "dot_general" and not _dense_dims(eqn, slot):
            if _grouped_dims(eqn, slot) or _headed_dims(eqn, slot):  # no bias or cuts folded in
                merge = _merged_heads(jaxpr, uses, eqn, slot)
                plans[i] = _Fused(anchor=i, weight_slot=slot, grouped=True, merge=merge)
            continue
        if name == "conv_general_dilated" and (slot != 1 or not _conv_dims(eqn)):
            continue
        fused = _Fused(anchor=i, weight_slot=slot)
        out = eqn.outvars[0]
        out_aval = aval_of(out)
        features = int(out_aval.shape[-1])
        j = uses.only_consumer(out)
        if j is not None and jaxpr.eqns[j].primitive.name == "add":
            add = jaxpr.eqns[j]
            other = add.invars[1] if add.invars[0] is out else add.invars[0]
            if (
                _read_kind(kinds, other) is _Kind.WEIGHT
                and _along_features(jaxpr, producers, other, features, len(out_aval.shape))
                and tuple(aval_of(add.outvars[0]).shape) == tuple(out_aval.shape)
            ):
                fused.bias_eqn, fused.bias_atom = j, other
        plans[i] = fused
    _plan_low_rank(jaxpr, plans, uses, producers)
    return plans


def _matrix_product(eqn: JaxprEqn, plan: _Fused) -> bool:
    """Whether a recognised op is ``x @ W``: `x` of shape ``(in,)`` or ``(batch, in)``
    on the left, `W` of ``(in, out)``, both in the product's own type."""
    if eqn.primitive.name != "dot_general" or plan.grouped or plan.weight_slot != 1:
        return False
    x, w = (aval_of(a) for a in eqn.invars)
    axes = _free_axes(eqn, 1)
    return (
        len(w.shape) == 2
        and len(x.shape) in (1, 2)
        and axes.x_contract == (len(x.shape) - 1,)
        and axes.w_contract == (0,)
        and x.dtype == w.dtype == aval_of(eqn.outvars[0]).dtype
    )


def _plan_low_rank(
    jaxpr: Jaxpr, plans: dict[int, _Fused], uses: _Uses, producers: Mapping[Var, int]
) -> None:
    """``(x @ A) @ B`` (brainstate's `LoRA`, a bottleneck with no nonlinearity): the
    second product takes in the first, whose result it alone reads, and both become
    one `etrax.lora_matmul`, whose trace is that of the product ``A @ B``; the first
    product on its own would reach the hidden state only through the second weight,
    and get its instantaneous gradient only. Chains of more products pair the first
    two."""
    for i in sorted(plans):
        second = plans.get(i)
        if second is None or not _matrix_product(jaxpr.eqns[i], second):
            continue
        u = jaxpr.eqns[i].invars[0]
        if not isinstance(u, Var) or (j := producers.get(u)) is None or j not in plans:
            continue
        first = plans[j]
        if first.inner is not None or first.bias_eqn is not None:
            continue
        if not _matrix_product(jaxpr.eqns[j], first) or uses.only_consumer(u) != i:
            continue
        second.inner = j
        del plans[j]


ELEMENT_WISE_PRIMITIVES = frozenset({"add", "add_any", "sub", "mul", "div", "max", "min"})
"""The binary element-wise primitives whose weight-valued operand along the output
features (a bias ``+ b``, a gain or a learned decay ``a * h``, a time constant ``x / τ``)
is read through `etrax.element_wise`, so that its effect on hidden states is traced
(``add_any`` is the sum that a derivative taken inside the model writes, such as the
Jacobian of brainstate's `exp_euler_step`)."""


def _plan_element_wise(
    jaxpr: Jaxpr, kinds: Mapping[Var, _Kind], absorbed: set[int]
) -> dict[int, int]:
    """Equations of an `ELEMENT_WISE_PRIMITIVES` primitive whose one operand is a
    weight value along the last axis and whose other is data (e.g. the ``+ b`` of
    ``x @ W + h @ U + b``, or ``h * u``), not `absorbed` into an op or a `_Region`:
    equation index → the weight operand's position."""
    producers = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    found: dict[int, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name not in ELEMENT_WISE_PRIMITIVES or i in absorbed:
            continue
        k = [_read_kind(kinds, a) for a in eqn.invars]
        if sorted(k) != [_Kind.WEIGHT, _Kind.DATA]:
            continue
        slot = k.index(_Kind.WEIGHT)
        out_shape = tuple(aval_of(eqn.outvars[0]).shape)
        if len(out_shape) == 0:
            continue
        if _along_features(jaxpr, producers, eqn.invars[slot], out_shape[-1], len(out_shape)):
            found[i] = slot
    return found


def _later_bounds(jaxpr: Jaxpr) -> dict[Var, set[int]]:
    """For every value, the feature bounds at which it, or a value computed from it
    part by part (through `_PART_WISE` equations of its width, and the parts cut from
    it), is cut later: ``sigmoid(g[..., :3n])`` cut in three asks `g` for bounds at
    ``n``, ``2n`` and ``3n``. A region cut at all of them computes its value in pieces
    fine enough for every later cut (`_Region.fine`)."""
    bounds: dict[Var, set[int]] = {}
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name in ("split", "slice"):
            root = eqn.invars[0]
            shape = tuple(aval_of(root).shape) if isinstance(root, Var) else ()
            ranges = _cut_parts(eqn, int(shape[-1])) if shape else None
            if ranges is None or not isinstance(root, Var):
                continue
            into = bounds.setdefault(root, set())
            for out, (lo, hi) in zip(eqn.outvars, ranges, strict=True):
                into.update((lo, hi))
                into.update(lo + b for b in bounds.get(out, ()) if 0 < b < hi - lo)
        elif len(eqn.outvars) == 1 and eqn.outvars[0] in bounds and _part_wise(eqn):
            out = eqn.outvars[0]
            shape = tuple(aval_of(out).shape)
            for a in eqn.invars:
                if (
                    isinstance(a, Var)
                    and tuple(aval_of(a).shape)[-1:] == shape[-1:]
                    and len(aval_of(a).shape) == len(shape)
                ):
                    bounds.setdefault(a, set()).update(bounds[out])
    return bounds


def _plan_regions(
    jaxpr: Jaxpr,
    kinds: Mapping[Var, _Kind],
    plans: Mapping[int, _Fused],
    hidden_sizes: frozenset[int],
) -> list[_Region]:
    """The `_Region` s of one jaxpr: for every value cut along its last axis, the
    `_PART_WISE` equations and recognised ops it is computed from part by part.

    The value, and a recognised op's output it is computed from, may also be used
    whole when cutting can only help: when no axis of any hidden state
    (`hidden_sizes`) has the value's width, so that the whole could never line up
    with one, and some part's width is one. Such a value is computed once per piece,
    the ranges between the bounds of every cut, and its whole value is the pieces
    concatenated. An op that an earlier region cuts so is read from its pieces by a
    later region whose bounds are among theirs (a product computed once before a loop
    of sub-steps, and cut into the same gates in every step), and so is a value an
    earlier region makes in pieces: its root used whole too, or a part it cuts that is
    cut again later (``split(sigmoid(g[..., :3n]), 3)``; `_later_bounds`). A value
    whose finer pieces no later region reads after all is planned again without them,
    so that its parts stay one op each."""
    later = _later_bounds(jaxpr)
    uses = _Uses(jaxpr)
    producers = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    results = {
        jaxpr.eqns[p.emit_at].outvars[0]: anchor for anchor, p in plans.items() if not p.grouped
    }
    while True:
        regions = _regions_with(jaxpr, kinds, plans, hidden_sizes, later, uses, producers, results)
        read = {v for r in regions for v in r.values}
        unread = [
            r.root
            for r in regions
            if r.refined
            and r.root not in read
            and not any(o in read for u in r.cuts for o in jaxpr.eqns[u].outvars)
        ]
        if not unread:
            return regions
        for p in plans.values():
            p.cuts = []
        for v in unread:
            del later[v]


def _regions_with(
    jaxpr: Jaxpr,
    kinds: Mapping[Var, _Kind],
    plans: Mapping[int, _Fused],
    hidden_sizes: frozenset[int],
    later: Mapping[Var, set[int]],
    uses: _Uses,
    producers: Mapping[Var, int],
    results: Mapping[Var, int],
) -> list[_Region]:
    """`_plan_regions` with the bounds that later cuts ask of each value, `later`; the
    jaxpr's consumers, producers and recognised ops' results (`_grow`), the same in
    every round."""
    regions: list[_Region] = []
    roots: set[Var] = set()
    claimed: set[Var] = set()  # anchors of earlier regions
    shareable: dict[Var, frozenset[int]] = {}  # of those, the ones cut in pieces: their bounds
    cut = dict.fromkeys(
        e.invars[0]
        for e in jaxpr.eqns
        if e.primitive.name in ("split", "slice") and isinstance(e.invars[0], Var)
    )
    # and a value that is not cut itself but that several values cut later are
    # computed from part by part (``split(sigmoid(g))`` and ``split(tanh(g))``)
    for v, bounds in later.items():
        shape = tuple(aval_of(v).shape)
        i = producers.get(v)
        if (
            v not in results
            and i is not None
            and shape
            and any(0 < b < shape[-1] for b in bounds)
            and len(set(uses.consumers.get(v, ()))) > 1
            and _part_wise(jaxpr.eqns[i])
        ):
            cut[v] = None
    # a value before the values computed from it, so that those may read its pieces
    for root in sorted(cut, key=lambda v: producers.get(v, -1)):
        if root in roots or root in claimed:
            continue
        shape = tuple(aval_of(root).shape)
        if not shape:
            continue
        features = int(shape[-1])
        consumers = set(uses.consumers[root])
        ranges = {
            u: r
            for u in consumers
            if jaxpr.eqns[u].invars[0] is root
            and (r := _cut_parts(jaxpr.eqns[u], features)) is not None
        }
        cuts = sorted(ranges)
        own = {0, features, *(b for r in ranges.values() for part in r for b in part)}
        edges = own | {b for b in later.get(root, ()) if 0 < b < features}
        pieces = list(itertools.pairwise(sorted(edges)))
        allow_whole = features not in hidden_sizes and any(
            hi - lo in hidden_sizes for lo, hi in pieces
        )
        used_whole = root in uses.outputs or len(cuts) < len(consumers)
        if (not cuts and edges == own) or (used_whole and not allow_whole):
            continue
        roots.add(root)
        region = _Region(
            root=root,
            features=features,
            cuts=cuts,
            pieces=pieces,
            allow_whole=allow_whole,
            refined=edges != own,
        )
        if used_whole:
            region.whole.add(root)
        _grow(jaxpr, kinds, uses, producers, results, region, claimed, shareable)
        whole_root = used_whole and root not in region.anchors
        if (region.anchors or region.values) and not (
            whole_root and producers.get(root) not in region.eqns
        ):
            region.eqns.sort()
            regions.append(region)
            claimed.update(region.anchors)
            for var, anchor in region.anchors.items():
                if var not in region.shared:
                    plans[anchor].cuts = cuts
                    if var in region.whole:
                        shareable[var] = frozenset(edges)
            region.fine = any(
                sum(1 for a, _ in pieces if lo <= a < hi) > 1
                for rs in ranges.values()
                for lo, hi in rs
            )
            if whole_root:  # made in pieces where it is computed
                shareable[root] = frozenset(edges)
            if region.fine:  # its parts too, where they are cut
                for u in cuts:
                    for out, (lo, hi) in zip(jaxpr.eqns[u].outvars, ranges[u], strict=True):
                        shareable[out] = frozenset(b - lo for b in edges if lo <= b <= hi)
    inside = {i for reg in regions for i in (*reg.eqns, *reg.cuts)}
    for reg in regions:
        reg.read_whole = any(
            v in uses.outputs or any(i not in inside for i in uses.consumers.get(v, ()))
            for v in reg.whole - reg.shared
        )
    return regions


def _grow(
    jaxpr: Jaxpr,
    kinds: Mapping[Var, _Kind],
    uses: _Uses,
    producers: Mapping[Var, int],
    results: Mapping[Var, int],
    region: _Region,
    claimed: set[Var],
    shareable: Mapping[Var, frozenset[int]],
) -> None:
    """Take into `region` every value its root is computed from part by part: a value
    used only in the region, produced by a recognised op or by a `_PART_WISE` equation
    whose operands can each be cut (or broadcast to every part); with
    `_Region.allow_whole`, also a recognised op's output used elsewhere too (not one
    that an earlier region, in `claimed`, took, but for one it cut in pieces, in
    `shareable`, at bounds that hold this region's). Any other value stays as it is, and
    is sliced per part. Values are met latest first, so every use of a value in the
    region is known before the value is."""
    shape = tuple(aval_of(region.root).shape)
    edges = {b for piece in region.pieces for b in piece}
    taken: set[int] = set(region.cuts)
    met = {region.root}
    todo = [(-producers.get(region.root, -1), 0, region.root)]
    while todo:
        _, _, var = heapq.heappop(todo)
        whole = var in uses.outputs or not set(uses.consumers.get(var, ())) <= taken
        if var in shareable and edges <= shareable[var]:
            if var in results:
                region.anchors[var] = results[var]
                region.whole.add(var)
                region.shared.add(var)
            else:
                region.values.add(var)
            continue
        if var in results and var not in claimed and (not whole or region.allow_whole):
            region.anchors[var] = results[var]
            if whole:
                region.whole.add(var)
            continue
        if whole and var is not region.root:
            continue  # needed whole elsewhere too
        if var in results:
            continue
        i = producers.get(var)
        if i is None:
            continue
        eqn = jaxpr.eqns[i]
        if not _part_wise(eqn) or len(eqn.outvars) != 1:
            continue
        inner: list[Var] = []
        weights: list[Var] = []
        for a in eqn.invars:
            if isinstance(a, Literal):
                continue
            s = tuple(aval_of(a).shape)
            broadcast = not s or (s[-1] == 1 and region.features != 1)
            if _read_kind(kinds, a) is _Kind.WEIGHT and eqn.primitive.name in (
                ELEMENT_WISE_PRIMITIVES
            ):
                if not _along_features(jaxpr, producers, a, region.features, len(shape)):
                    break
                weights.append(a)
            elif broadcast:
                continue
            elif s[-1] != region.features or len(s) != len(shape):
                break
            elif _read_kind(kinds, a) is not _Kind.WEIGHT:
                inner.append(a)
            else:
                break  # a weight in a primitive that is not `ELEMENT_WISE_PRIMITIVES`
        else:
            taken.add(i)
            region.eqns.append(i)
            region.weights.update((a, i) for a in weights)
            for a in inner:
                if a not in met:
                    met.add(a)
                    heapq.heappush(todo, (-producers.get(a, -1), len(met), a))


class _Budget:
    """Counts equations emitted by the rewrite and stops a runaway unrolling."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def spend(self, n: int, where: str) -> None:
        self.used += n
        if self.used > self.limit:
            raise RewriteLimitError(
                f"Rewriting update() would produce more than {self.limit} equations "
                f"(reached in {where}). Lower "
                "CompilePolicy.unroll_limit so that long loops stay whole, or raise "
                "CompilePolicy.max_equations."
            )


class _Rewriter:
    """Evaluates a jaxpr under `jax.make_jaxpr`, applying the planned rewrites."""

    def __init__(
        self,
        policy: CompilePolicy,
        names: Mapping[int, Path],
        records: list[CompilationRecord],
        hidden_sizes: frozenset[int],
        flatten: bool,
    ) -> None:
        self.policy = policy
        self.names = names
        self.records = records
        self.hidden_sizes = hidden_sizes
        # one of the two passes: control flow flattened (weight ops left as they are),
        # or weight ops recognised on the flattened jaxpr (control flow left whole)
        self.flatten = flatten
        self.recognise = policy.recognise_weight_ops and not flatten
        self.budget = _Budget(policy.max_equations)
        # what is already recorded: an unrolled body's equations repeat, each copy at
        # the same place in the source and on the same weights
        self.seen: set[tuple[str, str, _Sources]] = set()

    # ----- the interpreter -----------------------------------------------------------

    def run(
        self,
        jaxpr: Jaxpr,
        consts: Sequence[Any],
        args: Sequence[Any],
        in_kinds: Sequence[_Kind],
        in_sources: Sequence[_Sources],
        where: str = "the top level",
    ) -> list[Any]:
        """Evaluate `jaxpr` on `args`; `where` names the loop or branch it is a body of."""
        kinds, sources = _static_kinds(jaxpr, in_kinds, in_sources)
        plans = _plan(jaxpr, kinds) if self.recognise else {}
        regions = _plan_regions(jaxpr, kinds, plans, self.hidden_sizes) if plans else []
        absorbed = {i for p in plans.values() for i in p.absorbed}
        absorbed.update(i for r in regions for i in r.eqns)
        element_wise_uses = _plan_element_wise(jaxpr, kinds, absorbed) if self.recognise else {}
        in_region = {a for r in regions for a in r.anchors.values()}
        by_emit = {p.emit_at: p for a, p in plans.items() if a not in in_region}
        by_cut = {c: r for r in regions for c in r.cuts}
        by_whole = {
            plans[a].emit_at: (r, v)
            for r in regions
            for v, a in r.anchors.items()
            if v in r.whole and v not in r.shared
        }
        by_whole.update(
            (r.eqns[-1], (r, r.root)) for r in regions if r.root in r.whole - set(r.anchors)
        )
        pieces: dict[Var, _Pieces] = {}  # an op used whole too: its value per piece
        skipped = absorbed - set(by_emit)
        self.budget.spend(len(jaxpr.eqns), where)
        env: dict[Var, Any] = {}

        def read(atom: Any) -> Any:
            return atom.val if isinstance(atom, Literal) else env[atom]

        def write(outvars: Sequence[Any], values: Sequence[Any]) -> None:
            for v, val in zip(outvars, values, strict=True):
                if not isinstance(v, DropVar):
                    env[v] = val

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for i, eqn in enumerate(jaxpr.eqns):
            if i in by_cut:
                region = by_cut[i]
                ranges = _cut_parts(eqn, region.features)
                assert ranges is not None
                if region.fine and region.root not in pieces:  # every piece, once
                    every = self._parts(jaxpr, plans, region, region.pieces, read, sources, pieces)
                    pieces[region.root] = list(zip(region.pieces, every, strict=True))
                values = self._parts(jaxpr, plans, region, ranges, read, sources, pieces)
                if region.fine:  # a part cut again later: its pieces, from its own start
                    for out, (lo, hi) in zip(eqn.outvars, ranges, strict=True):
                        pieces[out] = [
                            ((a - lo, b - lo), p)
                            for (a, b), p in pieces[region.root]
                            if lo <= a < hi
                        ]
                write(eqn.outvars, values)
                continue
            if i in by_whole:  # a value also used whole: computed once per piece
                region, var = by_whole[i]
                if var in region.anchors:
                    plan = plans[region.anchors[var]]
                    values = self._pieces(jaxpr, plan, region, read, sources)
                else:  # the root
                    ranges = region.pieces
                    values = self._parts(jaxpr, plans, region, ranges, read, sources, pieces)
                pieces[var] = list(zip(region.pieces, values, strict=True))
                write(eqn.outvars, [jnp.concatenate(values, axis=-1)])
                continue
            if i in by_emit:
                plan = by_emit[i]
                write(eqn.outvars, [self._emit(jaxpr, plan, read, sources)])
                continue
            if i in skipped:
                continue
            if i in element_wise_uses:
                slot = element_wise_uses[i]
                write(eqn.outvars, self._element_wise_use(jaxpr, eqn, slot, read, sources))
                continue
            write(eqn.outvars, self._equation(eqn, read, kinds, sources))
        return [read(a) for a in jaxpr.outvars]

    def _equation(
        self,
        eqn: JaxprEqn,
        read: Any,
        kinds: Mapping[Var, _Kind],
        sources: Mapping[Var, _Sources],
    ) -> list[Any]:
        name = eqn.primitive.name
        invals = [read(a) for a in eqn.invars]
        ks = [_read_kind(kinds, a) for a in eqn.invars]
        ss = [
            sources.get(a, frozenset()) if isinstance(a, Var) else frozenset() for a in eqn.invars
        ]
        if not self.flatten:
            return bind_equation(eqn, invals)
        if name == "cond" and self.policy.if_convert and not _effects(eqn):
            return self._cond(eqn, invals, ks, ss)
        if name == "scan" and self._unrolls(eqn):
            return self._scan(eqn, invals, ks, ss)
        if name == "while" and any(k is _Kind.WEIGHT for k in ks):
            self._refuse_while(eqn, ss, ks)
        if name == "scan" and any(k is _Kind.WEIGHT for k in ks):
            self._note_long_scan(eqn, ss, ks)
        return bind_equation(eqn, invals)

    # ----- recognised weight ops ---------------------------------------------------------

    def _operands(self, jaxpr: Jaxpr, plan: _Fused, read: Any) -> tuple[JaxprEqn, Any, Any, Any]:
        eqn = jaxpr.eqns[plan.anchor]
        w = read(eqn.invars[plan.weight_slot])
        if plan.inner is None:
            x = read(eqn.invars[1 - plan.weight_slot])
        else:  # ``(x @ A) @ B``: the first product's data and both weights
            first = jaxpr.eqns[plan.inner]
            x, w = read(first.invars[0]), _LowRank(read(first.invars[1]), w)
        features = tuple(aval_of(eqn.outvars[0]).shape)[-1]
        bias = (
            None
            if plan.bias_atom is None
            else _feature_vector(jaxpr, plan.bias_atom, read, features)
        )
        return eqn, x, w, bias

    def _op(
        self,
        eqn: JaxprEqn,
        slot: int,
        x: Any,
        w: Any,
        bias: Any,
        part: tuple[int, int] | None,
        grouped: bool = False,
        merge: bool = False,
    ) -> Any:
        """The ETP op equivalent to the anchor equation (on one feature range); with
        `merge`, to the anchor and the equations that merge its heads."""
        from ..ops import conv, lora_matmul, matmul
        from ..ops._conv import shared_product

        with equation_context(eqn):
            if grouped:
                y = _grouped_op(eqn, slot, x, w, bias, merge)
                dtype = aval_of(eqn.outvars[0]).dtype
                return y if y.dtype == dtype else y.astype(dtype)
            if isinstance(w, _LowRank):  # `_matrix_product`s: x (in,) or (batch, in)
                x2, w2 = x, w.second
            elif eqn.primitive.name == "dot_general":
                x2, w2 = _dense_operands(eqn, slot, x, w)
            else:
                order = _kernel_order(eqn)
                x2, w2 = x, (w if order is None else jnp.transpose(w, order))
            wide = _accumulation_dtype(eqn, x2, w2)
            if wide is not None:  # e.g. float32 operands summed in float64: the same
                x2, w2 = x2.astype(wide), w2.astype(wide)  # products, exact in the wider type
            if part is not None:
                w2 = w2[..., part[0] : part[1]]
                bias = None if bias is None else bias[part[0] : part[1]]
            if bias is not None:
                bias = bias.astype(w2.dtype)
            if isinstance(w, _LowRank):
                y = lora_matmul(x2, w.first, w2, bias)
            elif eqn.primitive.name == "dot_general" and jnp.ndim(x2) > 2:
                y = shared_product(x2, w2, bias)  # position axes sharing the weight
            elif eqn.primitive.name == "dot_general":
                y = matmul(x2, w2, bias)
            else:
                p = eqn.params
                y = conv(
                    x2,
                    w2,
                    bias,
                    strides=tuple(p["window_strides"]),
                    padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]),
                    lhs_dilation=tuple(p["lhs_dilation"]),
                    rhs_dilation=tuple(p["rhs_dilation"]),
                )
            dtype = aval_of(eqn.outvars[0]).dtype
            return y if y.dtype == dtype else y.astype(dtype)

    def _emit(
        self,
        jaxpr: Jaxpr,
        plan: _Fused,
        read: Any,
        sources: Mapping[Var, _Sources],
    ) -> Any:
        eqn, x, w, bias = self._operands(jaxpr, plan, read)
        self._note_recognised(jaxpr, plan, sources)
        return self._op(eqn, plan.weight_slot, x, w, bias, None, plan.grouped, bool(plan.merge))

    def _pieces(
        self,
        jaxpr: Jaxpr,
        plan: _Fused,
        region: _Region,
        read: Any,
        sources: Mapping[Var, _Sources],
    ) -> list[Any]:
        """A recognised op that is also used whole, once per piece of `region`."""
        eqn, x, w, bias = self._operands(jaxpr, plan, read)
        self._note_recognised(jaxpr, plan, sources, len(region.pieces), region.read_whole)
        return [self._op(eqn, plan.weight_slot, x, w, bias, piece) for piece in region.pieces]

    def _parts(
        self,
        jaxpr: Jaxpr,
        plans: Mapping[int, _Fused],
        region: _Region,
        ranges: Sequence[tuple[int, int]],
        read: Any,
        sources: Mapping[Var, _Sources],
        pieces: Mapping[Var, _Pieces],
    ) -> list[Any]:
        """The parts of `region`'s root over `ranges`, each computed on its own (a
        value also used whole: from its `pieces`, computed where the value was)."""

        def joined(var: Var, lo: int, hi: int) -> Any:
            return _joined(pieces[var], lo, hi)

        if region.root in pieces:
            return [joined(region.root, lo, hi) for lo, hi in ranges]
        operands = {}
        for var, anchor in region.anchors.items():
            if var not in region.whole:
                operands[var] = self._operands(jaxpr, plans[anchor], read)
                pieced = region.root in region.whole or region.fine
                count = len(region.pieces) if pieced else None
                self._note_recognised(jaxpr, plans[anchor], sources, count, region.read_whole)
        for i in dict.fromkeys(region.weights.values()):
            eqn = jaxpr.eqns[i]
            atoms = [a for a in eqn.invars if isinstance(a, Var) and region.weights.get(a) == i]
            srcs = frozenset().union(*(sources.get(a, frozenset()) for a in atoms))
            if self._first_time(eqn, srcs):
                self._note_element_wise(eqn, self._paths(srcs))
        outs = []
        for lo, hi in ranges:
            part: dict[Var, Any] = {}

            def value(atom: Any, lo: int = lo, hi: int = hi, part: dict[Var, Any] = part) -> Any:
                if isinstance(atom, Literal):
                    return atom.val
                if atom in part:
                    return part[atom]
                if atom in region.values:  # made in pieces by an earlier region
                    return joined(atom, lo, hi)
                shape = tuple(aval_of(atom).shape)
                if atom in region.weights:
                    eqn = jaxpr.eqns[region.weights[atom]]
                    with equation_context(eqn):
                        return _element_wise_weight(jaxpr, eqn, atom, read, (lo, hi))
                whole = read(atom)
                if shape and shape[-1] == region.features:  # data: its part
                    return jax.lax.slice_in_dim(whole, lo, hi, axis=len(shape) - 1)
                return whole  # broadcast to every part

            for var, (eqn, x, w, bias) in operands.items():
                slot = plans[region.anchors[var]].weight_slot
                part[var] = self._op(eqn, slot, x, w, bias, (lo, hi))
            for var in region.whole & set(region.anchors):
                part[var] = joined(var, lo, hi)
            for i in region.eqns:
                eqn = jaxpr.eqns[i]
                (part[eqn.outvars[0]],) = bind_in_parts(eqn, [value(a) for a in eqn.invars])
            outs.append(part[region.root])
        return outs

    def _first_time(self, eqn: JaxprEqn, srcs: _Sources) -> bool:
        """Whether `eqn`, reading the weights `srcs`, is met for the first time: the
        copies of an unrolled body's equation share their place in the source and
        their weights, and are recorded once."""
        key = (str(eqn.primitive.name), equation_location(eqn), srcs)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def _note_recognised(
        self,
        jaxpr: Jaxpr,
        plan: _Fused,
        sources: Mapping[Var, _Sources],
        pieces: int | None = None,
        whole: bool = True,
    ) -> None:
        """Record `plan`'s op once; `pieces`: it, or the value cut, is also used whole,
        or read by several cut values, and it is computed in that many parts (`whole`:
        something reads it whole)."""
        eqn = jaxpr.eqns[plan.anchor]
        atoms = [eqn.invars[plan.weight_slot]]
        if plan.inner is not None:
            atoms.insert(0, jaxpr.eqns[plan.inner].invars[1])
        srcs = frozenset().union(
            *(sources.get(a, frozenset()) for a in atoms if isinstance(a, Var))
        )
        if not self._first_time(eqn, srcs):
            return
        paths = self._paths(srcs)
        shared = eqn.primitive.name == "dot_general" and (
            len(_free_axes(eqn, plan.weight_slot).x_free) > 1
        )
        headed = plan.grouped and not eqn.params["dimension_numbers"][1][0]
        op = (
            "etrax.lora_matmul (the product of two weights in a row, (x @ A) @ B)"
            if plan.inner is not None
            else "etrax.grouped_matmul"
            if plan.grouped
            else "etrax.conv (width 1: the weight shared along the data's leading axes)"
            if shared
            else "etrax.matmul"
            if eqn.primitive.name == "dot_general"
            else "etrax.conv"
        )
        extras = ["the data read by every head"] if headed else []
        if plan.bias_eqn is not None:
            extras.append("with the following add as its bias")
        if plan.merge:
            extras.append("its heads merged into one axis by the reshape that follows")
        features = int(aval_of(eqn.outvars[0]).shape[-1])
        n = sum(len(_cut_parts(jaxpr.eqns[c], features) or []) for c in plan.cuts)
        if pieces is not None:
            n = pieces
            extras.append(
                f"cut into {n} parts along its features (fused gates), one op each; where the "
                "value cut is also used whole, the parts concatenated"
                if whole
                else f"cut into {n} parts along its features (fused gates), one op each, "
                "whose parts several cut values read"
            )
        elif plan.cuts:
            extras.append(f"cut into {n} parts along its features (fused gates), one op each")
        extra = f" ({'; '.join(extras)})" if extras else ""
        self.records.append(
            record(
                DiagnosticKind.WEIGHT_OP_RECOGNISED,
                DiagnosticLevel.INFO,
                f"{eqn.primitive.name} at {equation_location(eqn)} on {list(paths)} was "
                f"recognised as {op}{extra}.",
                primitive=str(eqn.primitive.name),
                weight_path=paths[0] if paths else None,
                parts=n,  # ops it becomes, one per part (0: not cut)
            )
        )

    def _element_wise_use(
        self,
        jaxpr: Jaxpr,
        eqn: JaxprEqn,
        slot: int,
        read: Any,
        sources: Mapping[Var, _Sources],
    ) -> list[Any]:
        """``data ± b`` (or ``data * b``, …: `ELEMENT_WISE_PRIMITIVES`) with the weight
        operand read through `etrax.element_wise`, so its effect on hidden states is
        traced like any ETP op's."""
        atom = eqn.invars[slot]
        assert isinstance(atom, Var)  # `_along_features` accepts variables only
        srcs = sources.get(atom, frozenset())
        if self._first_time(eqn, srcs):
            self._note_element_wise(eqn, self._paths(srcs))
        with equation_context(eqn):
            invals = [read(a) for a in eqn.invars]
            invals[slot] = _element_wise_weight(jaxpr, eqn, atom, read, None)
            return bind_equation(eqn, invals)

    def _note_element_wise(self, eqn: JaxprEqn, paths: tuple[Path, ...]) -> None:
        self.records.append(
            record(
                DiagnosticKind.WEIGHT_OP_RECOGNISED,
                DiagnosticLevel.INFO,
                f"{eqn.primitive.name} at {equation_location(eqn)} "
                + (
                    f"adds {list(paths)} as a bias"
                    if eqn.primitive.name in ("add", "sub")
                    else f"applies {list(paths)} element-wise"
                )
                + "; recognised as etrax.element_wise.",
                primitive=str(eqn.primitive.name),
                weight_path=paths[0] if paths else None,
            )
        )

    def _paths(self, srcs: _Sources) -> tuple[Path, ...]:
        return tuple(dict.fromkeys(self.names[i] for i in sorted(srcs) if i in self.names))

    # ----- control flow ------------------------------------------------------------------

    def _cond(
        self, eqn: JaxprEqn, invals: list[Any], ks: list[_Kind], ss: list[_Sources]
    ) -> list[Any]:
        index, *ops = invals
        branches = eqn.params["branches"]
        with equation_context(eqn):
            where = equation_location(eqn)
            results = [self.run(b.jaxpr, b.consts, ops, ks[1:], ss[1:], where) for b in branches]
            if len(branches) == 1:
                return results[0]
            index = jnp.clip(index.astype(jnp.int32), 0, len(branches) - 1)
            return [
                jax.lax.select_n(index, *(r[j] for r in results)) for j in range(len(eqn.outvars))
            ]

    def _unrolls(self, eqn: JaxprEqn) -> bool:
        length = int(eqn.params["length"])
        return 0 < length <= self.policy.unroll_limit and not _effects(eqn)

    def _scan(
        self, eqn: JaxprEqn, invals: list[Any], ks: list[_Kind], ss: list[_Sources]
    ) -> list[Any]:
        p = eqn.params
        body: ClosedJaxpr = p["jaxpr"]
        n_const, n_carry, length = int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
        consts, carry, xs = (
            invals[:n_const],
            invals[n_const : n_const + n_carry],
            invals[n_const + n_carry :],
        )
        k_c, k_carry, k_x = ks[:n_const], ks[n_const : n_const + n_carry], ks[n_const + n_carry :]
        s_c, s_carry, s_x = ss[:n_const], ss[n_const : n_const + n_carry], ss[n_const + n_carry :]
        order = range(length - 1, -1, -1) if p["reverse"] else range(length)
        ys_steps: dict[int, list[Any]] = {}
        with equation_context(eqn):
            for t in order:
                x_t = [jax.lax.index_in_dim(x, t, keepdims=False) for x in xs]
                outs = self.run(
                    body.jaxpr, body.consts, [*consts, *carry, *x_t],
                    [*k_c, *k_carry, *k_x], [*s_c, *s_carry, *s_x], equation_location(eqn),
                )  # fmt: skip
                carry, ys_steps[t] = outs[:n_carry], outs[n_carry:]
                joined = max([*k_c, *k_carry, *k_x], default=_Kind.CONST)
                k_carry = [max(k, joined) for k in k_carry]
            n_ys = len(eqn.outvars) - n_carry
            ys = [jnp.stack([ys_steps[t][j] for t in range(length)]) for j in range(n_ys)]
        return [*carry, *ys]

    def _refuse_while(self, eqn: JaxprEqn, ss: list[_Sources], ks: list[_Kind]) -> None:
        srcs: _Sources = frozenset().union(
            *(s for s, k in zip(ss, ks, strict=True) if k is _Kind.WEIGHT)
        )
        paths = self._paths(srcs)
        where = equation_location(eqn)
        rec = record(
            DiagnosticKind.PRIMITIVE_INSIDE_CONTROL_FLOW,
            DiagnosticLevel.ERROR,
            f"The weight state(s) {list(paths)} are read inside a while_loop at {where}.",
            primitive="while",
            weight_path=paths[0] if paths else None,
        )
        raise NotSupportedError(
            f"The weight state(s) {list(paths)} are read inside a lax.while_loop at {where}. "
            "A loop whose length is only known at run time cannot be traced online. Use "
            "lax.fori_loop / lax.scan with static bounds (unrolled up to "
            "CompilePolicy.unroll_limit steps), or move the weight operation out of the loop.",
            [*self.records, rec],
        )

    def _note_long_scan(self, eqn: JaxprEqn, ss: list[_Sources], ks: list[_Kind]) -> None:
        srcs: _Sources = frozenset().union(
            *(s for s, k in zip(ss, ks, strict=True) if k is _Kind.WEIGHT)
        )
        self.records.append(
            record(
                DiagnosticKind.LOOP_KEPT_WHOLE,
                DiagnosticLevel.INFO,
                f"The scan of {eqn.params['length']} steps at {equation_location(eqn)} is longer "
                f"than CompilePolicy.unroll_limit={self.policy.unroll_limit}; it stays whole, "
                f"so the weights read inside it ({list(self._paths(srcs))}) are not traced "
                "through it (they still get their exact instantaneous gradient).",
                primitive="scan",
            )
        )


def _effects(eqn: JaxprEqn) -> bool:
    return bool(getattr(eqn, "effects", None))


def _element_wise_weight(
    jaxpr: Jaxpr, eqn: JaxprEqn, atom: Var, read: Any, part: tuple[int, int] | None
) -> Any:
    """Weight operand `atom` of `eqn` (along its output's features, `_along_features`)
    read through `etrax.element_wise`: the whole feature vector, or its `part`, shaped
    to broadcast as `atom` did (a scalar to the data's shape)."""
    from ..ops import element_wise

    out_shape = tuple(aval_of(eqn.outvars[0]).shape)
    vector = _feature_vector(jaxpr, atom, read, out_shape[-1])
    if part is not None:
        vector = vector[part[0] : part[1]]
    weight = element_wise(vector)
    shape = tuple(aval_of(atom).shape)
    to = (*(shape or out_shape)[:-1], weight.shape[-1])
    value = weight if to == tuple(weight.shape) else jnp.broadcast_to(weight, to)
    return value.astype(aval_of(atom).dtype)


def _feature_vector(jaxpr: Jaxpr, atom: Var, read: Any, features: int) -> Any:
    """The ``(F,)`` vector of a weight operand along the features (an op's folded bias,
    or an element-wise weight of `_plan_element_wise`; a scalar's broadcast to ``F``
    features: the op's weight stays a program of the ParamState leaf, through which
    `relate` sums its gradient)."""
    shape = tuple(aval_of(atom).shape)
    if all(d == 1 for d in shape):  # a scalar
        return jnp.broadcast_to(jnp.reshape(read(atom), ()), (features,))
    if all(d == 1 for d in shape[:-1]):
        return jnp.reshape(read(atom), (shape[-1],))
    for eqn in jaxpr.eqns:
        if atom in eqn.outvars:
            source = read(eqn.invars[0])
            if all(d == 1 for d in jnp.shape(source)[:-1]):  # `(F,)`, `(1, …, 1, F)`, scalar
                source = jnp.reshape(source, jnp.shape(source)[-1:])
            if jnp.size(source) == 1:
                source = jnp.reshape(source, ())
            return jnp.broadcast_to(source, (features,))
    raise AssertionError("planned weight operand has no producer")


def _grouped_dims(eqn: JaxprEqn, weight_slot: int) -> bool:
    """Whether a dot_general is a per-group product `etrax.grouped_matmul` expresses
    (``einsum('gi,gio->go')``, ``'bgi,gio->bgo'``, or ``jax.vmap`` of ``x @ W[g]``): one
    batch dimension on each side, a weight of one batch, one contracted and one free
    axis, and data of one contracted and at most one free axis."""
    (lc, _), (lb, rb) = eqn.params["dimension_numbers"]
    if len(lb) != 1 or len(rb) != 1 or len(lc) != 1:
        return False
    ndim = [len(aval_of(a).shape) for a in eqn.invars]
    return ndim[weight_slot] == 3 and ndim[1 - weight_slot] in (2, 3)


def _headed_dims(eqn: JaxprEqn, weight_slot: int) -> bool:
    """Whether a dot_general maps data onto several heads at once, ``einsum('...i,ihd->
    ...hd', x, W)``: no batch dimensions, a weight of one contracted and two free axes
    (heads, features), and data ``(in,)`` or ``(batch, in)``: `etrax.grouped_matmul`
    with the data read by every head (`_grouped_op`), whose output ``([batch,] heads,
    features)`` lines up with a hidden state of that shape."""
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    if lb or len(lc) != 1:
        return False
    axes = _free_axes(eqn, weight_slot)
    x_ndim = len(aval_of(eqn.invars[1 - weight_slot]).shape)
    if len(axes.w_free) != 2 or len(axes.w_contract) != 1 or axes.x_contract != (x_ndim - 1,):
        return False
    return x_ndim in (1, 2)


def _grouped_op(eqn: JaxprEqn, slot: int, x: Any, w: Any, bias: Any, merge: bool = False) -> Any:
    """The dot_general of `_grouped_dims` as `etrax.grouped_matmul`: the operands moved
    to ``([B,] G, I)`` and ``(G, I, O)``, the result back to the dot_general's layout
    (batch, then the first operand's free axes, then the second's). One of
    `_headed_dims` reads the data ``([B,] I)`` in every group (broadcast to
    ``([B,] G, I)``). With `merge` (`_merged_heads`), the result is ``([B,] G·O)``, the
    value of the transpose and reshape that followed the dot_general."""
    from ..ops import grouped_matmul

    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if not lb:  # `_headed_dims`
        (wc,) = rc if slot == 1 else lc
        heads, features = [d for d in range(3) if d != wc]
        w3 = jnp.transpose(w, (heads, wc, features))
        x3 = jnp.broadcast_to(x[..., None, :], (*jnp.shape(x)[:-1], w3.shape[0], w3.shape[1]))
    else:
        (xb, wb) = (lb[0], rb[0]) if slot == 1 else (rb[0], lb[0])
        (xc, wc) = (lc[0], rc[0]) if slot == 1 else (rc[0], lc[0])
        (wf,) = [d for d in range(3) if d not in (wb, wc)]
        x_free = [d for d in range(jnp.ndim(x)) if d not in (xb, xc)]
        w3 = jnp.transpose(w, (wb, wc, wf))
        x3 = jnp.transpose(x, (*x_free, xb, xc))
    y = grouped_matmul(x3, w3, bias, merge_groups=merge)  # ([B,] G, O) or ([B,] G·O)
    order = _natural_order(eqn, slot)
    if merge or order == tuple(range(len(order))):
        return y
    return jnp.transpose(y, tuple(order.index(d) for d in range(len(order))))


def _natural_order(eqn: JaxprEqn, slot: int) -> tuple[int, ...]:
    """The permutation that lays a grouped product's dot_general result out as
    `etrax.grouped_matmul`'s ``([B,] G, O)``: the dot_general puts its batch axis (the
    heads) first, then the first operand's free axes, then the second's; a product
    onto every head (no batch axis) puts the data's free axis after the weight's two
    when the weight comes first."""
    (_, _), (lb, rb) = eqn.params["dimension_numbers"]
    x_batch = lb if slot == 1 else rb
    x_free = [d for d in _free_axes(eqn, slot).x_free if d not in x_batch]
    if not x_free:
        return (0, 1)
    if lb:  # (G, B, O) or (G, O, B)
        return (1, 0, 2) if slot == 1 else (2, 0, 1)
    return (0, 1, 2) if slot == 1 else (2, 0, 1)  # (B, G, O) or (G, O, B)


def _merged_heads(jaxpr: Jaxpr, uses: _Uses, eqn: JaxprEqn, slot: int) -> tuple[int, ...]:
    """The equations after a grouped product that only lay its result out as
    ``([B,] G, O)`` (a transpose, where the dot_general's order differs) and then merge
    its heads into one axis, ``reshape(..., G·O)``: the product is then one
    `etrax.grouped_matmul(..., merge_groups=True)`, whose output lines up with a flat
    state of heads. Empty when the result is read otherwise."""
    order = _natural_order(eqn, slot)
    value, chain = eqn.outvars[0], []
    if order != tuple(range(len(order))):
        j = uses.only_consumer(value)
        if j is None or jaxpr.eqns[j].primitive.name != "transpose":
            return ()
        if tuple(jaxpr.eqns[j].params["permutation"]) != order:
            return ()
        chain.append(j)
        value = jaxpr.eqns[j].outvars[0]
    j = uses.only_consumer(value)
    if j is None or jaxpr.eqns[j].primitive.name != "reshape":
        return ()
    shape = tuple(aval_of(value).shape)
    reshape = jaxpr.eqns[j]
    if reshape.params.get("dimensions") is not None or len(reshape.invars) != 1:
        return ()
    if tuple(aval_of(reshape.outvars[0]).shape) != (*shape[:-2], shape[-2] * shape[-1]):
        return ()
    return (*chain, j)


def _accumulation_dtype(eqn: JaxprEqn, x: Any, w: Any) -> Any:
    """The floating-point type a product asks to be computed in
    (``preferred_element_type``) when it is wider than its operands' (`None`
    otherwise): etrax's ops compute in their operands' type, so these are cast to it
    first instead of rounding the products to the narrower type."""
    want = eqn.params.get("preferred_element_type")
    if want is None or not jnp.issubdtype(want, jnp.floating):
        return None
    have = [jnp.dtype(jnp.result_type(a)) for a in (x, w)]
    if not all(jnp.issubdtype(d, jnp.floating) for d in have):
        return None
    if jnp.dtype(want).itemsize <= max(d.itemsize for d in have):
        return None
    return jnp.dtype(want)


def _dense_operands(eqn: JaxprEqn, slot: int, x: Any, w: Any) -> tuple[Any, Any]:
    """``(x2, W2)`` with ``x2 @ W2`` equal to the dot_general (`slot`: the weight's
    operand position): ``x2`` of shape ``(in,)`` or ``(*free data axes, in)``, ``W2``
    of ``(in, F)``.
    The contracted axes are flattened in the order the dot_general pairs them."""
    x_free, w_free, x_contract, w_contract = _free_axes(eqn, slot)
    x_shape, w_shape = jnp.shape(x), jnp.shape(w)
    n_in = int(np.prod([x_shape[d] for d in x_contract]))
    x2 = jnp.reshape(
        jnp.transpose(x, (*x_free, *x_contract)), (*[x_shape[d] for d in x_free], n_in)
    )
    w2 = jnp.reshape(
        jnp.transpose(w, (*w_contract, *w_free)), (n_in, int(np.prod([w_shape[d] for d in w_free])))
    )
    return x2, w2


def normalise(
    closed: ClosedJaxpr,
    weight_inputs: Mapping[int, Path],
    policy: CompilePolicy,
    hidden_sizes: frozenset[int] = frozenset(),
) -> tuple[ClosedJaxpr, list[CompilationRecord]]:
    """The step's jaxpr with control flow flattened and weight ops recognised.

    Two passes: control flow is flattened first (loops unrolled, branches
    if-converted, the nested calls of their bodies inlined, what nothing reads
    dropped; then each `jax.custom_vjp` call is made a `jax.custom_jvp` one,
    `custom_vjp_as_jvp`), then weight ops are recognised on the flat jaxpr, so that an op and
    what it feeds are seen together wherever they were written (a product computed
    once before a loop of sub-steps and cut into gates inside it, say). Before the
    second pass, a reshape that merges the heads of an element-wise combination of
    products is moved onto each product (`merge_heads_first`), and a product onto
    stacked gates read one gate at a time is computed one gate at a time
    (`split_products_read_head_by_head`). Last, every part cut
    out of a join along its joining axis is read from the piece it lies in
    (`fold_cuts_of_joins`), also the parts the second pass cut.

    **Arguments:**

    - `closed`: the step's (call-inlined) jaxpr.
    - `weight_inputs`: jaxpr input position → path of the ParamState it is a leaf of.
    - `policy`: what to rewrite.
    - `hidden_sizes`: every axis length of every hidden state (which ops used whole
      may be cut into fused gates, see `_plan_regions`).

    **Returns:** ``(jaxpr, records)``: the same jaxpr when nothing applies.
    """
    records: list[CompilationRecord] = []

    def live(c: ClosedJaxpr) -> ClosedJaxpr:
        kept = drop_dead_equations(c)
        note_dead_reads(c, kept, weight_inputs, records)
        return kept

    if _has_control_flow(closed.jaxpr, weight_inputs, policy):
        closed = _rewritten(closed, _Rewriter(policy, weight_inputs, records, hidden_sizes, True))
        closed = live(inline_calls(closed))  # what a loop body computes and no one reads
    # custom_vjp calls as custom_jvp ones, also those the loops above held: the
    # Jacobians are taken in forward mode, and the recognition below cuts an
    # element-wise call into parts by its rules' jaxprs
    closed = custom_vjp_as_jvp(closed)
    if policy.recognise_weight_ops:  # brainevent's products as the products they are
        closed = event_products_as_ops(closed)
        narrowed = narrow_weight_values(closed, weight_inputs)  # before they meet data
        if narrowed is not closed:
            closed = live(narrowed)  # the wide values that only the narrow ones replace
    if policy.recognise_weight_ops:  # per-head products merged into a flat state
        closed = merge_heads_first(closed, ELEMENTWISE, _is_product)
        split = split_products_read_head_by_head(closed)  # gates stacked on a leading axis
        if split is not closed:
            closed = live(split)  # the whole products that only the heads read
    if policy.recognise_weight_ops and _has_weight_ops(closed.jaxpr, weight_inputs):
        closed = _rewritten(closed, _Rewriter(policy, weight_inputs, records, hidden_sizes, False))
        closed = live(closed)  # a value cut in pieces that no one reads whole
    folded = fold_cuts_of_joins(closed)  # also the parts the pass above cut from a join
    if folded is not closed:
        closed = live(folded)  # the joins that only the cuts read
    return closed, records


_NARROWABLE = ELEMENTWISE - {"select_n", "clamp"}
"""Element-wise primitives that `narrow_weight_values` computes on narrow operands
(lax broadcasts their axes of length one; ``select_n`` and ``clamp`` want equal
shapes)."""


def narrow_weight_values(closed: ClosedJaxpr, weight_inputs: Mapping[int, Path]) -> ClosedJaxpr:
    """`closed` with each weight value that element-wise equations compute from
    broadcasts computed at its narrow shape, and broadcast once after. A weight vector
    computed on the data's whole shape (``1 / τ`` with the ``1`` broadcast to
    ``(batch, features)``, as the Jacobian that brainstate's `exp_euler_step` takes
    inside a step writes it) then meets the data as a broadcast of a ``(1, F)``
    value, which weight recognition reads along the features (`_along_features`).
    The values are the same. Returns `closed` itself when nothing is narrowed."""
    jaxpr = closed.jaxpr
    kinds, _ = _static_kinds(jaxpr, *_input_kinds(jaxpr, weight_inputs))

    def static(atom: Any) -> bool:
        return _read_kind(kinds, atom) is not _Kind.DATA

    broadcast = {
        o
        for e in jaxpr.eqns
        if e.primitive.name == "broadcast_in_dim" and static(e.invars[0])
        for o in e.outvars
    }
    if not any(
        e.primitive.name in _NARROWABLE
        and len(e.outvars) == 1
        and kinds.get(e.outvars[0]) is _Kind.WEIGHT
        and any(isinstance(a, Var) and a in broadcast for a in e.invars)
        and len(aval_of(e.outvars[0]).shape) > 1  # a vector is as narrow as it gets
        for e in jaxpr.eqns
    ):
        return closed

    narrow: dict[Any, Any] = {}  # wide value → its narrow one (same rank)

    def narrowed(i: int, eqn: JaxprEqn, env: dict[Var, Any]) -> list[Any] | None:
        invals = [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars]
        name = eqn.primitive.name
        out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
        shape = tuple(aval_of(out).shape) if out is not None else ()
        if name == "broadcast_in_dim" and static(eqn.invars[0]) and out is not None:
            small = [1] * len(shape)
            for k, d in enumerate(eqn.params["broadcast_dimensions"]):
                small[d] = int(jnp.shape(invals[0])[k])
            if tuple(small) != shape:
                with equation_context(eqn):
                    narrow[out] = jnp.reshape(invals[0], small)
        elif (
            name in _NARROWABLE
            and out is not None
            and kinds.get(out) is _Kind.WEIGHT
            and all(static(a) for a in eqn.invars)
            and any(isinstance(a, Var) and a in narrow for a in eqn.invars)
        ):
            small_in = [
                narrow[a] if isinstance(a, Var) and a in narrow else v
                for a, v in zip(eqn.invars, invals, strict=True)
            ]
            (value,) = bind_equation(eqn, small_in)
            if tuple(jnp.shape(value)) != shape and len(jnp.shape(value)) == len(shape):
                narrow[out] = value
                with equation_context(eqn):
                    return [jax.lax.broadcast_in_dim(value, shape, tuple(range(len(shape))))]
        return None  # the equation as it is

    return retraced(closed, narrowed)


def _is_product(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a per-head product (`_grouped_dims` or `_headed_dims`, with
    either operand as the weight), whose heads `merge_heads_first` may merge first. A
    plain ``x @ W`` is not: a batch flattened into its features is no flat state of
    heads, and its bias stays folded into it."""
    if eqn.primitive.name != "dot_general":
        return False
    return any(_grouped_dims(eqn, slot) or _headed_dims(eqn, slot) for slot in (0, 1))


def _input_kinds(
    jaxpr: Jaxpr, weight_inputs: Mapping[int, Path]
) -> tuple[list[_Kind], list[_Sources]]:
    n = len(jaxpr.invars)
    in_kinds = [_Kind.WEIGHT if i in weight_inputs else _Kind.DATA for i in range(n)]
    in_sources: list[_Sources] = [
        frozenset({i}) if i in weight_inputs else frozenset() for i in range(n)
    ]
    return in_kinds, in_sources


def _rewritten(closed: ClosedJaxpr, rewriter: _Rewriter) -> ClosedJaxpr:
    """`closed` evaluated through `rewriter` and traced again."""
    jaxpr = closed.jaxpr
    in_kinds, in_sources = _input_kinds(jaxpr, rewriter.names)

    def step(*args: Any) -> list[Any]:
        return rewriter.run(jaxpr, closed.consts, args, in_kinds, in_sources)

    return jax.make_jaxpr(step)(*(struct_of(v) for v in jaxpr.invars))


def _has_control_flow(
    jaxpr: Jaxpr, weight_inputs: Mapping[int, Path], policy: CompilePolicy
) -> bool:
    """Whether the flattening pass has anything to do: a branch to if-convert, a loop
    to unroll, or a loop that reads weights (to refuse, or to report kept whole)."""
    kinds, _ = _static_kinds(jaxpr, *_input_kinds(jaxpr, weight_inputs))
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "cond" and policy.if_convert:
            return True
        if name == "scan" and 0 < int(eqn.params["length"]) <= policy.unroll_limit:
            return True
        if name in ("while", "scan") and any(
            _read_kind(kinds, a) is _Kind.WEIGHT for a in eqn.invars
        ):
            return True
    return False


def _has_weight_ops(jaxpr: Jaxpr, weight_inputs: Mapping[int, Path]) -> bool:
    """Whether the recognising pass has anything to do."""
    kinds, _ = _static_kinds(jaxpr, *_input_kinds(jaxpr, weight_inputs))
    plans = _plan(jaxpr, kinds)
    absorbed = {i for p in plans.values() for i in p.absorbed}
    return bool(plans) or bool(_plan_element_wise(jaxpr, kinds, absorbed))


def note_dead_reads(
    closed: ClosedJaxpr,
    live: ClosedJaxpr,
    weights: Mapping[int, Path],
    records: list[CompilationRecord],
) -> None:
    """A warning per weight that `update` reads only into values nothing uses (dead
    code, which `drop_dead_equations` removed): nothing of it is learned."""

    def read(c: ClosedJaxpr) -> set[Any]:
        return {v for e in c.jaxpr.eqns for v in e.invars if isinstance(v, Var)}

    before, after = read(closed), read(live)
    invars = closed.jaxpr.invars
    dead = dict.fromkeys(
        p for i, p in weights.items() if invars[i] in before and invars[i] not in after
    )
    for p in dead:
        records.append(
            record(
                DiagnosticKind.STATE_MISMATCH,
                DiagnosticLevel.WARNING,
                f"ParamState {p} is read by update() only into values that nothing uses "
                "(dead code): nothing of it is learned, and its gradient is zero. Use the "
                "value, or drop the read, if that is not intended.",
                weight_path=p,
                direction="read_only_by_dead_code",
            )
        )
