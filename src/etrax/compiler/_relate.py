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

from collections.abc import Callable, Mapping, Sequence
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
    vary_like,
)
from .._errors import WeightNotParamStateError
from .._frozen import FrozenDict
from .._typing import Path, Shape, VarId
from ..ops import ETPOpSpec, etp_spec
from ._analysis import StepAnalysis, analyse_step
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel, record
from ._group import GroupedModule, HiddenGroup, group
from ._jaxpr import Program, VarTable, forward_closure, slice_program
from ._module_info import ModuleInfo, StateKind, extract
from ._positions import Mixed, identity_align

__all__ = [
    "FrozenParams",
    "HiddenParamOpRelation",
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

        def fn(y: Array) -> Array:
            outs = self.program(*consts, y)
            shapes = [
                (*group.varshape, k) if st else group.varshape
                for k, st in zip(group.num_states, group.stacked, strict=True)
            ]
            return group.concat_hidden(
                [jnp.broadcast_to(jnp.asarray(o), s) for o, s in zip(outs, shapes, strict=True)]
            )

        return fn

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
        full: Array = jax.jacfwd(fn)(y).reshape(P, group.num_state, PY)
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

    @property
    def hid_path_to_group(self) -> dict[Path, HiddenGroup]:
        return {p: g for g in self.hidden_groups for p in g.hidden_paths}


# ---------------------------------------------------------------------------------------


class _Context:
    """Per-call lookups for `relate` (transient)."""

    def __init__(self, minfo: ModuleInfo, an: StepAnalysis) -> None:
        self.minfo = minfo
        self.an = an
        self.table: VarTable = an.table
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

    def untraced_routes(self, y: Var, src: int) -> bool:
        """Whether ``y`` reaches a model output or a boundary other than through a
        hidden state's new value."""
        jaxpr = self.table.jaxpr
        outputs = {v for v in jaxpr.outvars[: self.minfo.num_var_out] if isinstance(v, Var)}
        seen = {y}
        stack = [y]
        while stack:
            v = stack.pop()
            if v in self.hidden_outvars:
                continue  # routes through a new hidden value are traced
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
) -> tuple[TrainableOperand | None, str | None, set[int]]:
    """Trace an operand back to ParamState leaves; returns (operand, failure, eqns)."""
    atom = eqn.invars[index]
    if isinstance(atom, Literal):
        return None, "constant", set()
    anc, eqns = ctx.ancestors(atom)
    if any(v in ctx.data_invars for v in anc):
        return None, "data", eqns
    leaves = [v for v in ctx.table.vars if v in anc and v in ctx.leaf_of]
    if not leaves:
        return None, "constant", eqns
    program, consts = slice_program(
        ctx.minfo.closed_jaxpr, ctx.table, leaves, [atom], lambda i: i in eqns
    )
    processing = tuple(dict.fromkeys(program.primitives))
    return (
        TrainableOperand(
            key=key,
            operand_index=index,
            var=ctx.table.ids[atom],
            param_leaves=tuple(ctx.leaf_of[v] for v in leaves),
            program=program,
            consts=consts,
            processing=processing,
        ),
        None,
        eqns,
    )


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


def _hidden_targets(
    ctx: _Context, src: int, groups: Sequence[HiddenGroup]
) -> dict[int, list[tuple[Path, Any]]]:
    """Group index → [(member path, alignment of y at that member)] reached by `src`."""
    hid_to_group = {p: g.index for g in groups for p in g.hidden_paths}
    reached: dict[int, list[tuple[Path, Any]]] = {}
    for s in ctx.minfo.hidden_states:
        if s.outvars[0] is None:
            continue
        a = ctx.an.maps.get(ctx.table.var(s.outvars[0]), {}).get(src)
        if a is not None:
            reached.setdefault(hid_to_group[s.path], []).append((s.path, a))
    return dict(sorted(reached.items()))


def _tail_filter(an: StepAnalysis, src: int) -> Callable[[int], bool]:
    def keep(i: int) -> bool:
        return i not in an.boundaries and an.equation_derives(i, {src})

    return keep


def relate(grouped: GroupedModule) -> RelatedModule:
    """Find every relation between ETP operations and hidden groups (stage 3)."""
    minfo = grouped.module_info
    groups = grouped.hidden_groups
    an = analyse_step(minfo)
    ctx = _Context(minfo, an)
    table = ctx.table
    jaxpr = minfo.jaxpr
    records: list[CompilationRecord] = list(grouped.diagnostics)
    relations: list[HiddenParamOpRelation] = []
    operand_eqns: set[int] = set()
    operand_slots: set[tuple[int, int]] = set()

    for eqn_index in an.etp_equations:
        eqn = jaxpr.eqns[eqn_index]
        spec = etp_spec(eqn.primitive)
        assert spec is not None
        name = spec.name
        where = equation_location(eqn)
        keys = dict(spec.trainable(eqn.params))
        trainables: list[TrainableOperand] = []
        for n, (key, idx) in enumerate(keys.items()):
            operand, failure, eqns = _resolve_operand(ctx, eqn, key, idx)
            if operand is not None:
                trainables.append(operand)
                operand_eqns.update(eqns)
                operand_slots.add((eqn_index, idx))
                continue
            if n == 0:
                what = (
                    "depends on the step's inputs or states"
                    if failure == "data"
                    else "is a constant, not a brainstate.ParamState"
                )
                rec = record(
                    DiagnosticKind.RELATION_EXCLUDED_NO_PARAMSTATE,
                    DiagnosticLevel.ERROR,
                    f"The {key!r} operand of {name} at {where} {what}.",
                    primitive=name,
                    key=key,
                )
                raise WeightNotParamStateError(
                    f"The {key!r} operand of the ETP operation {name} at {where} {what}. "
                    "ETP operations trace trainable weights: store the weight in a "
                    "brainstate.ParamState (e.g. etrax.nn.Linear), or use plain jax.numpy for "
                    "fixed or data-dependent matrices.",
                    [*records, rec],
                )
            if failure == "data":
                records.append(
                    record(
                        DiagnosticKind.WEIGHT_OPERAND_NOT_STATIC,
                        DiagnosticLevel.WARNING,
                        f"The {key!r} operand of {name} at {where} depends on the step's inputs "
                        "or states, so it is not traced; its other operands still are.",
                        primitive=name,
                        key=key,
                    )
                )
            else:
                records.append(
                    record(
                        DiagnosticKind.TRAINABLE_INVAR_NOT_PARAMSTATE,
                        DiagnosticLevel.INFO,
                        f"The {key!r} operand of {name} at {where} is a constant; only the other "
                        "operands are trained.",
                        primitive=name,
                        key=key,
                    )
                )
        weight_path = trainables[0].param_leaves[0][0]
        weight_paths = tuple(dict.fromkeys(p for t in trainables for p in t.paths))

        src = an.y_sources[eqn_index]
        y_atom = eqn.outvars[0]
        y_shape = tuple(aval_of(y_atom).shape)
        reached = _hidden_targets(ctx, src, groups)
        tails: list[RelationTail] = []
        for gi, members in reached.items():
            g = groups[gi]
            V = g.varshape
            offset = len(V) - len(y_shape)
            member_paths = tuple(p for p, _ in members)
            if offset < 0 or tuple(V[offset:]) != y_shape:
                records.append(
                    record(
                        DiagnosticKind.RELATION_EXCLUDED_SHAPE_MISMATCH,
                        DiagnosticLevel.WARNING,
                        f"{name} at {where} produces y of shape {y_shape}, which does not line up "
                        f"with the positions {V} of group {gi} {list(g.hidden_paths)}; this "
                        "connection is not traced.",
                        primitive=name,
                        weight_path=weight_path,
                        hidden_paths=member_paths,
                        y_shape=y_shape,
                        hidden_shape=V,
                        weight_paths=weight_paths,
                    )
                )
                continue
            expected = tuple(offset + k for k in identity_align(y_shape))
            reason: str | None = None
            for _, a in members:
                if isinstance(a, Mixed):
                    reason = reason or a.reason
                elif a != expected:
                    reason = reason or "y reaches the hidden state at other positions"
            outputs = [minfo.state_out_atoms(p)[0] for p in g.hidden_paths]
            program, consts = slice_program(
                minfo.closed_jaxpr,
                table,
                [y_atom],
                outputs,
                _tail_filter(an, src),
            )
            tails.append(
                RelationTail(
                    group_index=gi,
                    hidden_paths=member_paths,
                    program=program,
                    consts=consts,
                    is_diagonal=reason is None,
                    mixing_reason=reason,
                    broadcast_ndim=offset,
                )
            )
            if reason is not None:
                records.append(
                    record(
                        DiagnosticKind.TAIL_MIXES_POSITIONS,
                        DiagnosticLevel.WARNING,
                        f"The path from {name} at {where} to group {gi} mixes positions "
                        f"({reason}); df is taken from the full Jacobian's diagonal and online "
                        "gradients for this weight are approximate.",
                        primitive=name,
                        weight_path=weight_path,
                        hidden_paths=member_paths,
                        reason=reason,
                    )
                )

        # What else does y reach, through boundaries?
        blocking = sorted(
            i for i in an.boundaries if any(an.derived_from(v, {src}) for v in jaxpr.eqns[i].invars)
        )
        connected = {p for t in tails for p in groups[t.group_index].hidden_paths}
        if tails:
            # an indirect route into a group this relation already traces is dropped
            blocking_hidden = [i for i in blocking if ctx.reached_hidden(i) & connected]
        else:
            blocking_hidden = [i for i in blocking if ctx.reached_hidden(i)]
        blocking_prims = tuple(str(jaxpr.eqns[i].primitive.name) for i in blocking_hidden)
        blocking_paths = tuple(
            p for p in (_first_path(ctx, jaxpr.eqns[i]) for i in blocking_hidden) if p is not None
        )
        if not tails:
            if reached:
                continue  # excluded by shape, already recorded
            if any(etp_spec(jaxpr.eqns[i].primitive) is not None for i in blocking_hidden):
                records.append(
                    record(
                        DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT,
                        DiagnosticLevel.WARNING,
                        f"{name} at {where} (weight {weight_path}) reaches hidden states only "
                        f"through other weight operations {list(blocking_paths)}; it is not "
                        "traced through time and learns from its instantaneous gradient only.",
                        primitive=name,
                        weight_path=weight_path,
                        blocking_primitives=blocking_prims,
                        blocking_weight_paths=blocking_paths,
                        weight_paths=weight_paths,
                    )
                )
            elif blocking_hidden:
                records.append(
                    record(
                        DiagnosticKind.RELATION_EXCLUDED_MIXING,
                        DiagnosticLevel.WARNING,
                        f"{name} at {where} (weight {weight_path}) reaches hidden states only "
                        f"through position-mixing operations {list(blocking_prims)}; it is not "
                        "traced through time and learns from its instantaneous gradient only.",
                        primitive=name,
                        weight_path=weight_path,
                        blocking_primitives=blocking_prims,
                        weight_paths=weight_paths,
                    )
                )
            else:
                records.append(
                    record(
                        DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL,
                        DiagnosticLevel.INFO,
                        f"{name} at {where} (weight {weight_path}) reaches no hidden state: it is "
                        "a non-temporal weight (e.g. a readout) and learns from its exact "
                        "instantaneous gradient.",
                        primitive=name,
                        weight_path=weight_path,
                        weight_paths=weight_paths,
                    )
                )
            continue

        partial = bool(blocking_hidden)
        x_index = spec.x_index
        x_var: VarId | None = None
        x_shape: Shape | None = None
        if x_index is not None:
            x_atom = eqn.invars[x_index]
            x_shape = tuple(aval_of(x_atom).shape)
            x_var = table.id_of(x_atom)
            if x_var is None:
                raise WeightNotParamStateError(  # pragma: no cover - literal x is scalar
                    f"{name} at {where} has a literal data input; pass an array."
                )
        relation = HiddenParamOpRelation(
            index=len(relations),
            primitive=eqn.primitive,
            params=FrozenParams(eqn.params),
            eqn_index=eqn_index,
            location=where,
            x_var=x_var,
            y_var=table.ids[y_atom],
            x_shape=x_shape,
            y_shape=y_shape,
            dtype=np.dtype(aval_of(y_atom).dtype),
            trainables=tuple(trainables),
            tails=tuple(tails),
            partial_path=partial,
            untraced_routes=partial
            or any(not t.is_diagonal for t in tails)
            or ctx.untraced_routes(y_atom, src),
        )
        relations.append(relation)
        records.append(
            record(
                DiagnosticKind.RELATION_INCLUDED,
                DiagnosticLevel.INFO,
                f"{name} at {where} (weight {weight_path}) is traced into hidden group(s) "
                f"{list(relation.hidden_groups)}.",
                primitive=name,
                weight_path=weight_path,
                hidden_paths=relation.connected_hidden_paths,
                hidden_group_indices=relation.hidden_groups,
                weight_paths=weight_paths,
            )
        )
        if partial:
            records.append(
                record(
                    DiagnosticKind.RELATION_PARTIAL_PATH,
                    DiagnosticLevel.WARNING,
                    f"{name} at {where} (weight {weight_path}) also reaches hidden states through "
                    f"{list(blocking_prims)} {list(blocking_paths)}; that indirect contribution is "
                    "not traced.",
                    primitive=name,
                    weight_path=weight_path,
                    hidden_paths=relation.connected_hidden_paths,
                    blocking_primitives=blocking_prims,
                    blocking_weight_paths=blocking_paths,
                )
            )

    records.extend(_plain_uses(ctx, operand_eqns, operand_slots))
    return RelatedModule(
        module_info=minfo,
        hidden_groups=groups,
        hidden_param_op_relations=tuple(relations),
        diagnostics=tuple(records),
    )


def _plain_uses(
    ctx: _Context, operand_eqns: set[int], operand_slots: set[tuple[int, int]]
) -> list[CompilationRecord]:
    """Records for ParamState leaves used by plain JAX operations."""
    jaxpr = ctx.table.jaxpr
    # weight-only values and the ParamState paths they derive from
    derived: dict[Var, tuple[Path, ...]] = {v: (p,) for v, (p, _) in ctx.leaf_of.items()}
    first_use: dict[Path, tuple[str, str]] = {}
    constvars = set(jaxpr.constvars)
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [a for a in eqn.invars if isinstance(a, Var)]
        from_weights = [a for a in ins if a in derived]
        if not from_weights:
            continue
        weight_only = all(a in derived or a in constvars for a in ins)
        if i in operand_eqns and weight_only:
            paths = tuple(dict.fromkeys(p for a in from_weights for p in derived[a]))
            for v in eqn.outvars:
                if not isinstance(v, DropVar):
                    derived[v] = paths
            continue
        for pos, a in enumerate(eqn.invars):
            if isinstance(a, Var) and a in derived and (i, pos) not in operand_slots:
                for p in derived[a]:
                    first_use.setdefault(p, (str(eqn.primitive.name), equation_location(eqn)))
        if weight_only and etp_spec(eqn.primitive) is None:
            paths = tuple(dict.fromkeys(p for a in from_weights for p in derived[a]))
            for v in eqn.outvars:
                if not isinstance(v, DropVar):
                    derived[v] = paths
    out = []
    for p, (prim, where) in first_use.items():
        out.append(
            record(
                DiagnosticKind.WEIGHT_PLAIN_USE,
                DiagnosticLevel.WARNING,
                f"ParamState {p} is used by the plain JAX operation '{prim}' at {where}; that use "
                "is not traced through time, so the weight learns from its instantaneous "
                "gradient there. Use an ETP op (etrax.matmul, etrax.nn.Linear, ...) to trace it.",
                primitive=prim,
                weight_path=p,
            )
        )
    return out


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
