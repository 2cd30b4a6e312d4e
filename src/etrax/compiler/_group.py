"""Stage 2, `group`: find hidden groups and each group's transition ``h^{t-1} → h^t``.

Hidden states that feed each other through non-boundary computation (see
`_analysis`) form one group. Each group gets a *transition program* whose inputs
are the values it treats as constants followed by the members' old values, and
whose outputs are the members' new values. Whether that transition keeps
positions apart is *checked* (not assumed) and recorded in
`HiddenGroup.is_diagonal_recurrence`.
"""

import functools
from collections.abc import Sequence
from typing import Any

import brainunit as u
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._compat import Var, equation_location, jacobian, map_over, vary_like
from .._errors import NotSupportedError
from .._typing import Path, Shape, VarId
from ._analysis import Analyses, StepAnalysis, analyse_step
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel, record
from ._extract import extract
from ._jaxpr import Program, forward_closure, refuse_custom_vjp, slice_program
from ._module_info import ModuleInfo, StateInfo
from ._positions import Mixed, identity_align

__all__ = [
    "GroupedModule",
    "HiddenGroup",
    "find_hidden_groups_from_minfo",
    "find_hidden_groups_from_module",
    "group",
]


class HiddenGroup(eqx.Module):
    """Hidden states sharing one transition, stored as one slab ``(*varshape, S)``.

    **Arguments:**

    - `index`: position in `ETraceGraph.hidden_groups`.
    - `hidden_paths`: member paths, in compiled order.
    - `num_states`: states each member contributes (1, or ``k`` for a stacked
      `HiddenGroupState`); `num_state` is their sum ``S``.
    - `stacked`: whether each member stores a trailing state axis.
    - `varshape`: the positions shared by all members (batch axis included).
    - `dtype`: the members' dtype.
    - `hidden_invars` / `hidden_outvars`: `VarId`s of the members' old/new values.
    - `transition`: `Program` ``(*consts, *old values) -> new values``.
    - `transition_consts`: `VarId`s of the transition's constant inputs.
    - `is_diagonal_recurrence`: whether the transition provably keeps positions
      apart; if not, `mixing_reason` says which operation mixes them.
    - `has_recurrence`: whether any new value depends on an old value through
      non-boundary computation (if not, ``D ≡ 0``).
    - `link`: for a group *linked* to groups of other shapes (they feed each other
      within the step), the index of that linked set; `None` otherwise.
    - `cut_outvars`: `VarId`s of the linked groups' new values; routes through them
      cross a boundary, like a stacked layer's.
    """

    index: int = eqx.field(static=True)
    hidden_paths: tuple[Path, ...] = eqx.field(static=True)
    num_states: tuple[int, ...] = eqx.field(static=True)
    stacked: tuple[bool, ...] = eqx.field(static=True)
    varshape: Shape = eqx.field(static=True)
    dtype: np.dtype[Any] = eqx.field(static=True)
    hidden_invars: tuple[VarId, ...] = eqx.field(static=True)
    hidden_outvars: tuple[VarId | None, ...] = eqx.field(static=True)
    transition: Program = eqx.field(static=True)
    transition_consts: tuple[VarId, ...] = eqx.field(static=True)
    is_diagonal_recurrence: bool = eqx.field(static=True)
    mixing_reason: str | None = eqx.field(static=True)
    has_recurrence: bool = eqx.field(static=True)
    link: int | None = eqx.field(static=True, default=None)
    cut_outvars: tuple[VarId, ...] = eqx.field(static=True, default=())

    def __check_init__(self) -> None:
        n = len(self.hidden_paths)
        if not (len(self.num_states) == len(self.stacked) == len(self.hidden_invars) == n):
            raise ValueError("HiddenGroup: per-member fields must have one entry per member.")

    @property
    def num_state(self) -> int:
        """``S``, the number of states per position."""
        return sum(self.num_states)

    @property
    def slab_shape(self) -> Shape:
        return (*self.varshape, self.num_state)

    @property
    def transition_jaxpr(self) -> Any:
        return self.transition.jaxpr

    def concat_hidden(self, values: Sequence[Any]) -> Float[Array, "*varshape S"]:
        """Stack member values (arrays, or `brainunit` quantities: their mantissas)
        into the group slab ``(*varshape, S)``."""
        if len(values) != len(self.hidden_paths):
            raise ValueError(
                f"group {self.index} has {len(self.hidden_paths)} members, got {len(values)} values"
            )
        raw = [u.get_mantissa(v) for v in values]  # a slab has no units (the step's own)
        parts = [v if st else v[..., None] for v, st in zip(raw, self.stacked, strict=True)]
        return jnp.concatenate(parts, axis=-1)

    def split_hidden(
        self, slab: Float[Array, "*varshape S"], like: Sequence[Any] | None = None
    ) -> list[Any]:
        """Split a slab ``(*varshape, S)`` back into member values (with the units of
        the values `like`, when given: `brainunit` quantities)."""
        if slab.shape[-1] != self.num_state:
            raise ValueError(
                f"group {self.index} expects a trailing axis of {self.num_state}, got {slab.shape}"
            )
        out: list[Any] = []
        start = 0
        for k, st in zip(self.num_states, self.stacked, strict=True):
            piece = slab[..., start : start + k]
            out.append(piece if st else piece[..., 0])
            start += k
        if like is not None:
            out = [
                u.Quantity(v, unit=u.get_unit(ref)) if isinstance(ref, u.Quantity) else v
                for v, ref in zip(out, like, strict=True)
            ]
        return out

    def transition_fn(self, consts: Sequence[Array]) -> Any:
        """The map ``slab(h^{t-1}) -> slab(h^t)`` with the constants bound."""

        return functools.partial(self._transition_at, consts)

    def _transition_at(self, consts: Sequence[Array], slab: Array) -> Array:
        outs = self.transition(*consts, *self.split_hidden(slab))
        outs = [
            jnp.broadcast_to(jnp.asarray(o, slab.dtype), shape)
            for o, shape in zip(outs, self._member_shapes(), strict=True)
        ]
        return self.concat_hidden(outs)

    def _member_shapes(self) -> list[Shape]:
        return [
            (*self.varshape, k) if st else self.varshape
            for k, st in zip(self.num_states, self.stacked, strict=True)
        ]

    def diagonal_jacobian(
        self, hidden: Sequence[Array], consts: Sequence[Array]
    ) -> Float[Array, "*varshape S S"]:
        """``D[p, a, b] = ∂h^t[p, a] / ∂h^{t-1}[p, b]`` at the given point.

        For a diagonal transition this takes ``S`` forward-mode products; otherwise
        the exact block diagonal is extracted from the full Jacobian
        (``O((P·S)²)`` memory).
        """
        slab = self.concat_hidden(hidden)
        fn = self.transition_fn(consts)
        S = self.num_state
        if not self.has_recurrence:
            return jnp.zeros((*self.varshape, S, S), slab.dtype)
        if self.is_diagonal_recurrence:
            _, lin = jax.linearize(fn, slab)
            basis = vary_like(
                jnp.broadcast_to(jnp.eye(S, dtype=slab.dtype), (*self.varshape, S, S)), slab
            )
            return map_over(lin, basis, axis=-1, out_axis=-1)  # type: ignore[no-any-return]
        P = int(np.prod(self.varshape, dtype=np.int64))
        full: Array = jacobian(fn, slab).reshape(P, S, P, S)
        idx = jnp.arange(P)
        return full[idx, :, idx, :].reshape(*self.varshape, S, S)


class GroupedModule(eqx.Module):
    """Output of the `group` stage (`analyses` is the step analysis, passed forward)."""

    module_info: ModuleInfo
    hidden_groups: tuple[HiddenGroup, ...]
    diagnostics: tuple[CompilationRecord, ...] = eqx.field(static=True)
    analyses: Analyses = eqx.field(static=True)

    @property
    def hid_path_to_group(self) -> dict[Path, HiddenGroup]:
        return {p: g for g in self.hidden_groups for p in g.hidden_paths}


def _find_root(parent: list[int], a: int) -> int:
    while parent[a] != a:
        parent[a] = parent[parent[a]]
        a = parent[a]
    return a


def _components(n: int, edges: Sequence[tuple[int, int]]) -> list[list[int]]:
    parent = list(range(n))
    find = functools.partial(_find_root, parent)

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    comps: dict[int, list[int]] = {}
    for i in range(n):
        comps.setdefault(find(i), []).append(i)
    return sorted(comps.values(), key=lambda c: c[0])


def _build_group(
    index: int,
    members: list[int],
    hidden: tuple[StateInfo, ...],
    an: StepAnalysis,
    minfo: ModuleInfo,
    link: int | None,
) -> tuple[HiddenGroup, list[CompilationRecord]]:
    table = an.table
    infos = [hidden[m] for m in members]
    paths = tuple(s.path for s in infos)
    dtypes = {s.path: np.dtype(s.dtypes[0]) for s in infos}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{p} {d}" for p, d in dtypes.items())
        raise NotSupportedError(
            f"Hidden states {list(paths)} update each other within a step, so they form one "
            f"group, held as one array; but their dtypes differ ({listed}). Give them one "
            "dtype (e.g. create every state with brainstate.environ.dftype())."
        )
    sources = {an.hidden_sources[s.path] for s in infos}
    varshape = infos[0].varshape
    expected = identity_align(varshape)
    records: list[CompilationRecord] = []

    mixing: str | None = None
    recurrent = False
    for s in infos:
        out = s.outvars[0]
        if out is None:
            continue
        amap = an.maps.get(table.var(out), {})
        for src in sources:
            a = amap.get(src)
            if a is None:
                continue
            recurrent = True
            if isinstance(a, Mixed):
                mixing = mixing or a.reason
            elif a != expected:
                mixing = mixing or "the transition moves values between positions"

    inputs = [table.var(s.invars[0]) for s in infos]
    outputs = [minfo.state_out_atoms(s.path)[0] for s in infos]
    program, consts = slice_program(
        minfo.closed_jaxpr,
        table,
        inputs,
        outputs,
        an.slice_filter(sources),
    )
    refuse_custom_vjp(program, f"transition of hidden group {index} {list(paths)}")
    grp = HiddenGroup(
        index=index,
        hidden_paths=paths,
        num_states=tuple(s.num_state for s in infos),
        stacked=tuple(len(s.shapes[0]) == len(varshape) + 1 for s in infos),
        varshape=varshape,
        dtype=infos[0].dtypes[0],
        hidden_invars=tuple(s.invars[0] for s in infos),
        hidden_outvars=tuple(s.outvars[0] for s in infos),
        transition=program,
        transition_consts=consts,
        is_diagonal_recurrence=mixing is None,
        mixing_reason=mixing,
        has_recurrence=recurrent,
        link=link,
        cut_outvars=tuple(sorted(table.ids[v] for v in an.cuts)),
    )
    if len(paths) > 1:
        records.append(
            record(
                DiagnosticKind.HIDDEN_GROUP_MERGED,
                DiagnosticLevel.INFO,
                f"Hidden states {list(paths)} update each other within a step and form "
                f"group {index} with {grp.num_state} states per position.",
                hidden_paths=paths,
                group=index,
            )
        )
    if not recurrent:
        records.append(
            record(
                DiagnosticKind.HIDDEN_GROUP_NO_RECURRENCE,
                DiagnosticLevel.INFO,
                f"Group {index} {list(paths)} has no element-wise recurrence (D ≡ 0): its "
                "dependence on the previous step goes only through boundaries (weight "
                "operations, or plain products that mix positions).",
                hidden_paths=paths,
                group=index,
            )
        )
    if mixing is not None:
        records.append(
            record(
                DiagnosticKind.TRANSITION_MIXES_POSITIONS,
                DiagnosticLevel.WARNING,
                f"The transition of group {index} {list(paths)} mixes positions ({mixing}). "
                "Its per-position Jacobian D is computed exactly from the full Jacobian "
                "(cost O((P·S)²)), and online algorithms drop the cross-position terms, "
                "so their gradients are approximate for this group.",
                hidden_paths=paths,
                group=index,
                reason=mixing,
            )
        )
    return grp, records


def _state_edges(minfo: ModuleInfo, an: StepAnalysis) -> list[tuple[int, int]]:
    """``(i, j)`` when hidden state ``j``'s new value depends, through non-boundary
    computation, on ``i``'s old value, or on ``i``'s new value when their shapes differ."""
    hidden = minfo.hidden_states
    table = an.table
    edges: list[tuple[int, int]] = []
    new_of: dict[Var, int] = {}
    for j, s in enumerate(hidden):
        out = s.outvars[0]
        if out is None:
            continue
        new_of.setdefault(table.var(out), j)
        for src in an.maps.get(table.var(out), {}):
            if src < len(hidden):
                edges.append((src, j))
    for v, i in new_of.items():
        if v not in table.producer:
            continue
        for w in forward_closure(table, [v], lambda e: e not in an.boundaries) - {v}:
            k = new_of.get(w)
            if k is not None and hidden[k].varshape != hidden[i].varshape:
                edges.append((i, k))
    return edges


def _member_lists(
    minfo: ModuleInfo, an: StepAnalysis
) -> tuple[list[list[int]], list[int | None], list[CompilationRecord]]:
    """Members of each group (one group per shape of a connected set), the link index
    of each group, and the records of linked sets."""
    hidden = minfo.hidden_states
    lists: list[tuple[list[int], int | None]] = []
    records: list[CompilationRecord] = []
    for comp in _components(len(hidden), _state_edges(minfo, an)):
        by_shape: dict[Shape, list[int]] = {}
        for m in comp:
            by_shape.setdefault(hidden[m].varshape, []).append(m)
        link = None
        if len(by_shape) > 1:
            link = comp[0]
            paths = [hidden[m].path for m in comp]
            records.append(
                record(
                    DiagnosticKind.GROUP_VARSHAPE_CONFLICT,
                    DiagnosticLevel.WARNING,
                    f"Hidden states {paths} feed each other within a step but have different "
                    f"shapes {list(by_shape)}: they form one group per shape, joined like "
                    "stacked layers. Within a step ∂L/∂h flows between them exactly; their "
                    "dependence across steps is not traced, so online gradients through it "
                    "are approximate for T > 1.",
                    hidden_paths=paths,
                    shapes=tuple(by_shape),
                )
            )
        lists.extend((members, link) for members in by_shape.values())
    lists.sort(key=lambda item: item[0][0])
    return [m for m, _ in lists], [link for _, link in lists], records


def group(minfo: ModuleInfo) -> GroupedModule:
    """Find the hidden groups of a traced step (stage 2).

    Group order follows the compiled order of each group's first member; member
    order follows compiled state order. Deterministic.
    """
    base = analyse_step(minfo)
    hidden = minfo.hidden_states
    member_lists, links, records = _member_lists(minfo, base)
    records = [*minfo.diagnostics, *records]
    new_vars = [
        [base.table.var(vid) for vid in (hidden[m].outvars[0] for m in ms) if vid is not None]
        for ms in member_lists
    ]
    per_group: dict[int, StepAnalysis] = {}
    groups: list[HiddenGroup] = []
    for index, (members, link) in enumerate(zip(member_lists, links, strict=True)):
        an = base
        if link is not None:
            cuts = frozenset(
                v
                for other, (vs, lk) in enumerate(zip(new_vars, links, strict=True))
                if lk == link and other != index
                for v in vs
            )
            an = per_group[index] = analyse_step(minfo, cuts)
        grp, recs = _build_group(index, members, hidden, an, minfo, link)
        groups.append(grp)
        records.extend(recs)
    records.extend(_constant_products(minfo, base))
    return GroupedModule(
        module_info=minfo,
        hidden_groups=tuple(groups),
        diagnostics=tuple(records),
        analyses=Analyses(base, per_group),
    )


def _constant_products(minfo: ModuleInfo, an: StepAnalysis) -> list[CompilationRecord]:
    """A warning for each plain product that mixes hidden-derived positions with a
    matrix that no ParamState feeds (a constant, a plain State, an input, or hidden
    values again). Like a recurrent weight it is a boundary, so the route through it
    is left out of ``D``; unlike a weight, no use of a parameter would report it."""
    jaxpr = minfo.jaxpr
    from_weights = {an.table.var(v) for s in minfo.weight_states for v in s.invars}
    for eqn in jaxpr.eqns:  # every value computed from a weight
        if any(isinstance(v, Var) and v in from_weights for v in eqn.invars):
            from_weights.update(eqn.outvars)
    sources = set(an.hidden_sources.values())
    path_of = {k: p for p, k in an.hidden_sources.items()}
    out: list[CompilationRecord] = []
    for i in sorted(an.boundaries):
        eqn = jaxpr.eqns[i]
        if eqn.primitive.name not in ("dot_general", "conv_general_dilated"):
            continue
        hidden = [v for v in eqn.invars if isinstance(v, Var) and an.derived_from(v, sources)]
        rest = [v for v in eqn.invars if not an.derived_from(v, sources)]
        if not hidden or any(isinstance(v, Var) and v in from_weights for v in rest):
            continue
        paths = tuple(
            path_of[k]
            for k in sorted({k for v in hidden for k in an.maps.get(v, {}) if k in path_of})
        )
        out.append(
            record(
                DiagnosticKind.RECURRENT_CONSTANT_PRODUCT,
                DiagnosticLevel.WARNING,
                f"{eqn.primitive.name} at {equation_location(eqn)} mixes the positions of "
                f"values computed from hidden states {list(paths)} "
                + (
                    "with a matrix that no ParamState feeds (a constant, a plain State or an input)"
                    if rest
                    else "with each other (a product of hidden values, such as h · h)"
                )
                + ". Like a recurrent weight it is a boundary: the route through it is left "
                "out of the hidden-to-hidden Jacobian D, so online gradients through it are "
                "approximate for T > 1 (exact at T = 1). Write a diagonal matrix as an "
                "element-wise product, and a reduction as jnp.sum, to keep them in D; make a "
                "matrix a ParamState to learn it.",
                primitive=str(eqn.primitive.name),
                hidden_paths=paths,
            )
        )
    return out


def find_hidden_groups_from_minfo(
    minfo: ModuleInfo,
) -> tuple[tuple[HiddenGroup, ...], dict[Path, HiddenGroup]]:
    """The hidden groups of a traced step and the path → group map."""
    g = group(minfo)
    return g.hidden_groups, g.hid_path_to_group


def find_hidden_groups_from_module(
    model: Any, *args: Any
) -> tuple[tuple[HiddenGroup, ...], dict[Path, HiddenGroup]]:
    """Trace `model` on `args`, then find its hidden groups."""
    return find_hidden_groups_from_minfo(extract(model, *args))
