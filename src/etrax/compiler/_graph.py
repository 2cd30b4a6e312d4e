"""The compiled `ETraceGraph`, the final `perturb` stage, and the pipeline itself:
``compile_etrace_graph = compose(extract, group, relate, rewrite, perturb)``."""

import enum
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import brainstate
import equinox as eqx

from .._frozen import FrozenDict
from .._typing import Path, PyTree, VarId
from ._diagnostics import EXCLUSION_KINDS, CompilationRecord, DiagnosticKind, DiagnosticLevel
from ._group import HiddenGroup, group
from ._module_info import ModuleInfo, extract
from ._perturb import HiddenPerturbation, add_hidden_perturbation_from_minfo
from ._relate import HiddenParamOpRelation, relate
from ._rewrite import RewrittenModule, rewrite

__all__ = [
    "ETraceGraph",
    "WeightRule",
    "WeightStatus",
    "compile_etrace_graph",
    "compose",
    "perturb",
]


class WeightRule(enum.Enum):
    """How a parameter learns under an online algorithm."""

    TRACED = "traced"
    """Traced through time by one or more relations (plus any instantaneous part)."""
    INSTANTANEOUS = "instantaneous"
    """Learns from its exact instantaneous gradient each step, not through time."""
    UNUSED = "unused"
    """Not read by the step: its gradient is zero."""


class WeightStatus(eqx.Module):
    """Why and how one ParamState learns (see `ETraceGraph.weight_rules`)."""

    path: Path = eqx.field(static=True)
    rule: WeightRule = eqx.field(static=True)
    reason: DiagnosticKind | None = eqx.field(static=True)
    relations: tuple[int, ...] = eqx.field(static=True)
    plain_use: bool = eqx.field(static=True)


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
    """

    module_info: ModuleInfo
    hidden_groups: tuple[HiddenGroup, ...]
    hidden_param_op_relations: tuple[HiddenParamOpRelation, ...]
    hidden_perturb: HiddenPerturbation | None
    diagnostics: tuple[CompilationRecord, ...] = eqx.field(static=True)

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
        """
        if kind is not None and not isinstance(kind, DiagnosticKind):
            raise TypeError(f"kind must be an etrax.DiagnosticKind, got {kind!r}")
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
        """For every ParamState of the model, how it learns and why."""
        traced: dict[Path, list[int]] = {}
        for rel in self.hidden_param_op_relations:
            for p in rel.weight_paths:
                traced.setdefault(p, []).append(rel.index)
        plain = {
            r.weight_path for r in self.diagnostics if r.kind is DiagnosticKind.WEIGHT_PLAIN_USE
        }
        paths = list(self.module_info.weight_paths)
        for r in self.diagnostics:
            if (
                r.kind is DiagnosticKind.STATE_MISMATCH
                and r.weight_path is not None
                and r.weight_path not in paths
            ):
                paths.append(r.weight_path)
        out: dict[Path, WeightStatus] = {}
        for p in paths:
            if p in traced:
                out[p] = WeightStatus(
                    path=p,
                    rule=WeightRule.TRACED,
                    reason=None,
                    relations=tuple(traced[p]),
                    plain_use=p in plain,
                )
                continue
            reason = None
            for r in self.diagnostics:
                if r.kind in EXCLUSION_KINDS and (
                    r.weight_path == p or p in r.context_dict.get("weight_paths", ())
                ):
                    reason = r.kind
                    break
            unused = reason is DiagnosticKind.STATE_MISMATCH
            out[p] = WeightStatus(
                path=p,
                rule=WeightRule.UNUSED if unused else WeightRule.INSTANTANEOUS,
                reason=reason,
                relations=(),
                plain_use=p in plain,
            )
        return out

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
        flat = self.module_info.flatten_inputs(tuple(args), old_state_vals)
        outs = self.hidden_perturb.eval_jaxpr(flat, perturb_data)
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


def perturb(rewritten: RewrittenModule, *, enabled: bool = True) -> ETraceGraph:
    """Add the hidden perturbation and assemble the `ETraceGraph` (stage 5).

    With ``enabled=False`` the graph has ``hidden_perturb=None``.
    """
    hp = add_hidden_perturbation_from_minfo(rewritten.module_info) if enabled else None
    return ETraceGraph(
        module_info=rewritten.module_info,
        hidden_groups=rewritten.hidden_groups,
        hidden_param_op_relations=rewritten.hidden_param_op_relations,
        hidden_perturb=hp,
        diagnostics=rewritten.diagnostics,
    )


def compose(*stages: Callable[..., Any]) -> Callable[..., Any]:
    """Chain stages: the first receives the call's arguments, each next one the
    previous result. ``compose(f, g, h)(*a) == h(g(f(*a)))``."""
    if not stages:
        raise ValueError("compose needs at least one stage")

    def composed(*args: Any) -> Any:
        out = stages[0](*args)
        for stage in stages[1:]:
            out = stage(out)
        return out

    composed.__doc__ = " → ".join(getattr(s, "__name__", repr(s)) for s in stages)
    return composed


def compile_etrace_graph(
    model: brainstate.nn.Module, *args: Any, include_hidden_perturb: bool = True
) -> ETraceGraph:
    """Compile a model's one-step ``update`` into an `ETraceGraph`.

    Runs ``compose(extract, group, relate, rewrite, perturb)``: every stage is a pure
    function of the previous stage's frozen output and returns its diagnostics as
    data (``graph.diagnostics``, ``graph.explain()``).

    **Arguments:**

    - `model`: a `brainstate.nn.Module` with initialised states.
    - `*args`: example positional inputs of one step.
    - `include_hidden_perturb`: also build the perturbed step that yields
      ``∂L/∂h^t`` (needed by single-step online learning).

    **Returns:** the `ETraceGraph`.

    !!! Example

        ```python
        gru = etrax.nn.GRUCell(3, 4)
        brainstate.nn.init_all_states(gru)
        graph = etrax.compile_etrace_graph(gru, jnp.zeros(3))
        print(graph.report())
        ```
    """
    pipeline = compose(
        extract, group, relate, rewrite, functools.partial(perturb, enabled=include_hidden_perturb)
    )
    graph = pipeline(model, *args)
    assert isinstance(graph, ETraceGraph)
    return graph
