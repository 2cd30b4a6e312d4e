"""Stage 5, `perturb`: add zero perturbations to the step so that the loss-to-hidden
gradient ``∂L/∂h^t`` and every untraced use's instantaneous gradient are one VJP away.

The perturbed step computes ``h^t = f(...) + p`` for every hidden state and
returns the same outputs as the rewritten step. Where a new hidden value feeds
another hidden value *within* the step through non-boundary computation, that
route is already inside the transitions and tails that traces follow, so the
perturbation does not travel along it (otherwise the same path would be counted
twice). Routes that cross a boundary (another weight operation, or the new value
of a *linked* group of another shape) and routes to the model's outputs do carry
it.

A second perturbation ``q`` per hidden state is added to its *old* value and
reaches the outputs only along routes that avoid every new hidden value: its
gradient is the part of ``∂L/∂h^{t-1}`` that the new hidden values do not carry
(e.g. an output computed from an intermediate before it is stored in a stacked
state). It is zero for most models (`direct_paths` is then empty).

A third perturbation ``δ`` per parameter use that is not (wholly) traced is added
to the weight value where that use reads it: its gradient is the use's exact
instantaneous gradient.

A fourth, ``ε``, is added to every output of each equation that reads such a weight
(an *instant equation*), and the program also returns that equation's other operands:
the gradient of ``ε`` is the equation's output cotangent, so the use's instantaneous
gradient can be formed later, from stacked steps, as one product (chunked drivers).
Where the routes from an instant equation's outputs all cross a product with other
weights before they reach a model output (a GRU's reset gate, through the candidate's
weight), ``ε`` is also added to those products' outputs and the program returns the
values in between that the steps must keep (a `Region`): the cotangent is then pulled
back through the products with the other weights once per chunk, not at every step.
"""

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._compat import DropVar, Literal, Var, bind_equation, shape_struct, struct_of
from ..ops import etp_spec
from ._analysis import Analyses
from ._extract import extract
from ._graph import ETraceGraph
from ._group import HiddenGroup, group
from ._jaxpr import Program
from ._module_info import ModuleInfo, StateKind
from ._perturbation import HiddenPerturbation, Region
from ._relate import relate
from ._rewrite import RewrittenModule, rewrite
from ._uses import ParamUse

__all__ = [
    "HiddenPerturbation",
    "add_hidden_perturbation_from_minfo",
    "add_hidden_perturbation_in_module",
]


# Equations linear in their inputs that only move, cast or add values: an effect passes
# through them as the equation applied to the effect (see `_Run.carry_effect`).
_LINEAR = frozenset(
    {
        "concatenate", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
        "slice", "convert_element_type", "copy", "copy_p", "add", "add_any", "sub", "neg",
    }
)  # fmt: skip

REGION_MIN_MACS = 1 << 12
"""The smallest per-step product (multiply-adds, estimated as the data operand's
elements times the weight's over the data's last axis) through a region's frontier
weights that is worth a `Region`: below it (a GRU of 16 units at batch 1: 304; of 64
units: 4,288), the step is all fixed costs, and the region's chunk-end work only
lengthens the compile. The values a small region keeps per step leave the step in the
one vector the driver packs its small outputs into (`PACK_MAX_BYTES`), so they cost no
extra write (measured on a 2-core CPU)."""

_CROSSED: Hashable = "crossed"
_OWN: Hashable = "own"


def _always_boundary(eqn: Any) -> bool:
    spec = etp_spec(eqn.primitive)
    if spec is not None:
        return not spec.gradient_enabled
    return str(eqn.primitive.name) in ("stop_gradient", "conv_general_dilated")


class _Builder:
    """Static facts the perturbed step needs (a transient helper of `perturb`).

    Perturbation effects are carried in separate environments, by where they may
    still count: `_CROSSED` (crossed a boundary: counts everywhere), `_OWN` (a
    perturbation of an unlinked group on non-boundary routes: dropped at every new
    hidden value, whose transitions and tails count those routes), and for a set of
    linked groups ``("M", g)`` (from linked group ``g`` only: dropped at ``g``,
    counted at the other linked groups) and ``("X", link)`` (passed two linked
    groups: counts at all of them). Values are first-order: an environment holds
    ``orig + its effects``, and the outputs add up the effects.
    """

    def __init__(
        self,
        minfo: ModuleInfo,
        groups: Sequence[HiddenGroup],
        analyses: Analyses,
        uses: Sequence[ParamUse],
    ) -> None:
        an = analyses.base
        self.minfo = minfo
        self.table = an.table
        self.jaxpr = minfo.jaxpr
        self.hidden = minfo.hidden_states
        self.boundaries = frozenset(an.boundaries) | {
            i for i, e in enumerate(self.jaxpr.eqns) if _always_boundary(e)
        }
        group_of = {p: g for g in groups for p in g.hidden_paths}
        self.node_of: dict[Var, list[int]] = {}
        self.node_group: dict[Var, HiddenGroup] = {}
        for k, s in enumerate(self.hidden):
            vid = s.outvars[0]
            if vid is not None and self.table.var(vid) in self.table.producer:
                v = self.table.var(vid)
                self.node_of.setdefault(v, []).append(k)
                self.node_group.setdefault(v, group_of[s.path])
        self.linked: dict[int, tuple[int, ...]] = {}
        for g in groups:
            if g.link is not None:
                self.linked[g.link] = (*self.linked.get(g.link, ()), g.index)
        self.injected = tuple(u for u in uses if u.needs_instant)
        self.use_slot = {
            (u.eqn_index, u.slot): n for n, u in enumerate(self.injected) if u.eqn_index is not None
        }
        self.out_use = {u.slot: n for n, u in enumerate(self.injected) if u.eqn_index is None}
        self.instant_eqns = tuple(sorted({i for i, _ in self.use_slot}))
        self.weight_slots = frozenset(self.use_slot)
        self.eps_of: dict[int, list[int | None]] = {}
        self.eps_structs: list[Any] = []
        self.operand_slots: list[tuple[int, int]] = []  # (eqn, operand) returned
        for i in self.instant_eqns:
            eqn = self.jaxpr.eqns[i]
            slots: list[int | None] = []
            for v in eqn.outvars:
                if isinstance(v, DropVar):
                    slots.append(None)
                else:
                    slots.append(len(self.eps_structs))
                    self.eps_structs.append(struct_of(v))
            self.eps_of[i] = slots
            self.operand_slots += [
                (i, pos)
                for pos, a in enumerate(eqn.invars)
                if isinstance(a, Var) and (i, pos) not in self.weight_slots
            ]
        self.weight_reads = frozenset(
            (u.eqn_index, u.slot) for u in uses if u.eqn_index is not None
        )
        self.value_slots: list[tuple[int, int]] = []
        self.regions = tuple(self._region(i) for i in self.instant_eqns)
        self._direct()
        self._output_roles()

    def _is_frontier(self, i: int, reads: Sequence[int]) -> bool:
        """Whether equation `i`, reading region values at operands `reads`, is a
        product with weights (an ETP op, a ``dot_general`` or a convolution whose other
        operands are all weight values) that ends a region."""
        eqn = self.jaxpr.eqns[i]
        name = str(eqn.primitive.name)
        if etp_spec(eqn.primitive) is None and name not in ("dot_general", "conv_general_dilated"):
            return False
        others = [p for p in range(len(eqn.invars)) if p not in reads]
        return len(reads) == 1 and bool(others) and all((i, p) in self.weight_reads for p in others)

    def _region(self, i: int) -> Region | None:
        """The `Region` of instant equation `i`, or `None` where there is none worth
        having: a route from its outputs reaches a model output without crossing a
        product with weights, or the products reached are smaller than
        `REGION_MIN_MACS`."""
        eqns = self.jaxpr.eqns
        # only the model's outputs carry the loss (the new hidden values and the
        # hoisted values are the step's auxiliary outputs)
        returned = {v for v in self.jaxpr.outvars[: self.minfo.num_var_out] if isinstance(v, Var)}
        starts = [v for v in eqns[i].outvars if not isinstance(v, DropVar)]
        live = set(starts)
        if live & returned:
            return None
        members: list[int] = []
        ends: list[int] = []
        macs = 0
        for e in range(i + 1, len(eqns)):
            eqn = eqns[e]
            reads = [p for p, a in enumerate(eqn.invars) if isinstance(a, Var) and a in live]
            if not reads:
                continue
            members.append(e)
            outs = [v for v in eqn.outvars if not isinstance(v, DropVar)]
            if self._is_frontier(e, reads):
                ends.append(e)
                data = struct_of(eqn.invars[reads[0]]).shape
                weight = sum(
                    math.prod(struct_of(a).shape) for p, a in enumerate(eqn.invars) if p != reads[0]
                )
                macs += math.prod(data) * weight // max(data[-1] if data else 1, 1)
                continue
            if any(v in returned for v in outs):
                return None
            live.update(outs)
        if macs < REGION_MIN_MACS:
            return None  # also where no product with a weight was reached
        frontier: list[tuple[int, int, int]] = []
        for e in ends:  # their outputs get an ``ε`` (a later instant equation has one)
            if e not in self.eps_of:
                slots: list[int | None] = []
                for v in eqns[e].outvars:
                    slots.append(None if isinstance(v, DropVar) else len(self.eps_structs))
                    if not isinstance(v, DropVar):
                        self.eps_structs.append(struct_of(v))
                self.eps_of[e] = slots
            frontier += [(e, k, n) for k, n in enumerate(self.eps_of[e]) if n is not None]
        consts = set(self.jaxpr.constvars)
        reads_at: dict[Var, tuple[int, int]] = {}
        for e in members:
            for p, a in enumerate(eqns[e].invars):
                if isinstance(a, Literal) or a in live or a in consts:
                    continue
                if (e, p) not in self.weight_reads:
                    reads_at.setdefault(a, (e, p))
        pieces = self._pieces(i)
        slices = tuple((*at, *pieces[a]) for a, at in reads_at.items() if a in pieces)
        kept = [(i, -1 - k) for k, v in enumerate(eqns[i].outvars) if not isinstance(v, DropVar)]
        kept += [at for a, at in reads_at.items() if a not in pieces]
        values = []
        for slot in kept:
            if slot not in self.value_slots:
                self.value_slots.append(slot)
            values.append(self.value_slots.index(slot))
        return Region(tuple(members), tuple(frontier), tuple(values), slices)

    def _pieces(self, i: int) -> dict[Var, tuple[int, int, int, int]]:
        """The variables that are a piece of one of instant equation `i`'s kept
        operands, each with ``(operand slot, axis, start, size)``: the operands of the
        concatenation that formed it (the ``x`` and ``h`` of a gate's ``[x; h]``)."""
        producer = {v: e for e, eqn in enumerate(self.jaxpr.eqns[:i]) for v in eqn.outvars}
        out: dict[Var, tuple[int, int, int, int]] = {}
        for n, (j, pos) in enumerate(self.operand_slots):
            operand = self.jaxpr.eqns[j].invars[pos]
            e = producer.get(operand) if j == i and isinstance(operand, Var) else None
            if e is None or str(self.jaxpr.eqns[e].primitive.name) != "concatenate":
                continue
            cat = self.jaxpr.eqns[e]
            axis, start = int(cat.params["dimension"]), 0
            for a in cat.invars:
                size = int(struct_of(a).shape[axis])
                if isinstance(a, Var):
                    out.setdefault(a, (n, axis, start, size))
                start += size
        return out

    def _direct(self) -> None:
        """Equations on routes from old hidden values to the model's outputs that avoid
        every new hidden value: they carry the "direct" perturbation ``q``.

        A group's new value on such a route (a leaky readout returned as the output, or
        a second layer read out through a weight) is reached from the old values its
        own computation reads: those routes (`through`: the new value, the equations
        computing it, and the hidden states whose ``q`` they carry) count for every
        other group's old values, carried on to the outputs along the direct
        equations after it; the group's own old values, and its linked groups', are in
        its transition and are left out."""
        jaxpr = self.jaxpr
        outputs = [v for v in jaxpr.outvars[: self.minfo.num_var_out] if isinstance(v, Var)]
        needed = set(outputs)
        self.direct_eqns: set[int] = set()
        for i in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[i]
            outs = [v for v in eqn.outvars if not isinstance(v, DropVar)]
            if any(v in needed and v not in self.node_of for v in outs):
                self.direct_eqns.add(i)
                needed.update(a for a in eqn.invars if isinstance(a, Var))
        self.hidden_in = {self.table.var(s.invars[0]): k for k, s in enumerate(self.hidden)}
        direct = {k for v, k in self.hidden_in.items() if v in needed}
        self.blocked_states = frozenset(direct)
        self.through: list[tuple[Var, frozenset[int], tuple[int, ...]]] = []
        group_of = {p: g for g in self.node_group.values() for p in g.hidden_paths}
        for node in sorted(
            (v for v in needed if v in self.node_of), key=lambda v: self.table.producer[v]
        ):
            group = self.node_group[node]
            own = (
                {group.index, *self.linked.get(group.link, ())}
                if group.link is not None
                else {group.index}
            )
            reached, eqns = {node}, set()
            for i in range(self.table.producer[node], -1, -1):
                outs = [v for v in jaxpr.eqns[i].outvars if not isinstance(v, DropVar)]
                if any(v in reached and (v is node or v not in self.node_of) for v in outs):
                    eqns.add(i)
                    reached.update(a for a in jaxpr.eqns[i].invars if isinstance(a, Var))
            states = tuple(
                sorted(
                    k
                    for v, k in self.hidden_in.items()
                    if v in reached
                    and (g := group_of.get(self.hidden[k].path)) is not None
                    and g.index not in own
                )
            )
            if states:
                self.through.append((node, frozenset(eqns), states))
                direct.update(states)
        self.direct = sorted(direct)

    def _output_roles(self) -> None:
        """What each output of the step is: model output, hidden, other or weight."""
        paths = [s.path for s in self.hidden]
        self.passthrough: dict[int, int] = {}
        self.role: dict[int, StateKind | None] = dict.fromkeys(range(self.minfo.num_var_out))
        pos = self.minfo.num_var_out
        for s in self.minfo.states:
            for _ in s.invars:
                self.role[pos] = s.kind
                atom = self.jaxpr.outvars[pos]
                if s.kind is StateKind.HIDDEN and not (
                    isinstance(atom, Var) and atom in self.node_of
                ):
                    self.passthrough[pos] = paths.index(s.path)
                pos += 1

    def program(self) -> Program:
        avals = [struct_of(v) for v in self.jaxpr.invars]
        avals += [shape_struct(s.shapes[0], s.dtypes[0]) for s in self.hidden] * 2
        avals += [shape_struct(u.shape, u.dtype) for u in self.injected]
        avals += self.eps_structs
        closed = jax.make_jaxpr(self._evaluate)(*avals)
        n_in = len(closed.jaxpr.invars)
        return Program(closed, tuple(range(n_in)), tuple(range(len(closed.jaxpr.outvars))))

    def _evaluate(self, *flat: Any) -> list[Any]:
        n, h, u = len(self.jaxpr.invars), len(self.hidden), len(self.injected)
        d = n + 2 * h
        run = _Run(self, flat[:n], flat[n : n + h], flat[n + h : d], flat[d : d + u], flat[d + u :])
        for i, eqn in enumerate(self.jaxpr.eqns):
            run.equation(i, eqn)
        return run.outputs() + run.operands()


class _Run:
    """One evaluation of the perturbed step (inside `jax.make_jaxpr`)."""

    def __init__(
        self,
        b: _Builder,
        inputs: Sequence[Any],
        perturbs: Sequence[Any],
        olds: Sequence[Any],
        deltas: Sequence[Any],
        epsilons: Sequence[Any],
    ) -> None:
        self.b = b
        self.perturbs, self.deltas, self.epsilons = perturbs, deltas, epsilons
        self.orig: dict[Var, Any] = dict(
            zip(b.jaxpr.constvars, b.minfo.closed_jaxpr.consts, strict=True)
        )
        self.orig.update(zip(b.jaxpr.invars, inputs, strict=True))
        self.envs: dict[Hashable, dict[Var, Any]] = {_CROSSED: {}, _OWN: {}}
        self.blocked: dict[Var, Any] = {}
        self.totals: dict[Var, Any] = {}
        # (environment, variable) -> (its value there, its effect), for values that are
        # a node's ``orig + perturbations`` or a linear equation of such values: their
        # effect is known without ``orig`` (see `node`, `carry_effect` and `total`)
        self.added: dict[tuple[Hashable, Var], tuple[Any, Any]] = {}
        for v, k in b.hidden_in.items():
            if k in b.blocked_states:
                self.blocked[v] = self.orig[v] + olds[k].astype(jnp.result_type(self.orig[v]))
        # per new value reached from other groups' old values (`through`): the values
        # computed from their ``q`` up to it, and from it on to the outputs
        self.through: list[tuple[dict[Var, Any], dict[Var, Any]]] = []
        for _, _, states in b.through:
            back: dict[Var, Any] = {}
            for v, k in b.hidden_in.items():
                if k in states:
                    back[v] = self.orig[v] + olds[k].astype(jnp.result_type(self.orig[v]))
            self.through.append((back, {}))

    def read(self, env: Mapping[Var, Any], atom: Any, i: int, pos: int) -> Any:
        value = atom.val if isinstance(atom, Literal) else env.get(atom, self.orig.get(atom))
        n = self.b.use_slot.get((i, pos))
        if n is not None:
            value = value + self.deltas[n].astype(jnp.result_type(value))
        return value

    def bind(self, env: Mapping[Var, Any], i: int, eqn: Any) -> list[Any]:
        outs = bind_equation(eqn, [self.read(env, a, i, p) for p, a in enumerate(eqn.invars)])
        slots = self.b.eps_of.get(i)
        if slots is None:
            return outs
        return [
            o if n is None else o + self.epsilons[n].astype(jnp.result_type(o))
            for o, n in zip(outs, slots, strict=True)
        ]

    def operands(self) -> list[Any]:
        """The unperturbed operands of the instant equations (their weights excluded),
        then the values the regions read (`HiddenPerturbation.value_slots`)."""
        eqns = self.b.jaxpr.eqns
        out = [self.read(self.orig, eqns[i].invars[pos], -1, -1) for i, pos in self.b.operand_slots]
        for i, pos in self.b.value_slots:
            atom = eqns[i].invars[pos] if pos >= 0 else eqns[i].outvars[-1 - pos]
            out.append(self.read(self.orig, atom, -1, -1))
        return out

    def equation(self, i: int, eqn: Any) -> None:
        outs = [v for v in eqn.outvars if not isinstance(v, DropVar)]
        for v, val in zip(eqn.outvars, self.bind(self.orig, i, eqn), strict=True):
            if not isinstance(v, DropVar):
                self.orig[v] = val
        ins = [a for a in eqn.invars if isinstance(a, Var)]
        if i in self.b.direct_eqns and any(a in self.blocked for a in ins):
            for v, val in zip(eqn.outvars, self.bind(self.blocked, i, eqn), strict=True):
                if not isinstance(v, DropVar) and v not in self.b.node_of:
                    self.blocked[v] = val
        for (node, eqns, _), (back, fwd) in zip(self.b.through, self.through, strict=True):
            if i in eqns and any(a in back for a in ins):  # up to the new value
                for v, val in zip(eqn.outvars, self.bind(back, i, eqn), strict=True):
                    if not isinstance(v, DropVar) and (v is node or v not in self.b.node_of):
                        back[v] = val
                if node in back:
                    fwd[node] = back[node]
            elif i in self.b.direct_eqns and any(a in fwd for a in ins):  # on to the outputs
                for v, val in zip(eqn.outvars, self.bind(fwd, i, eqn), strict=True):
                    if not isinstance(v, DropVar) and v not in self.b.node_of:
                        fwd[v] = val
        active = [k for k, env in self.envs.items() if any(a in env for a in ins)]
        if active and i in self.b.boundaries:
            summed = {a: self.total(a) for a in ins}
            for v, val in zip(eqn.outvars, self.bind(summed, i, eqn), strict=True):
                if not isinstance(v, DropVar):
                    self.envs[_CROSSED][v] = val
        else:
            for k in active:
                env = self.envs[k]
                for v, val in zip(eqn.outvars, self.bind(env, i, eqn), strict=True):
                    if not isinstance(v, DropVar):
                        env[v] = val
                self.carry_effect(k, eqn)
        for v in outs:
            if v in self.b.node_of:
                self.node(v)

    def carry_effect(self, key: Hashable, eqn: Any) -> None:
        """Through a linear structural equation (a concatenation, reshape, slice, sum,
        ...) whose environment inputs all have a known effect, the output's effect is the
        equation applied to those effects (zeros for the other inputs), so that
        `total` needs no ``orig`` there either (GRU cells concatenate ``[x; h]``)."""
        if eqn.primitive.name not in _LINEAR or len(eqn.outvars) != 1:
            return
        env = self.envs[key]
        effects = []
        for atom in eqn.invars:
            if isinstance(atom, Var) and atom in env:
                node, added = self.added.get((key, atom), (None, None))
                if node is not env[atom]:
                    return
                effects.append(added)
            else:
                value = atom.val if isinstance(atom, Literal) else self.orig[atom]
                effects.append(jnp.zeros_like(value))
        out = eqn.outvars[0]
        if not isinstance(out, DropVar):
            self.added[(key, out)] = (env[out], bind_equation(eqn, effects)[0])

    def effect(self, key: Hashable, v: Var) -> Any:
        env = self.envs.get(key, {})
        return env[v] - self.orig[v] if v in env else None

    def total(self, v: Var) -> Any:
        """``orig`` plus every effect that reaches `v`. Each effect enters as
        ``e - stop_gradient(e)``: exactly zero in value (so the primal outputs equal the
        unperturbed step bit for bit) and ``e``'s derivative. Where an environment's
        value is a node's ``orig + p`` (or a linear equation of such values), ``e`` is
        formed from ``p`` itself (`node`, `carry_effect`); otherwise it is
        ``env[v] - orig[v]``, which evaluates ``orig`` up to `v` a second time.

        Formed once per variable: a variable's environments are final once its
        equation has run (`equation` and `node` write only the equation's outputs)."""
        done = self.totals.get(v)
        if done is not None:
            return done
        reached = [(key, env[v]) for key, env in self.envs.items() if v in env]
        if not reached:
            value = self.orig[v]
        else:
            # one environment's value stands in for ``orig`` (equal in value: the
            # perturbations are zero), so ``orig``'s own evaluation downstream of the
            # hidden values is left for dead-code elimination
            value = reached[0][1]
            for key, other in reached[1:]:
                # a node's ``orig + p`` has the effect ``p`` itself: then ``orig`` (the
                # step's weight products up to here) is not evaluated a second time
                node, added = self.added.get((key, v), (None, None))
                e = added if node is other else other - self.orig[v]
                value = value + (e - jax.lax.stop_gradient(e))
        self.totals[v] = value
        return value

    def node(self, v: Var) -> None:
        """At a new hidden value: drop the effects its group's programs already count,
        and add the group's perturbation. A value that is the new value of several
        hidden states (``prev = h`` as well as ``h``) gets the first one's only: the
        step's outputs read it once, so ``∂L/∂v`` goes to that state, and the others'
        signals are zero (their traces equal its own, so the gradient is counted once)."""
        b = self.b
        g = b.node_group[v]
        dtype = jnp.result_type(self.orig[v])
        added = [self.perturbs[k].astype(dtype) for k in b.node_of[v][:1]]
        p = self.orig[v]
        for a in added:
            p = p + a
        own: Hashable = _OWN if g.link is None else ("M", g.index)
        if added:
            self.added[(own, v)] = (p, sum(added[1:], added[0]))
        if g.link is None:
            for key in self.envs:
                if key is not _CROSSED:
                    self.envs[key].pop(v, None)
            self.envs[_OWN][v] = p
            return
        keep = [("X", g.link), *(("M", h) for h in b.linked[g.link] if h != g.index)]
        effects = [e for e in (self.effect(k, v) for k in keep) if e is not None]
        for key in self.envs:
            if key is not _CROSSED:
                self.envs[key].pop(v, None)
        if effects:
            self.envs.setdefault(("X", g.link), {})[v] = self.orig[v] + sum(effects[1:], effects[0])
        self.envs.setdefault(("M", g.index), {})[v] = p

    def outputs(self) -> list[Any]:
        b = self.b
        results = []
        for pos, atom in enumerate(b.jaxpr.outvars):
            role = b.role.get(pos)
            if pos in b.passthrough:
                base = self.read(self.orig, atom, -1, pos)
                k = b.passthrough[pos]
                value = base + self.perturbs[k].astype(jnp.result_type(base))
            elif role is StateKind.WEIGHT:
                value = self.read(self.orig, atom, -1, pos)
            elif isinstance(atom, Var):
                value = self.total(atom)
                if (
                    role is None
                    and atom in self.blocked
                    and jnp.issubdtype(jnp.result_type(value), jnp.inexact)
                ):  # a boolean or integer value carries no perturbation
                    value = value + (self.blocked[atom] - self.orig[atom])
                if role is None and jnp.issubdtype(jnp.result_type(value), jnp.inexact):
                    for _, fwd in self.through:  # other groups' old values, through new ones
                        if atom in fwd:
                            value = value + (fwd[atom] - self.orig[atom])
            else:
                value = atom.val
            n = b.out_use.get(pos)
            if n is not None:
                value = value + self.deltas[n].astype(jnp.result_type(value))
            results.append(value)
        return results


def perturb(rewritten: RewrittenModule, *, enabled: bool = True) -> ETraceGraph:
    """Add the perturbations and assemble the `ETraceGraph` (stage 5).

    With ``enabled=False`` the graph has ``hidden_perturb=None`` (forward and
    Jacobians only; `online_grad` then needs a `window`).
    """
    hp = None
    if enabled:
        b = _Builder(
            rewritten.module_info,
            rewritten.hidden_groups,
            rewritten.analyses,
            rewritten.param_uses,
        )
        hp = HiddenPerturbation(
            perturb_hidden_paths=tuple(s.path for s in b.hidden),
            shapes=tuple(s.shapes[0] for s in b.hidden),
            dtypes=tuple(s.dtypes[0] for s in b.hidden),
            program=b.program(),
            direct_paths=tuple(b.hidden[k].path for k in b.direct),
            use_indices=tuple(u.index for u in b.injected),
            use_shapes=tuple(u.shape for u in b.injected),
            use_dtypes=tuple(u.dtype for u in b.injected),
            num_outputs=len(b.jaxpr.outvars),
            instant_eqns=b.instant_eqns,
            eps_slots=tuple(tuple(b.eps_of[i]) for i in b.instant_eqns),
            eps_shapes=tuple(tuple(e.shape) for e in b.eps_structs),
            eps_dtypes=tuple(e.dtype for e in b.eps_structs),
            operand_slots=tuple(b.operand_slots),
            regions=b.regions,
            value_slots=tuple(b.value_slots),
        )
    return ETraceGraph(
        module_info=rewritten.module_info,
        hidden_groups=rewritten.hidden_groups,
        hidden_param_op_relations=rewritten.hidden_param_op_relations,
        hidden_perturb=hp,
        diagnostics=rewritten.diagnostics,
        param_uses=rewritten.param_uses,
    )


def add_hidden_perturbation_from_minfo(minfo: ModuleInfo) -> HiddenPerturbation:
    """Build the `HiddenPerturbation` of a traced step (runs the later stages)."""
    hp = perturb(rewrite(relate(group(minfo)))).hidden_perturb
    assert hp is not None
    return hp


def add_hidden_perturbation_in_module(model: Any, *args: Any) -> HiddenPerturbation:
    """Trace `model` on `args` and build its `HiddenPerturbation`."""
    return add_hidden_perturbation_from_minfo(extract(model, *args))
