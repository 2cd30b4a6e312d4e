"""Stage 2, `group`: find hidden groups and each group's transition ``h^{t-1} → h^t``.

Hidden states that feed each other through non-boundary computation (see
`_analysis`) form one group. Each group gets a *transition program* whose inputs
are the values it treats as constants followed by the members' old values, and
whose outputs are the members' new values. Whether that transition keeps
positions apart is *checked* (not assumed) and recorded in
`HiddenGroup.is_diagonal_recurrence`.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._compat import vary_like
from .._typing import Path, Shape, VarId
from ._analysis import StepAnalysis, analyse_step
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel, record
from ._jaxpr import Program, slice_program
from ._module_info import ModuleInfo, StateInfo, extract
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

    def concat_hidden(self, values: Sequence[Array]) -> Float[Array, "*varshape S"]:
        """Stack member values into the group slab ``(*varshape, S)``."""
        if len(values) != len(self.hidden_paths):
            raise ValueError(
                f"group {self.index} has {len(self.hidden_paths)} members, got {len(values)} values"
            )
        parts = [v if st else v[..., None] for v, st in zip(values, self.stacked, strict=True)]
        return jnp.concatenate(parts, axis=-1)

    def split_hidden(self, slab: Float[Array, "*varshape S"]) -> list[Array]:
        """Split a slab ``(*varshape, S)`` back into member values."""
        if slab.shape[-1] != self.num_state:
            raise ValueError(
                f"group {self.index} expects a trailing axis of {self.num_state}, got {slab.shape}"
            )
        out: list[Array] = []
        start = 0
        for k, st in zip(self.num_states, self.stacked, strict=True):
            piece = slab[..., start : start + k]
            out.append(piece if st else piece[..., 0])
            start += k
        return out

    def transition_fn(self, consts: Sequence[Array]) -> Any:
        """The map ``slab(h^{t-1}) -> slab(h^t)`` with the constants bound."""

        def fn(slab: Array) -> Array:
            outs = self.transition(*consts, *self.split_hidden(slab))
            outs = [
                jnp.broadcast_to(jnp.asarray(o, slab.dtype), shape)
                for o, shape in zip(outs, self._member_shapes(), strict=True)
            ]
            return self.concat_hidden(outs)

        return fn

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
            return jax.vmap(lin, in_axes=-1, out_axes=-1)(basis)  # type: ignore[no-any-return]
        P = int(np.prod(self.varshape, dtype=np.int64))
        full: Array = jax.jacfwd(fn)(slab).reshape(P, S, P, S)
        idx = jnp.arange(P)
        return full[idx, :, idx, :].reshape(*self.varshape, S, S)


class GroupedModule(eqx.Module):
    """Output of the `group` stage."""

    module_info: ModuleInfo
    hidden_groups: tuple[HiddenGroup, ...]
    diagnostics: tuple[CompilationRecord, ...] = eqx.field(static=True)

    @property
    def hid_path_to_group(self) -> dict[Path, HiddenGroup]:
        return {p: g for g in self.hidden_groups for p in g.hidden_paths}


def _components(n: int, edges: Sequence[tuple[int, int]]) -> list[list[int]]:
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

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
) -> tuple[HiddenGroup, list[CompilationRecord]]:
    table = an.table
    infos = [hidden[m] for m in members]
    paths = tuple(s.path for s in infos)
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
        lambda i: i not in an.boundaries and an.equation_derives(i, sources),
    )
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
                "dependence on the previous step goes only through weight operations.",
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


def group(minfo: ModuleInfo) -> GroupedModule:
    """Find the hidden groups of a traced step (stage 2).

    Group order follows the compiled order of each group's first member; member
    order follows compiled state order. Deterministic.
    """
    an = analyse_step(minfo)
    hidden = minfo.hidden_states
    table = an.table
    edges: list[tuple[int, int]] = []
    for j, s in enumerate(hidden):
        out = s.outvars[0]
        if out is None:
            continue
        for src in an.maps.get(table.var(out), {}):
            if src < len(hidden):
                edges.append((src, j))
    records: list[CompilationRecord] = list(minfo.diagnostics)
    member_lists: list[list[int]] = []
    for comp in _components(len(hidden), edges):
        by_shape: dict[Shape, list[int]] = {}
        for m in comp:
            by_shape.setdefault(hidden[m].varshape, []).append(m)
        if len(by_shape) > 1:
            records.append(
                record(
                    DiagnosticKind.GROUP_VARSHAPE_CONFLICT,
                    DiagnosticLevel.WARNING,
                    "Hidden states "
                    f"{[hidden[m].path for m in comp]} update each other but have different "
                    f"shapes {list(by_shape)}; they are split into one group per shape and the "
                    "dependence between those groups is not traced (approximate).",
                    hidden_paths=[hidden[m].path for m in comp],
                )
            )
        member_lists.extend(by_shape.values())
    member_lists.sort(key=lambda members: members[0])
    groups: list[HiddenGroup] = []
    for members in member_lists:
        grp, recs = _build_group(len(groups), members, hidden, an, minfo)
        groups.append(grp)
        records.extend(recs)
    return GroupedModule(module_info=minfo, hidden_groups=tuple(groups), diagnostics=tuple(records))


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
