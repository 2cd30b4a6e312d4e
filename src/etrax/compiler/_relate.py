"""Stage 3, `relate`: find every ETP operation, the weights it uses and the hidden
groups its output feeds.

A *relation* links one ETP equation to each hidden group its output ``y`` reaches
without crossing a boundary (see `_analysis`). For each such group it records a
*tail program* ``y → h^t`` whose Jacobian diagonal is ``df = ∂h/∂y``. Each
trainable operand is traced back to the ParamState leaves it is computed from
(the *weight program*), so ``abs(W) * mask`` or ``W1 + W2`` are handled exactly.

Every ParamState the step reads ends up traced by a relation or in a record that
says why not.
"""

import enum
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._compat import (
    DropVar,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    aval_of,
    equation_location,
    jacobian,
    struct_of,
    vary_like,
)
from .._errors import NotSupportedError, WeightNotParamStateError
from .._frozen import FrozenDict
from .._typing import Path, Shape, VarId
from ..ops import ETPOpSpec, etp_spec
from ._analysis import Analyses
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel, record
from ._extract import extract
from ._group import GroupedModule, HiddenGroup, group
from ._jaxpr import Program, VarTable, forward_closure, refuse_custom_vjp, slice_program
from ._module_info import ModuleInfo, StateKind
from ._positions import Mixed, identity_align
from ._uses import EtpStatus, ParamUse, find_uses

__all__ = [
    "FrozenParams",
    "HiddenParamOpRelation",
    "OperandFailure",
    "RelatedModule",
    "RelationTail",
    "TrainableOperand",
    "find_hidden_param_op_relations_from_minfo",
    "find_hidden_param_op_relations_from_module",
    "relate",
]


def FrozenParams(params: Mapping[str, Any]) -> FrozenDict[str, Any]:
    """The static parameters of an equation as an immutable, hashable mapping."""
    return FrozenDict(params)


class TrainableOperand(eqx.Module):
    """One trainable operand of an ETP op and the ParamState leaves it comes from.

    **Arguments:**

    - `key`: the operand's name (``'weight'``, ``'bias'``, ...).
    - `operand_index`: its position among the equation's operands.
    - `var`: its `VarId`.
    - `param_leaves`: ``(path, leaf index)`` of every ParamState leaf it is
      computed from (one entry, with the identity program, for a raw weight).
    - `program`: ``(*consts, *leaf values) -> operand``.
    - `consts`: `VarId`s of the program's constant inputs.
    - `processing`: names of the primitives between the leaves and the operand.
    """

    key: str = eqx.field(static=True)
    operand_index: int = eqx.field(static=True)
    var: VarId = eqx.field(static=True)
    param_leaves: tuple[tuple[Path, int], ...] = eqx.field(static=True)
    program: Program = eqx.field(static=True)
    consts: tuple[VarId, ...] = eqx.field(static=True)
    processing: tuple[str, ...] = eqx.field(static=True)

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys(p for p, _ in self.param_leaves))


def _run_tail(program: Program, consts: Sequence[Array], group: HiddenGroup, y: Array) -> Array:
    """``slab(h^t)`` from the op output `y`, through a relation's tail program."""
    outs = program(*consts, y)
    shapes = [
        (*group.varshape, k) if st else group.varshape
        for k, st in zip(group.num_states, group.stacked, strict=True)
    ]
    return group.concat_hidden(
        [jnp.broadcast_to(jnp.asarray(o), s) for o, s in zip(outs, shapes, strict=True)]
    )


class RelationTail(eqx.Module):
    """The map from a relation's ``y`` to one hidden group's new values.

    **Arguments:**

    - `group_index`: the hidden group.
    - `hidden_paths`: the members ``y`` actually reaches.
    - `program`: ``(*consts, y) -> member new values`` (all members, in order).
    - `consts`: `VarId`s of its constant inputs.
    - `is_diagonal`: whether ``∂h/∂y`` provably keeps positions apart; otherwise
      `mixing_reason` says why and ``df`` must be taken from the full Jacobian.
    - `broadcast_ndim`: how many leading axes of the group's varshape ``y`` lacks
      (``y`` is broadcast over them, e.g. an unbatched ``element_wise`` weight
      feeding a batched hidden state).
    """

    group_index: int = eqx.field(static=True)
    hidden_paths: tuple[Path, ...] = eqx.field(static=True)
    program: Program = eqx.field(static=True)
    consts: tuple[VarId, ...] = eqx.field(static=True)
    is_diagonal: bool = eqx.field(static=True)
    mixing_reason: str | None = eqx.field(static=True)
    broadcast_ndim: int = eqx.field(static=True)

    def tail_fn(self, consts: Sequence[Array], group: HiddenGroup) -> Any:
        """The map ``y -> slab(h^t)`` of the group with the constants bound."""
        return functools.partial(_run_tail, self.program, consts, group)

    def diagonal_jacobian(
        self, y: Array, consts: Sequence[Array], group: HiddenGroup
    ) -> Float[Array, "*varshape S"]:
        """``df[p, a] = ∂h^t[p, a] / ∂y[p']`` where ``p'`` is position ``p`` of ``y``
        (``y`` broadcast over the leading `broadcast_ndim` axes of the varshape).

        One forward-mode product with an all-ones tangent when the tail is diagonal;
        otherwise the diagonal is read from the full Jacobian (``O(P·S·|y|)`` memory).
        """
        fn = self.tail_fn(consts, group)
        if self.is_diagonal:
            _, df = jax.jvp(fn, (y,), (vary_like(jnp.ones_like(y), y),))
            return df  # type: ignore[no-any-return]
        P = int(np.prod(group.varshape, dtype=np.int64))
        PY = int(np.prod(y.shape, dtype=np.int64))
        full: Array = jacobian(fn, y).reshape(P, group.num_state, PY)
        idx = jnp.arange(P)
        return full[idx, :, idx % PY].reshape(*group.varshape, group.num_state)


class HiddenParamOpRelation(eqx.Module):
    """One ETP operation and the hidden groups its output feeds.

    **Arguments:**

    - `index`: position in `ETraceGraph.hidden_param_op_relations`.
    - `primitive`: the ETP primitive; `params` its equation parameters.
    - `eqn_index`: the equation's position in the step; `location` where it was traced.
    - `x_var` / `y_var`: `VarId`s of the data input (`None` if the op has none) and
      the output; `x_shape` / `y_shape` their shapes.
    - `trainables`: the resolved trainable operands.
    - `tails`: one `RelationTail` per connected hidden group (group order).
    - `partial_path`: ``y`` also reaches hidden state through another weight
      operation; that indirect contribution is not traced.
    - `untraced_routes`: within the step, ``y`` also influences the outputs other than
      through its tails (directly, or across a boundary); online learners then add
      the exact instantaneous gradient of those routes.
    """

    index: int = eqx.field(static=True)
    primitive: Primitive = eqx.field(static=True)
    params: FrozenDict[str, Any] = eqx.field(static=True)
    eqn_index: int = eqx.field(static=True)
    location: str = eqx.field(static=True)
    x_var: VarId | None = eqx.field(static=True)
    y_var: VarId = eqx.field(static=True)
    x_shape: Shape | None = eqx.field(static=True)
    y_shape: Shape = eqx.field(static=True)
    dtype: np.dtype[Any] = eqx.field(static=True)
    trainables: tuple[TrainableOperand, ...] = eqx.field(static=True)
    tails: tuple[RelationTail, ...] = eqx.field(static=True)
    partial_path: bool = eqx.field(static=True)
    untraced_routes: bool = eqx.field(static=True, default=False)

    @property
    def spec(self) -> ETPOpSpec:
        spec = etp_spec(self.primitive)
        assert spec is not None
        return spec

    @property
    def hidden_groups(self) -> tuple[int, ...]:
        """Indices of the connected hidden groups."""
        return tuple(t.group_index for t in self.tails)

    @property
    def connected_hidden_paths(self) -> tuple[Path, ...]:
        return tuple(p for t in self.tails for p in t.hidden_paths)

    @property
    def weight_path(self) -> Path:
        """The path of the ParamState behind the first trainable operand."""
        return self.trainables[0].param_leaves[0][0]

    @property
    def path(self) -> Path:
        return self.weight_path

    @property
    def trainable_paths(self) -> dict[str, tuple[Path, ...]]:
        return {t.key: t.paths for t in self.trainables}

    @property
    def weight_paths(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys(p for t in self.trainables for p in t.paths))

    def y_to_hidden_groups(
        self, y: Array, const_vals: Mapping[VarId, Array], groups: Sequence[HiddenGroup]
    ) -> list[Array]:
        """Evaluate each tail at ``y``; returns one group slab per connected group."""
        return [
            t.tail_fn([const_vals[c] for c in t.consts], groups[t.group_index])(y)
            for t in self.tails
        ]


class RelatedModule(eqx.Module):
    """Output of the `relate` stage."""

    module_info: ModuleInfo
    hidden_groups: tuple[HiddenGroup, ...]
    hidden_param_op_relations: tuple[HiddenParamOpRelation, ...]
    diagnostics: tuple[CompilationRecord, ...] = eqx.field(static=True)
    param_uses: tuple[ParamUse, ...] = eqx.field(static=True)
    analyses: Analyses = eqx.field(static=True)

    @property
    def hid_path_to_group(self) -> dict[Path, HiddenGroup]:
        return {p: g for g in self.hidden_groups for p in g.hidden_paths}


# ---------------------------------------------------------------------------------------


class OperandFailure(enum.Enum):
    """Why a trainable operand of an ETP op is not a function of ParamStates alone."""

    CONSTANT = "is a constant, not a brainstate.ParamState"
    DATA = "depends on the step's inputs or states"


class _Context:
    """Per-call lookups for `relate` (transient)."""

    def __init__(self, minfo: ModuleInfo, analyses: Analyses) -> None:
        self.minfo = minfo
        self.analyses = analyses
        self.an = analyses.base
        self.table: VarTable = self.an.table
        self.leaf_of: dict[Var, tuple[Path, int]] = {}
        self.data_invars: set[Var] = set()
        for s in minfo.states:
            for k, vid in enumerate(s.invars):
                v = self.table.var(vid)
                if s.kind is StateKind.WEIGHT:
                    self.leaf_of[v] = (s.path, k)
                else:
                    self.data_invars.add(v)
        for v in minfo.jaxpr.invars[: minfo.num_in]:
            self.data_invars.add(v)
        self.hidden_outvars: dict[Var, Path] = {}
        for s in minfo.hidden_states:
            if s.outvars[0] is not None:
                self.hidden_outvars.setdefault(self.table.var(s.outvars[0]), s.path)

    def ancestors(self, var: Var) -> tuple[set[Var], set[int]]:
        seen: set[Var] = {var}
        eqns: set[int] = set()
        stack = [var]
        jaxpr = self.table.jaxpr
        while stack:
            v = stack.pop()
            i = self.table.producer.get(v)
            if i is None:
                continue
            eqns.add(i)
            for a in jaxpr.eqns[i].invars:
                if isinstance(a, Var) and a not in seen:
                    seen.add(a)
                    stack.append(a)
        return seen, eqns

    def untraced_routes(self, y: Var) -> bool:
        """Whether ``y`` reaches a model output or a boundary other than through a
        new hidden value (routes through new hidden values are the groups' business)."""
        jaxpr = self.table.jaxpr
        outputs = {v for v in jaxpr.outvars[: self.minfo.num_var_out] if isinstance(v, Var)}
        seen = {y}
        stack = [y]
        while stack:
            v = stack.pop()
            if v in self.hidden_outvars:
                continue
            if v in outputs:
                return True
            for i in self.table.consumers.get(v, ()):
                if i in self.an.boundaries:
                    return True
                for out in jaxpr.eqns[i].outvars:
                    if not isinstance(out, DropVar) and out not in seen:
                        seen.add(out)
                        stack.append(out)
        return False

    def reached_hidden(self, eqn_index: int) -> set[Path]:
        """Hidden states whose new value depends on the equation's outputs (any route)."""
        outs = [v for v in self.table.jaxpr.eqns[eqn_index].outvars if not isinstance(v, DropVar)]
        reach = forward_closure(self.table, outs, lambda i: True)
        return {self.hidden_outvars[v] for v in reach if v in self.hidden_outvars}


def _resolve_operand(
    ctx: _Context, eqn: JaxprEqn, key: str, index: int
) -> tuple[TrainableOperand | None, OperandFailure | None]:
    """Trace an operand back to ParamState leaves: the operand, or why not."""
    atom = eqn.invars[index]
    if isinstance(atom, Literal):
        return None, OperandFailure.CONSTANT
    anc, eqns = ctx.ancestors(atom)
    if any(v in ctx.data_invars for v in anc):
        return None, OperandFailure.DATA
    leaves = [v for v in ctx.table.vars if v in anc and v in ctx.leaf_of]
    if not leaves:
        return None, OperandFailure.CONSTANT
    program, consts = slice_program(
        ctx.minfo.closed_jaxpr, ctx.table, leaves, [atom], lambda i: i in eqns
    )
    processing = tuple(dict.fromkeys(program.primitives))
    operand = TrainableOperand(
        key=key,
        operand_index=index,
        var=ctx.table.ids[atom],
        param_leaves=tuple(ctx.leaf_of[v] for v in leaves),
        program=program,
        consts=consts,
        processing=processing,
    )
    return operand, None


def _first_path(ctx: _Context, eqn: JaxprEqn) -> Path | None:
    spec = etp_spec(eqn.primitive)
    if spec is None:
        return None
    for _, idx in spec.trainable(eqn.params).items():
        atom = eqn.invars[idx]
        if isinstance(atom, Var):
            anc, _ = ctx.ancestors(atom)
            for v in ctx.table.vars:
                if v in anc and v in ctx.leaf_of:
                    return ctx.leaf_of[v][0]
    return None


def _trainables(
    ctx: _Context, eqn_index: int, records: list[CompilationRecord]
) -> list[TrainableOperand]:
    """The ETP op's trainable operands resolved to ParamStates (records the others)."""
    eqn = ctx.table.jaxpr.eqns[eqn_index]
    spec = etp_spec(eqn.primitive)
    assert spec is not None
    name, where = spec.name, equation_location(eqn)
    trainables: list[TrainableOperand] = []
    for n, (key, idx) in enumerate(spec.trainable(eqn.params).items()):
        operand, failure = _resolve_operand(ctx, eqn, key, idx)
        if operand is not None:
            trainables.append(operand)
            continue
        assert failure is not None
        if n == 0:
            rec = record(
                DiagnosticKind.RELATION_EXCLUDED_NO_PARAMSTATE,
                DiagnosticLevel.ERROR,
                f"The {key!r} operand of {name} at {where} {failure.value}.",
                primitive=name,
                key=key,
            )
            raise WeightNotParamStateError(
                f"The {key!r} operand of the ETP operation {name} at {where} {failure.value}. "
                "ETP operations trace trainable weights: store the weight in a "
                "brainstate.ParamState (e.g. etrax.nn.Linear), or use plain jax.numpy for "
                "fixed or data-dependent matrices.",
                [*records, rec],
            )
        data = failure is OperandFailure.DATA
        records.append(
            record(
                DiagnosticKind.WEIGHT_OPERAND_NOT_STATIC
                if data
                else DiagnosticKind.TRAINABLE_INVAR_NOT_PARAMSTATE,
                DiagnosticLevel.WARNING if data else DiagnosticLevel.INFO,
                f"The {key!r} operand of {name} at {where} {failure.value}, so it is not "
                "traced; the ParamStates it reads learn from their instantaneous gradient "
                "and its other operands are still traced."
                if data
                else f"The {key!r} operand of {name} at {where} is a constant; only the other "
                "operands are trained.",
                primitive=name,
                key=key,
            )
        )
    return trainables


def _reached_groups(
    ctx: _Context, src: int, groups: Sequence[HiddenGroup]
) -> dict[int, list[tuple[Path, Any]]]:
    """Group index → [(member path, alignment of y there)] for the groups `src` reaches,
    each seen through its own analysis (routes through linked groups are cut)."""
    reached: dict[int, list[tuple[Path, Any]]] = {}
    by_path = {s.path: s for s in ctx.minfo.hidden_states}
    for g in groups:
        an = ctx.analyses.for_group(g.index)
        for p in g.hidden_paths:
            out = by_path[p].outvars[0]
            if out is None:
                continue
            a = an.maps.get(an.table.var(out), {}).get(src)
            if a is not None:
                reached.setdefault(g.index, []).append((p, a))
    return reached


class _Op:
    """The facts about one ETP equation that its relation and records need."""

    def __init__(self, ctx: _Context, eqn_index: int, trainables: list[TrainableOperand]):
        eqn = ctx.table.jaxpr.eqns[eqn_index]
        spec = etp_spec(eqn.primitive)
        assert spec is not None
        self.index = eqn_index
        self.eqn = eqn
        self.spec = spec
        self.name = spec.name
        self.where = equation_location(eqn)
        self.trainables = trainables
        self.weight_path = trainables[0].param_leaves[0][0]
        self.weight_paths = tuple(dict.fromkeys(p for t in trainables for p in t.paths))
        self.src = ctx.an.y_sources[eqn_index]
        self.y = eqn.outvars[0]
        self.y_shape: Shape = tuple(aval_of(self.y).shape)


def _tail(
    ctx: _Context, op: _Op, g: HiddenGroup, members: list[tuple[Path, Any]]
) -> tuple[RelationTail | None, CompilationRecord | None]:
    """The tail ``y → group`` or the record of why it cannot be traced."""
    V = g.varshape
    offset = len(V) - len(op.y_shape)
    member_paths = tuple(p for p, _ in members)
    # y may also have leading axes of size 1 that the group lacks (an unbatched
    # brainstate layer adds a batch axis of 1 around its op and drops it after)
    squeezed = offset < 0 and set(op.y_shape[:-offset]) == {1} and op.y_shape[-offset:] == V
    if not squeezed and (offset < 0 or tuple(V[offset:]) != op.y_shape):
        part = (
            len(op.y_shape) == len(V) > 0
            and op.y_shape[:-1] == tuple(V[:-1])
            and op.y_shape[-1] < V[-1]
        )
        wider = (
            len(op.y_shape) == len(V) > 0
            and op.y_shape[:-1] == tuple(V[:-1])
            and op.y_shape[-1] > V[-1]
        )
        reshaped = math.prod(op.y_shape) == math.prod(V) and len(op.y_shape) != len(V)
        hint = (
            " y holds as many positions as the group, in another shape, as when a "
            "product's heads are merged into one axis after an operation that is not "
            "element-wise (a norm per head, say): keep the hidden state in the products' "
            f"shape ({op.y_shape} with heads), or merge each product's heads before it "
            "(einsum('...gi,gio->...go', h.reshape(..., G, N), U).reshape(..., G * N)), "
            "to trace it."
            if reshaped
            else " y fills only part of the group's last axis, as when the states of two "
            "populations are concatenated into one: keep each part in a HiddenState of its "
            "own to trace it."
            if part
            else " y is wider than the group's last axis, as when fused gates are cut after "
            "a function that is not evaluated part by part (a sum or norm over the "
            "features, a jax.custom_vjp call, a jax.custom_jvp call that mixes the features "
            "or holds a constant per feature): cut the gates before it, or compute each "
            "gate with a product of its own, to trace them."
            if wider
            else ""
        )
        return None, record(
            DiagnosticKind.RELATION_EXCLUDED_SHAPE_MISMATCH,
            DiagnosticLevel.WARNING,
            f"{op.name} at {op.where} produces y of shape {op.y_shape}, which does not line up "
            f"with the positions {V} of group {g.index} {list(g.hidden_paths)}; this "
            f"connection is not traced (its weights get its exact instantaneous gradient).{hint}",
            primitive=op.name,
            weight_path=op.weight_path,
            hidden_paths=member_paths,
            y_shape=op.y_shape,
            hidden_shape=V,
            weight_paths=op.weight_paths,
        )
    expected = tuple(offset + k for k in identity_align(op.y_shape))
    reason: str | None = None
    for _, a in members:
        if isinstance(a, Mixed):
            reason = reason or a.reason
        elif a != expected:
            reason = reason or "y reaches the hidden state at other positions"
    an = ctx.analyses.for_group(g.index)
    outputs = [ctx.minfo.state_out_atoms(p)[0] for p in g.hidden_paths]
    program, consts = slice_program(
        ctx.minfo.closed_jaxpr, ctx.table, [op.y], outputs, an.slice_filter({op.src})
    )
    refuse_custom_vjp(program, f"tail from a weight operation to hidden group {g.index}")
    tail = RelationTail(
        group_index=g.index,
        hidden_paths=member_paths,
        program=program,
        consts=consts,
        is_diagonal=reason is None,
        mixing_reason=reason,
        broadcast_ndim=max(offset, 0),
    )
    if reason is None:
        return tail, None
    return tail, record(
        DiagnosticKind.TAIL_MIXES_POSITIONS,
        DiagnosticLevel.WARNING,
        f"The path from {op.name} at {op.where} to group {g.index} mixes positions "
        f"({reason}); df is taken from the full Jacobian's diagonal and the cross-position "
        "part is learned from its instantaneous gradient only (approximate over time).",
        primitive=op.name,
        weight_path=op.weight_path,
        hidden_paths=member_paths,
        reason=reason,
    )


def _blocking(ctx: _Context, op: _Op, connected: set[Path]) -> list[int]:
    """Boundary equations downstream of y that lead to hidden state (into the
    connected groups when there are any). A `stop_gradient` is not one: no derivative
    passes it, so there is no contribution beyond it to learn."""
    an = ctx.an
    jaxpr = ctx.table.jaxpr
    blocking = sorted(
        i
        for i in an.boundaries
        if jaxpr.eqns[i].primitive.name != "stop_gradient"
        and any(an.derived_from(v, {op.src}) for v in jaxpr.eqns[i].invars)
    )
    if connected:
        return [i for i in blocking if ctx.reached_hidden(i) & connected]
    return [i for i in blocking if ctx.reached_hidden(i)]


def _blocking_facts(ctx: _Context, blocking: list[int]) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    """The primitives of the blocking equations and the weights they use."""
    eqns = [ctx.table.jaxpr.eqns[i] for i in blocking]
    prims = tuple(str(e.primitive.name) for e in eqns)
    paths = tuple(p for p in (_first_path(ctx, e) for e in eqns) if p is not None)
    return prims, paths


def _excluded_record(
    ctx: _Context, op: _Op, blocking: list[int], grouped: set[Path]
) -> CompilationRecord:
    """The record of an ETP op that forms no relation."""
    jaxpr = ctx.table.jaxpr
    prims, paths = _blocking_facts(ctx, blocking)
    common: dict[str, Any] = {
        "primitive": op.name,
        "weight_path": op.weight_path,
        "weight_paths": op.weight_paths,
    }
    head = f"{op.name} at {op.where} (weight {op.weight_path})"
    tail = "it is not traced through time and learns from its exact instantaneous gradient."
    if any(etp_spec(jaxpr.eqns[i].primitive) is not None for i in blocking):
        return record(
            DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT,
            DiagnosticLevel.WARNING,
            f"{head} reaches hidden states only through other weight operations "
            f"{list(paths)}; {tail}",
            blocking_primitives=prims,
            blocking_weight_paths=paths,
            **common,
        )
    if blocking:
        return record(
            DiagnosticKind.RELATION_EXCLUDED_MIXING,
            DiagnosticLevel.WARNING,
            f"{head} reaches hidden states only through position-mixing operations "
            f"{list(prims)}; {tail}",
            blocking_primitives=prims,
            **common,
        )
    carried = _carried_reached(ctx, op, grouped)
    if carried:
        return record(
            DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL,
            DiagnosticLevel.INFO,
            f"{head} reaches no traced hidden state, but it reaches {list(carried)}, which "
            "are carried across steps without a trace (see their other records, e.g. "
            f"carried_state_route or hidden_state_not_float); {tail}",
            carried_paths=carried,
            **common,
        )
    return record(
        DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL,
        DiagnosticLevel.INFO,
        f"{head} reaches no hidden state: it is a non-temporal weight (e.g. a readout) "
        "and learns from its exact instantaneous gradient.",
        **common,
    )


def _carried_reached(ctx: _Context, op: _Op, grouped: set[Path]) -> tuple[Path, ...]:
    """The states outside every hidden group (a complex hidden state, a short-term
    state) that the step reads and whose new value depends on the op's output: the
    op's effect is carried to the next step without a trace."""
    reach = forward_closure(ctx.table, [op.y], lambda i: True)
    return tuple(
        s.path
        for s in ctx.minfo.states
        if s.kind is not StateKind.WEIGHT
        and s.path not in grouped
        and any(ctx.table.consumers.get(ctx.table.var(v)) for v in s.invars)
        and any(isinstance(a, Var) and a in reach for a in ctx.minfo.state_out_atoms(s.path))
    )


def _relation(
    ctx: _Context, op: _Op, groups: Sequence[HiddenGroup], index: int
) -> tuple[HiddenParamOpRelation | None, list[CompilationRecord], EtpStatus]:
    """The relation of one ETP op (or `None`), its records and its status for uses."""
    records: list[CompilationRecord] = []
    tails: list[RelationTail] = []
    reasons: list[DiagnosticKind] = []
    for gi, members in sorted(_reached_groups(ctx, op.src, groups).items()):
        tail, rec = _tail(ctx, op, groups[gi], members)
        if tail is not None:
            tails.append(tail)
        if rec is not None:
            records.append(rec)
            reasons.append(rec.kind)
    slots = frozenset(t.operand_index for t in op.trainables)
    unsupported = _untraceable(ctx, op) if tails else None
    if unsupported is not None:
        records.append(
            record(
                DiagnosticKind.RELATION_EXCLUDED_UNSUPPORTED,
                DiagnosticLevel.WARNING,
                f"{op.name} at {op.where} (weight {op.weight_path}) reaches hidden states, but "
                f"the online rules cannot trace it: {unsupported} It is not traced through "
                "time and learns from its exact instantaneous gradient.",
                primitive=op.name,
                weight_path=op.weight_path,
                weight_paths=op.weight_paths,
            )
        )
        return None, records, EtpStatus(None, True, records[-1].kind, slots)
    connected = {p for t in tails for p in groups[t.group_index].hidden_paths}
    blocking = _blocking(ctx, op, connected)
    if not tails:
        if not reasons:
            grouped = {p for g in groups for p in g.hidden_paths}
            records.append(_excluded_record(ctx, op, blocking, grouped))
            reasons.append(records[-1].kind)
        return None, records, EtpStatus(None, True, reasons[0], slots)
    if blocking:
        prims, paths = _blocking_facts(ctx, blocking)
        records.append(
            record(
                DiagnosticKind.RELATION_PARTIAL_PATH,
                DiagnosticLevel.WARNING,
                f"{op.name} at {op.where} (weight {op.weight_path}) also reaches hidden states "
                f"through {list(prims)} {list(paths)}; that indirect contribution is learned "
                "from its exact instantaneous gradient, not traced through time.",
                primitive=op.name,
                weight_path=op.weight_path,
                hidden_paths=tuple(connected),
                blocking_primitives=prims,
                blocking_weight_paths=paths,
            )
        )
        reasons.append(DiagnosticKind.RELATION_PARTIAL_PATH)
    if ctx.untraced_routes(op.y):
        records.append(
            record(
                DiagnosticKind.RELATION_UNTRACED_ROUTE,
                DiagnosticLevel.INFO,
                f"{op.name} at {op.where} (weight {op.weight_path}) also reaches the step's "
                "outputs or other weight operations other than through the hidden states it "
                "traces; those routes contribute their exact instantaneous gradient.",
                primitive=op.name,
                weight_path=op.weight_path,
                weight_paths=op.weight_paths,
            )
        )
        reasons.append(DiagnosticKind.RELATION_UNTRACED_ROUTE)
    relation = _make_relation(ctx, op, tails, index, bool(blocking), bool(reasons))
    records.insert(0, _included_record(op, relation))
    status = EtpStatus(index, bool(reasons), reasons[0] if reasons else None, slots)
    return relation, records, status


def _untraceable(ctx: _Context, op: _Op) -> str | None:
    """Why the online rules cannot trace `op`, if they cannot: it has no `ETPRules`,
    its data, output or weights are complex, or its rules refuse its parameters (a
    grouped convolution, an output layout they do not handle) with a
    `NotSupportedError`."""
    rules = op.spec.rules
    if rules is None:
        return (
            f"the ETP primitive {op.name} has no ETPRules (register them with "
            "etrax.register_rules)."
        )
    x_index = op.spec.x_index
    x = None if x_index is None else struct_of(op.eqn.invars[x_index])
    weights = {t.key: struct_of(op.eqn.invars[t.operand_index]) for t in op.trainables}
    complex_values = [
        name
        for name, v in (("x", x), ("y", struct_of(op.y)), *weights.items())
        if v is not None and jnp.issubdtype(v.dtype, jnp.complexfloating)
    ]
    if complex_values:
        return (
            f"its {', '.join(complex_values)} {'is' if len(complex_values) == 1 else 'are'} "
            "complex, and the traces are real (a trace would keep only the real part of the "
            "gradient)."
        )
    try:
        rules.param_trace_shapes(x, struct_of(op.y), weights, op.eqn.params)
    except NotSupportedError as err:
        return str(err)
    return None


def _make_relation(
    ctx: _Context,
    op: _Op,
    tails: list[RelationTail],
    index: int,
    partial: bool,
    untraced: bool,
) -> HiddenParamOpRelation:
    x_index = op.spec.x_index
    x_var: VarId | None = None
    x_shape: Shape | None = None
    if x_index is not None:
        x_atom = op.eqn.invars[x_index]
        x_shape = tuple(aval_of(x_atom).shape)
        x_var = ctx.table.id_of(x_atom)
        if x_var is None:
            raise WeightNotParamStateError(  # pragma: no cover - literal x is scalar
                f"{op.name} at {op.where} has a literal data input; pass an array."
            )
    return HiddenParamOpRelation(
        index=index,
        primitive=op.eqn.primitive,
        params=FrozenParams(op.eqn.params),
        eqn_index=op.index,
        location=op.where,
        x_var=x_var,
        y_var=ctx.table.ids[op.y],
        x_shape=x_shape,
        y_shape=op.y_shape,
        dtype=np.dtype(aval_of(op.y).dtype),
        trainables=tuple(op.trainables),
        tails=tuple(tails),
        partial_path=partial,
        untraced_routes=untraced,
    )


def _included_record(op: _Op, relation: HiddenParamOpRelation) -> CompilationRecord:
    return record(
        DiagnosticKind.RELATION_INCLUDED,
        DiagnosticLevel.INFO,
        f"{op.name} at {op.where} (weight {op.weight_path}) is traced into hidden group(s) "
        f"{list(relation.hidden_groups)}.",
        primitive=op.name,
        weight_path=op.weight_path,
        hidden_paths=relation.connected_hidden_paths,
        hidden_group_indices=relation.hidden_groups,
        weight_paths=op.weight_paths,
    )


def relate(grouped: GroupedModule) -> RelatedModule:
    """Find every relation between ETP operations and hidden groups, and every use of
    every parameter with its rule (stage 3)."""
    minfo = grouped.module_info
    groups = grouped.hidden_groups
    ctx = _Context(minfo, grouped.analyses)
    records: list[CompilationRecord] = list(grouped.diagnostics)
    relations: list[HiddenParamOpRelation] = []
    status: dict[int, EtpStatus] = {}
    for eqn_index in ctx.an.etp_equations:
        op = _Op(ctx, eqn_index, _trainables(ctx, eqn_index, records))
        relation, recs, status[eqn_index] = _relation(ctx, op, groups, len(relations))
        records.extend(recs)
        if relation is not None:
            relations.append(relation)
    uses = find_uses(minfo, ctx.table, status)
    records.extend(_plain_use_records(uses))
    records.extend(_unread_group_records(ctx, groups, relations))
    records.extend(_later_route_records(ctx, groups, relations))
    return RelatedModule(
        module_info=minfo,
        hidden_groups=groups,
        hidden_param_op_relations=tuple(relations),
        diagnostics=tuple(records),
        param_uses=uses,
        analyses=grouped.analyses,
    )


def _differentiable_ancestors(ctx: _Context, outputs: Sequence[Var], stop: set[Var]) -> set[Var]:
    """The float values whose derivative can reach `outputs` within the step: back
    through every equation but ``stop_gradient`` and those with non-float results
    (comparisons, integer arithmetic); a value in `stop` is reached but not passed."""
    jaxpr = ctx.table.jaxpr
    seen = set(outputs)
    stack = list(outputs)
    while stack:
        v = stack.pop()
        i = ctx.table.producer.get(v)
        if i is None or v in stop:
            continue
        eqn = jaxpr.eqns[i]
        if eqn.primitive.name == "stop_gradient":
            continue
        for a in eqn.invars:
            if isinstance(a, Var) and a not in seen and _is_float(a):
                seen.add(a)
                stack.append(a)
    return seen


def _is_float(v: Var) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def _unread_group_records(
    ctx: _Context, groups: Sequence[HiddenGroup], relations: Sequence[HiddenParamOpRelation]
) -> list[CompilationRecord]:
    """A warning per hidden group with traced weights whose values reach the step's
    outputs only in later steps (through another group's old values, a weight
    between steps, or a carried state such as a delay buffer): neither its new values
    nor its old ones (the direct route, also through another group's new value computed
    from them) reach this step's outputs, so its learning signal is zero at every step
    and its traces never turn into gradient."""
    jaxpr = ctx.table.jaxpr
    outputs = [v for v in jaxpr.outvars[: ctx.minfo.num_var_out] if isinstance(v, Var)]
    outputs = [v for v in outputs if _is_float(v)]
    now = _differentiable_ancestors(ctx, outputs, set())
    direct = _differentiable_ancestors(ctx, outputs, set(ctx.hidden_outvars))
    # a group's new value on a direct route (a leaky readout returned as the output, a
    # second layer read out through a weight) reads the old values of other groups in
    # its own computation within the step (`perturb`'s `through` routes)
    group_of_new = {
        ctx.table.var(v): g.index for g in groups for v in g.hidden_outvars if v is not None
    }
    through: dict[int, set[Var]] = {}
    for v in direct:
        if v in group_of_new:
            stop = set(ctx.hidden_outvars) - {v}
            through.setdefault(group_of_new[v], set()).update(
                _differentiable_ancestors(ctx, [v], stop)
            )
    out: list[CompilationRecord] = []
    for g in groups:
        traced = [r for r in relations if g.index in r.hidden_groups]
        weights = tuple(dict.fromkeys(p for r in traced for p in r.weight_paths))
        if not weights:
            continue
        states = [s for s in ctx.minfo.hidden_states if s.path in g.hidden_paths]
        read_now = any(
            s.outvars[0] is not None and ctx.table.var(s.outvars[0]) in now for s in states
        )
        read_before = any(ctx.table.var(s.invars[0]) in direct for s in states)
        read_through = any(
            ctx.table.var(s.invars[0]) in reached
            for h, reached in through.items()
            if h != g.index
            for s in states
        )
        if read_now or read_before or read_through:
            continue
        out.append(
            record(
                DiagnosticKind.HIDDEN_GROUP_NOT_READ,
                DiagnosticLevel.WARNING,
                f"hidden group {g.index} ({list(g.hidden_paths)}) does not reach the step's "
                "outputs in the step that computes it: its values reach them only in later "
                "steps (through another group, a weight between steps, or a carried state "
                "such as a delay buffer). Its learning signal dL_t/dh_t is zero at every "
                f"step, so the online rules give the weights traced into it ({list(weights)}) "
                "no gradient from their traces (only their instantaneous terms, if any). "
                "Read the group's values in the step's outputs, or train with "
                "online_grad(..., window=k) (exact over k steps) or BPTT.",
                weight_path=weights[0],
                hidden_paths=g.hidden_paths,
                hidden_group_indices=(g.index,),
                weight_paths=weights,
            )
        )
    return out


def _later_route_records(
    ctx: _Context, groups: Sequence[HiddenGroup], relations: Sequence[HiddenParamOpRelation]
) -> list[CompilationRecord]:
    """The routes from one step to later ones that no trace follows:

    - a state that is not a HiddenState (a ``ShortTermState`` holding the previous
      output, a delay buffer) written from values that weights or hidden states
      reach, and read again by a step whose hidden states or outputs its old value
      reaches (a warning: no online rule carries anything through it);
    - a hidden group whose new values reach another group's within the step (a stack
      of layers), where that group's memory carries them on (information: the
      weights traced into the first group miss those later terms, the standard
      approximation of the diagonal rules for stacked layers).
    """
    jaxpr = ctx.table.jaxpr
    var = ctx.table.var
    ends = [v for v in jaxpr.outvars[: ctx.minfo.num_var_out] if isinstance(v, Var)]
    ends += list(ctx.hidden_outvars)
    read = _differentiable_ancestors(ctx, [v for v in ends if _is_float(v)], set())
    member = {var(v): g.index for g in groups for v in g.hidden_invars}
    member.update({var(v): g.index for g in groups for v in g.hidden_outvars if v is not None})
    traced_into = {
        g.index: tuple(dict.fromkeys(p for r in relations if g.index in r.hidden_groups
                                     for p in r.weight_paths))
        for g in groups
    }  # fmt: skip
    out: list[CompilationRecord] = []
    for s in ctx.minfo.other_states:
        news = [var(v) for v in s.outvars if v is not None]
        olds = [var(v) for v in s.invars]
        news = [v for v in news if _is_float(v) and v not in olds]
        if not s.written or not news or not any(v in read for v in olds):
            continue
        up = _differentiable_ancestors(ctx, news, set())
        via = sorted({member[v] for v in up if v in member})
        weights = tuple(
            dict.fromkeys(
                [ctx.leaf_of[v][0] for v in up if v in ctx.leaf_of]
                + [p for g in via for p in traced_into[g]]
            )
        )
        if not weights:
            continue
        out.append(
            record(
                DiagnosticKind.CARRIED_STATE_ROUTE,
                DiagnosticLevel.WARNING,
                f"{s.type_name} {s.path} is not a HiddenState, but it carries values that "
                f"weights {list(weights)} influence"
                + (f" (through hidden groups {via})" if via else "")
                + " to the next step, whose hidden states or outputs read it. No online rule "
                "follows this route through time, so their gradients miss its later-step "
                "terms (exact at T = 1). Make it a brainstate.HiddenState to trace it, or "
                "train with online_grad(..., window=k) (exact over k steps) or BPTT.",
                weight_path=weights[0],
                hidden_paths=(s.path,),
                weight_paths=weights,
                hidden_group_indices=tuple(via),
            )
        )
    out.extend(_recurrent_weight_records(ctx, groups, traced_into))
    for g in groups:
        if not traced_into[g.index]:
            continue
        starts = [var(v) for v in g.hidden_outvars if v is not None]
        reached: set[int] = set()
        for h in groups:
            if h.index == g.index:
                continue
            ends = [var(v) for v in h.hidden_outvars if v is not None and _is_float(var(v))]
            carried = any(var(v) in read for v in h.hidden_invars)
            if ends and carried and set(starts) & _differentiable_ancestors(ctx, ends, set()):
                reached.add(h.index)
        if not reached:
            continue
        out.append(
            record(
                DiagnosticKind.CROSS_GROUP_ROUTE,
                DiagnosticLevel.INFO,
                f"hidden group {g.index} ({list(g.hidden_paths)}) feeds hidden groups "
                f"{sorted(reached)} within the step, and their own memory carries that "
                "influence to later steps, which the traces of the weights traced into group "
                f"{g.index} ({list(traced_into[g.index])}) do not follow: for them D-RTRL is "
                "the diagonal approximation of stacked layers (each layer's learning signal "
                "is its instantaneous one). online_grad(..., window=k) is exact over k steps.",
                weight_path=traced_into[g.index][0],
                hidden_paths=g.hidden_paths,
                weight_paths=traced_into[g.index],
                hidden_group_indices=(g.index, *sorted(reached)),
            )
        )
    return out


def _recurrent_weight_records(
    ctx: _Context, groups: Sequence[HiddenGroup], traced_into: Mapping[int, tuple[Path, ...]]
) -> list[CompilationRecord]:
    """Information per hidden group with traced weights whose *previous* values a weight
    operation reads as data (a recurrent weight: a vanilla RNN's ``U h``, a GRU's gates
    on ``[x, h]``) when that operation's output reaches a group's new values: `D` holds
    only the element-wise part of the transition, so the traces of the weights traced
    into the group miss the route through the weight (D-RTRL's diagonal approximation;
    exact at T = 1). Data that read the group only through its new values (a stack of
    layers) are `CROSS_GROUP_ROUTE`'s business, not this record's."""
    var = ctx.table.var
    jaxpr = ctx.table.jaxpr
    new = {var(v) for g in groups for v in g.hidden_outvars if v is not None}
    ends = [v for v in new if _is_float(v)]
    into_hidden = _differentiable_ancestors(ctx, ends, set()) if ends else set()
    # the groups whose previous values each float value depends on, differentiably and
    # not through a group's new values (one forward pass, in equation order)
    reads: dict[Var, frozenset[int]] = {
        var(v): frozenset({g.index}) for g in groups for v in g.hidden_invars
    }
    etp = set(ctx.an.etp_equations)
    found: dict[int, list[str]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if i in etp and any(y in into_hidden for y in eqn.outvars if not isinstance(y, DropVar)):
            spec = etp_spec(eqn.primitive)
            x = None if spec is None or spec.x_index is None else eqn.invars[spec.x_index]
            for g in sorted(reads.get(x, ())) if isinstance(x, Var) else ():
                if traced_into.get(g):
                    found.setdefault(g, []).append(equation_location(eqn))
        if eqn.primitive.name == "stop_gradient":
            continue
        sources = [reads[a] for a in eqn.invars if isinstance(a, Var) and a in reads]
        if sources:
            union = frozenset().union(*sources)
            for y in eqn.outvars:
                if not isinstance(y, DropVar) and _is_float(y) and y not in new:
                    reads[y] = union
    return [
        record(
            DiagnosticKind.RECURRENT_WEIGHT_ROUTE,
            DiagnosticLevel.INFO,
            f"hidden group {g} ({list(groups[g].hidden_paths)}) is read at its previous "
            f"values by the weight operation(s) at {list(dict.fromkeys(where))}, whose output "
            "reaches the new hidden values: a recurrent weight. D holds only the element-wise "
            "part of the transition, so the traces of the weights traced into group "
            f"{g} ({list(traced_into[g])}) miss the route through that weight: for them "
            "D-RTRL is the diagonal approximation (exact at T = 1). OSTLRecurrent, SnAp or "
            "UORO follow more of the transition; online_grad(..., window=k) is exact over "
            "k steps.",
            weight_path=traced_into[g][0],
            hidden_paths=groups[g].hidden_paths,
            weight_paths=traced_into[g],
            hidden_group_indices=(g,),
        )
        for g, where in found.items()
    ]


def _plain_use_records(uses: Sequence[ParamUse]) -> list[CompilationRecord]:
    """One record per ParamState read by plain JAX operations (its first such use)."""
    first: dict[Path, ParamUse] = {}
    for u in uses:
        if u.reason in (DiagnosticKind.WEIGHT_PLAIN_USE, DiagnosticKind.WEIGHT_OPERAND_NOT_STATIC):
            for p in u.paths:
                first.setdefault(p, u)
    return [
        record(
            DiagnosticKind.WEIGHT_PLAIN_USE,
            DiagnosticLevel.WARNING,
            f"ParamState {p} is used by the plain JAX operation '{u.primitive}' at "
            f"{u.location}; that use is not traced through time, so the weight learns from "
            "its exact instantaneous gradient there. Use an ETP op (etrax.matmul, "
            "etrax.nn.Linear, ...) to trace it.",
            primitive=u.primitive,
            weight_path=p,
        )
        for p, u in first.items()
    ]


def find_hidden_param_op_relations_from_minfo(
    minfo: ModuleInfo,
) -> tuple[HiddenParamOpRelation, ...]:
    """The relations of a traced step (runs `group` then `relate`)."""
    return relate(group(minfo)).hidden_param_op_relations


def find_hidden_param_op_relations_from_module(
    model: Any, *args: Any
) -> tuple[HiddenParamOpRelation, ...]:
    """Trace `model` on `args` and return its relations."""
    return find_hidden_param_op_relations_from_minfo(extract(model, *args))
