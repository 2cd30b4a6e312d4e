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

from collections.abc import Sequence
from dataclasses import dataclass

from .._compat import JaxprEqn, Var, aval_of
from .._typing import Path
from ..ops import etp_spec
from ._jaxpr import VarTable
from ._module_info import ModuleInfo
from ._positions import AlignMap, Mixed, analyse, identity_align, positions_rule

__all__ = ["StepAnalysis", "analyse_step", "is_boundary_equation"]


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


@dataclass(frozen=True)
class StepAnalysis:
    """Result of `analyse_step` (a transient helper; never stored in artifacts)."""

    table: VarTable
    maps: dict[Var, AlignMap]
    boundaries: frozenset[int]
    hidden_sources: dict[Path, int]
    etp_equations: tuple[int, ...]
    y_sources: dict[int, int]

    def derived_from(self, var: object, sources: set[int]) -> bool:
        m = self.maps.get(var, {}) if isinstance(var, Var) else {}
        return any(s in sources for s in m)

    def equation_derives(self, index: int, sources: set[int]) -> bool:
        eqn = self.table.jaxpr.eqns[index]
        return any(self.derived_from(v, sources) for v in eqn.invars)


def analyse_step(minfo: ModuleInfo) -> StepAnalysis:
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
        minfo.jaxpr, seeds, lambda i, eqn, in_maps: is_boundary_equation(eqn, in_maps)
    )
    return StepAnalysis(
        table=table,
        maps=maps,
        boundaries=frozenset(boundaries),
        hidden_sources=hidden_sources,
        etp_equations=etp,
        y_sources=y_sources,
    )
