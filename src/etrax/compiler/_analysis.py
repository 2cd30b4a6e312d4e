"""The shared data-flow analysis of a step, used by the `group` and `relate` stages.

Sources are the hidden states' old values and every ETP op's output ``y``. An
equation is a *boundary* (its outputs count as constants) when it is

- a trainable ETP op (not gradient-enabled): a weight between two hidden values;
- ``stop_gradient``;
- a plain ``dot_general`` / ``conv_general_dilated`` that mixes the positions of
  a source-derived operand (a recurrent weight used through plain JAX).

Transitions, tails, the perturbation and group membership all use this single
boundary notion, so they agree by construction.
"""

import functools
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

from .._compat import JaxprEqn, Var, aval_of
from .._typing import Path
from ..ops import etp_spec
from ._jaxpr import VarTable
from ._module_info import ModuleInfo
from ._positions import AlignMap, Mixed, analyse, identity_align, positions_rule

__all__ = ["Analyses", "StepAnalysis", "analyse_step", "is_boundary_equation"]


def _no_recurse(body: object, maps: Sequence[AlignMap]) -> list[AlignMap]:  # pragma: no cover
    raise AssertionError("dot_general has no sub-jaxpr")


def is_boundary_equation(eqn: JaxprEqn, in_maps: Sequence[AlignMap]) -> bool:
    """Whether an equation with source-derived inputs cuts the paths through it."""
    spec = etp_spec(eqn.primitive)
    if spec is not None:
        return not spec.gradient_enabled
    name = eqn.primitive.name
    if name == "stop_gradient":
        return True
    if name == "conv_general_dilated":
        return True
    if name == "dot_general":
        (out,) = positions_rule(eqn, in_maps, _no_recurse)
        return any(isinstance(a, Mixed) for a in out.values())
    return False


@dataclass(frozen=True, eq=False)
class StepAnalysis:
    """The data-flow analysis of a step, seen from one set of cut variables.

    `cuts` are new values of hidden groups that are *linked* to the group this
    analysis serves (groups of other shapes that feed it within the step): routes
    through them count as crossing a boundary, exactly like a stacked layer.
    Identity equality: an analysis is derived data, carried between stages but
    never part of the final graph's identity.
    """

    table: VarTable
    maps: dict[Var, AlignMap]
    boundaries: frozenset[int]
    hidden_sources: dict[Path, int]
    etp_equations: tuple[int, ...]
    y_sources: dict[int, int]
    cuts: frozenset[Var] = frozenset()

    def derived_from(self, var: object, sources: Set[int]) -> bool:
        m = self.maps.get(var, {}) if isinstance(var, Var) and var not in self.cuts else {}
        return any(s in sources for s in m)

    def equation_derives(self, index: int, sources: Set[int]) -> bool:
        eqn = self.table.jaxpr.eqns[index]
        return any(self.derived_from(v, sources) for v in eqn.invars)

    def slice_filter(self, sources: set[int]) -> Callable[[int], bool]:
        """The equations a transition or tail from `sources` keeps: not boundaries,
        derived from the sources, and not producing a cut variable."""
        return functools.partial(self._keeps, frozenset(sources))

    def _keeps(self, sources: frozenset[int], i: int) -> bool:
        if i in self.boundaries or not self.equation_derives(i, sources):
            return False
        return not any(v in self.cuts for v in self.table.jaxpr.eqns[i].outvars)


def analyse_step(minfo: ModuleInfo, cuts: frozenset[Var] = frozenset()) -> StepAnalysis:
    """Run the position/data-flow analysis over a step (deterministic)."""
    table = VarTable(minfo.jaxpr)
    seeds: dict[Var, AlignMap] = {}
    hidden_sources: dict[Path, int] = {}
    for k, s in enumerate(minfo.hidden_states):
        hidden_sources[s.path] = k
        v = table.var(s.invars[0])
        seeds.setdefault(v, {})[k] = identity_align(s.varshape)
    etp = tuple(i for i, e in enumerate(minfo.jaxpr.eqns) if etp_spec(e.primitive) is not None)
    y_sources: dict[int, int] = {}
    offset = len(hidden_sources)
    for n, i in enumerate(etp):
        eqn = minfo.jaxpr.eqns[i]
        y = eqn.outvars[0]
        src = offset + n
        y_sources[i] = src
        if isinstance(y, Var):
            seeds.setdefault(y, {})[src] = identity_align(tuple(aval_of(y).shape))
    maps, boundaries = analyse(
        minfo.jaxpr, seeds, lambda i, eqn, in_maps: is_boundary_equation(eqn, in_maps), cuts
    )
    return StepAnalysis(
        table=table,
        maps=maps,
        boundaries=frozenset(boundaries),
        hidden_sources=hidden_sources,
        etp_equations=etp,
        y_sources=y_sources,
        cuts=cuts,
    )


@dataclass(frozen=True, eq=False)
class Analyses:
    """The analyses of a step: one shared `base`, plus one per *linked* hidden group
    (keyed by group index) whose routes through its linked groups' new values are cut.
    Computed once by `group` and passed forward to `relate`, `rewrite` and `perturb`."""

    base: StepAnalysis
    per_group: dict[int, StepAnalysis]

    def for_group(self, index: int) -> StepAnalysis:
        return self.per_group.get(index, self.base)
