"""The compiled `ETraceGraph`: the artifact every later layer reads."""

import difflib
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import StepInputError
from .._frozen import FrozenDict
from .._typing import Path, PyTree, VarId
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel
from ._group import HiddenGroup
from ._module_info import ModuleInfo
from ._perturbation import HiddenPerturbation
from ._relate import HiddenParamOpRelation
from ._uses import ParamUse, UseRule

__all__ = ["ETraceGraph", "GraphMemo", "WeightRule", "WeightStatus"]

_T = TypeVar("_T")


@final
class GraphMemo:
    """Derived static data of one graph that later layers compute on first use (the
    executor's input signature, an algorithm's plan, the argument types a driver has
    validated). Held in a declared field of `ETraceGraph`; never part of the graph's
    identity (all memos compare equal)."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}

    def get(self, key: str, build: Callable[[], _T]) -> _T:
        """The value stored under `key`, built by `build()` the first time."""
        if key not in self._data:
            self._data[key] = build()
        value: _T = self._data[key]
        return value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GraphMemo)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"GraphMemo({sorted(self._data)})"


class WeightRule(enum.Enum):
    """How a parameter learns under an online algorithm (summary of its uses)."""

    TRACED = "traced"
    """Every use is traced through time by a relation."""
    PARTLY_TRACED = "partly_traced"
    """Some use is traced; the other uses (or connections) add their exact
    instantaneous gradient."""
    INSTANTANEOUS = "instantaneous"
    """Learns from its exact instantaneous gradient each step, not through time."""
    UNUSED = "unused"
    """Not read by the step: its gradient is zero."""


class WeightStatus(eqx.Module):
    """Why and how one ParamState learns (see `ETraceGraph.weight_rules`).

    **Arguments:**

    - `path`: the ParamState.
    - `rule`: the summary `WeightRule` of its uses.
    - `reason`: why (part of) it is not traced, if so (the first untraced use's reason).
    - `relations`: the relations tracing it.
    - `plain_use`: whether a plain JAX operation reads it.
    - `uses`: every `ParamUse` reading it, each with its own `UseRule`.
    """

    path: Path = eqx.field(static=True)
    rule: WeightRule = eqx.field(static=True)
    reason: DiagnosticKind | None = eqx.field(static=True)
    relations: tuple[int, ...] = eqx.field(static=True)
    plain_use: bool = eqx.field(static=True)
    uses: tuple[ParamUse, ...] = eqx.field(static=True, default=())


def _record_paths(r: CompilationRecord) -> tuple[Path, ...]:
    """The state paths a record names (its weight, the other weights of its op, its
    hidden states)."""
    weights = r.context_dict.get("weight_paths", ())
    own = () if r.weight_path is None else (r.weight_path,)
    return (*own, *(tuple(p) for p in weights if isinstance(p, tuple)), *r.hidden_paths)


class ETraceGraph(eqx.Module):
    """A model's one-step function compiled for eligibility-trace learning.

    A frozen, leaf-free pytree: pass it to `jax.jit` as a static value or close
    over it. Build it with `compile_etrace_graph`.

    **Arguments:**

    - `module_info`: the traced (and rewritten) step, see `ModuleInfo`.
    - `hidden_groups`: the `HiddenGroup`s, in compiled order.
    - `hidden_param_op_relations`: the `HiddenParamOpRelation`s, in step order.
    - `hidden_perturb`: the `HiddenPerturbation`, or `None` if not requested.
    - `diagnostics`: every `CompilationRecord`, in emission order.
    - `param_uses`: every use of every ParamState, with its `UseRule`.
    - `memo`: derived static data later layers build once per graph (`GraphMemo`).
    """

    module_info: ModuleInfo
    hidden_groups: tuple[HiddenGroup, ...]
    hidden_param_op_relations: tuple[HiddenParamOpRelation, ...]
    hidden_perturb: HiddenPerturbation | None
    diagnostics: tuple[CompilationRecord, ...] = eqx.field(static=True)
    param_uses: tuple[ParamUse, ...] = eqx.field(static=True, default=())
    memo: GraphMemo = eqx.field(static=True, default_factory=GraphMemo, repr=False)

    def __hash__(self) -> int:
        cached = self.__dict__.get("_etrax_hash")
        if cached is None:
            cached = hash(
                (
                    self.module_info,
                    self.hidden_groups,
                    self.hidden_param_op_relations,
                    self.hidden_perturb,
                    self.diagnostics,
                    self.param_uses,
                )
            )
            object.__setattr__(self, "_etrax_hash", cached)
        return int(cached)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ETraceGraph):
            return NotImplemented
        return bool(
            self.module_info == other.module_info
            and self.hidden_groups == other.hidden_groups
            and self.hidden_param_op_relations == other.hidden_param_op_relations
            and self.hidden_perturb == other.hidden_perturb
            and self.diagnostics == other.diagnostics
            and self.param_uses == other.param_uses
        )

    def __check_init__(self) -> None:
        for i, g in enumerate(self.hidden_groups):
            if g.index != i:
                raise ValueError(f"hidden group at position {i} has index {g.index}")
        for i, r in enumerate(self.hidden_param_op_relations):
            if r.index != i:
                raise ValueError(f"relation at position {i} has index {r.index}")

    @property
    def hid_path_to_group(self) -> FrozenDict[Path, HiddenGroup]:
        """Hidden path → its `HiddenGroup`."""
        return FrozenDict({p: g for g in self.hidden_groups for p in g.hidden_paths})

    @property
    def relations(self) -> tuple[HiddenParamOpRelation, ...]:
        return self.hidden_param_op_relations

    def explain(
        self,
        *,
        weight_path: Path | None = None,
        hidden_path: Path | None = None,
        kind: DiagnosticKind | None = None,
    ) -> tuple[CompilationRecord, ...]:
        """The diagnostics matching every given filter, in emission order.

        **Arguments:**

        - `weight_path`: keep records about this ParamState.
        - `hidden_path`: keep records mentioning this hidden state.
        - `kind`: keep records of this `DiagnosticKind`.

        **Raises:** `TypeError` for a path that is not a tuple (``('rnn', 'W')``, not
        ``'rnn.W'``) or a `kind` that is not a `DiagnosticKind`; `KeyError` for a path
        that names no state of the model (with the closest paths it has), so that a
        typo does not read as "no diagnostics".
        """
        if kind is not None and not isinstance(kind, DiagnosticKind):
            raise TypeError(f"kind must be an etrax.DiagnosticKind, got {kind!r}")
        mi = self.module_info
        known: set[Path] | None = None  # built when a path is given
        filters: list[tuple[str, object]] = [
            ("weight_path", weight_path),
            ("hidden_path", hidden_path),
        ]
        for name, given in filters:  # as passed (the type checker is not always on)
            if given is None:
                continue
            if not isinstance(given, tuple | list):
                example = mi.paths[0] if mi.paths else ("W",)
                raise TypeError(
                    f"{name} must be a path, a tuple such as {example!r} "
                    f"(graph.module_info.paths lists them), got {given!r}"
                )
            if known is None:
                known = set(mi.paths) | {p for r in self.diagnostics for p in _record_paths(r)}
            if tuple(given) not in known:
                close = difflib.get_close_matches(
                    str(tuple(given)), [str(p) for p in known], n=3, cutoff=0.5
                )
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                raise KeyError(
                    f"{name} {tuple(given)!r} names no state of this model.{hint} "
                    "graph.module_info.paths lists them."
                )
        out = []
        for r in self.diagnostics:
            if (
                weight_path is not None
                and r.weight_path != tuple(weight_path)
                and tuple(weight_path) not in r.context_dict.get("weight_paths", ())
            ):
                continue
            if hidden_path is not None and tuple(hidden_path) not in r.hidden_paths:
                continue
            if kind is not None and r.kind is not kind:
                continue
            out.append(r)
        return tuple(out)

    def weight_rules(self) -> dict[Path, WeightStatus]:
        """For every ParamState of the model, how it learns and why, use by use."""
        uses: dict[Path, list[ParamUse]] = {p: [] for p in self.module_info.weight_paths}
        for u in self.param_uses:
            for p in u.paths:
                uses.setdefault(p, []).append(u)
        for r in self.diagnostics:
            if r.kind is DiagnosticKind.STATE_MISMATCH and r.weight_path is not None:
                uses.setdefault(r.weight_path, [])
        return {p: _status(p, us) for p, us in uses.items()}

    def report(self) -> "Any":
        """The `CompilationReport` of this graph."""
        from ._report import CompilationReport

        return CompilationReport(self)

    def call_hidden_perturb(
        self,
        args: Sequence[Any],
        perturb_data: Sequence[Any],
        old_state_vals: Mapping[Path, PyTree] | None = None,
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Path, PyTree], dict[VarId, Any]]:
        """Evaluate the perturbed step.

        **Arguments:**

        - `args`: the step's positional inputs, as a tuple.
        - `perturb_data`: one perturbation per hidden state (zeros for the plain step).
        - `old_state_vals`: ``path → value`` of every compiled state (default: current values).

        **Returns:** ``(out, new hidden values, new other values, hoisted values)``.
        """
        if self.hidden_perturb is None:
            raise ValueError(
                "this graph was compiled with include_hidden_perturb=False; recompile with "
                "include_hidden_perturb=True to use call_hidden_perturb"
            )
        hp, mi = self.hidden_perturb, self.module_info
        given = [tuple(jnp.shape(a)) for a in jax.tree.leaves(tuple(args))]
        expected = [tuple(shape) for shape, _ in mi.in_avals]
        if jax.tree.structure(tuple(args)) != mi.in_tree or given != expected:
            raise StepInputError(
                f"call_hidden_perturb: the step inputs have shapes {given}, expected "
                f"{expected} (the graph's example inputs)"
            )
        shapes = [tuple(jnp.shape(d)) for d in perturb_data]
        if shapes != [tuple(s) for s in hp.shapes]:
            raise StepInputError(
                f"call_hidden_perturb: perturbations of shapes {shapes}, expected one per hidden "
                f"state {list(hp.perturb_hidden_paths)} shaped {[tuple(s) for s in hp.shapes]}"
            )
        flat = mi.flatten_inputs(tuple(args), old_state_vals)
        outs = hp.eval_jaxpr(flat, perturb_data)
        return self.module_info.split_outputs(outs)

    def __repr__(self) -> str:
        lines = [f"ETraceGraph({self.module_info.model_name or 'model'}:"]
        for g in self.hidden_groups:
            flag = "" if g.is_diagonal_recurrence else " (mixes positions)"
            lines.append(
                f"  group {g.index}: {list(g.hidden_paths)} S={g.num_state} "
                f"varshape={g.varshape}{flag}"
            )
        for r in self.hidden_param_op_relations:
            lines.append(
                f"  relation {r.index}: {r.primitive.name} {r.weight_path} -> groups "
                f"{list(r.hidden_groups)}"
            )
        n_warn = sum(r.level is DiagnosticLevel.WARNING for r in self.diagnostics)
        lines.append(f"  diagnostics: {len(self.diagnostics)} ({n_warn} warnings)")
        return "\n".join(lines) + "\n)"

    __str__ = __repr__

    def dict(self) -> dict[str, Any]:
        """The six public fields as a dict."""
        return {
            "module_info": self.module_info,
            "hidden_groups": self.hidden_groups,
            "hid_path_to_group": self.hid_path_to_group,
            "hidden_param_op_relations": self.hidden_param_op_relations,
            "hidden_perturb": self.hidden_perturb,
            "diagnostics": self.diagnostics,
        }


def _status(path: Path, uses: Sequence[ParamUse]) -> WeightStatus:
    rules = {u.rule for u in uses}
    if not uses:
        rule = WeightRule.UNUSED
    elif rules == {UseRule.TRACED}:
        rule = WeightRule.TRACED
    elif rules == {UseRule.INSTANTANEOUS}:
        rule = WeightRule.INSTANTANEOUS
    else:
        rule = WeightRule.PARTLY_TRACED
    reasons = [u.reason for u in uses if u.reason is not None]
    if not uses:
        reasons = [DiagnosticKind.STATE_MISMATCH]
    return WeightStatus(
        path=path,
        rule=rule,
        reason=reasons[0] if reasons else None,
        relations=tuple(dict.fromkeys(u.relation for u in uses if u.relation is not None)),
        plain_use=any(u.reason is DiagnosticKind.WEIGHT_PLAIN_USE for u in uses),
        uses=tuple(uses),
    )
