"""`CompilationReport`: a readable summary of a compiled graph."""

from typing import TextIO

from .._typing import Path
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel
from ._graph import ETraceGraph, WeightRule

__all__ = ["CompilationReport", "untraceable_hidden_paths"]

_RULE = "=" * 100


def untraceable_hidden_paths(graph: ETraceGraph) -> tuple[Path, ...]:
    """The HiddenStates of `graph` that could not be traced (not one floating-point
    array: the `hidden_state_not_float` records), in the records' order."""
    found = (
        p for r in graph.explain(kind=DiagnosticKind.HIDDEN_STATE_NOT_FLOAT) for p in r.hidden_paths
    )
    return tuple(dict.fromkeys(found))


class CompilationReport:
    """A read-only view of an `ETraceGraph` for people: which hidden states were
    grouped, which weights are traced into which groups, and which weights are not
    traced and why. `str(report)` is the text `show_graph` prints."""

    def __init__(self, graph: ETraceGraph) -> None:
        if not isinstance(graph, ETraceGraph):
            raise TypeError(f"CompilationReport expects an ETraceGraph, got {type(graph).__name__}")
        self.graph = graph

    @property
    def hidden_groups(self) -> list[tuple[int, tuple[Path, ...]]]:
        return [(g.index, g.hidden_paths) for g in self.graph.hidden_groups]

    @property
    def etrace_weights(self) -> list[tuple[Path, tuple[int, ...]]]:
        """``(weight path, connected groups)`` per relation."""
        return [(r.weight_path, r.hidden_groups) for r in self.graph.hidden_param_op_relations]

    @property
    def excluded_weights(self) -> list[tuple[Path, str | None]]:
        """``(path, reason)`` for every ParamState not traced by any relation."""
        out = []
        for path, status in self.graph.weight_rules().items():
            if status.rule is not WeightRule.TRACED:
                out.append((path, status.reason.value if status.reason is not None else None))
        return out

    @property
    def dynamic_states(self) -> list[Path]:
        return [s.path for s in self.graph.module_info.other_states if s.written]

    @property
    def counts(self) -> dict[str, int]:
        diags = self.graph.diagnostics
        return {
            "hidden_groups": len(self.graph.hidden_groups),
            "etrace_weights": len(self.etrace_weights),
            "excluded_weights": len(self.excluded_weights),
            "warnings": sum(r.level is DiagnosticLevel.WARNING for r in diags),
            "errors": sum(r.level is DiagnosticLevel.ERROR for r in diags),
        }

    def to_str(self, level: int = 1) -> str:
        """The report text; ``level=2`` also lists every warning and error."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(
                f"level must be 1 (the summary) or 2 (every warning too), got {level!r}"
            )
        g = self.graph
        name = g.module_info.model_name or "model"
        lines = [_RULE, f"etrax graph of {name}", ""]
        lines.append(f"Hidden groups ({len(g.hidden_groups)}):")
        for grp in g.hidden_groups:
            notes = []
            if not grp.has_recurrence:
                notes.append("no element-wise recurrence")
            if not grp.is_diagonal_recurrence:
                notes.append(f"mixes positions: {grp.mixing_reason}")
            note = f"  [{'; '.join(notes)}]" if notes else ""
            lines.append(
                f"   Group {grp.index}: {list(grp.hidden_paths)}  S={grp.num_state}, "
                f"positions {grp.varshape}{note}"
            )
        lines.append("")
        carried = {
            p: dict(r.context).get("weight_paths", ())
            for r in g.explain(kind=DiagnosticKind.CARRIED_STATE_ROUTE)
            for p in r.hidden_paths
        }
        if self.dynamic_states:
            lines.append("States carried across steps but not traced:")
            untraceable = set(untraceable_hidden_paths(g))
            for i, p in enumerate(self.dynamic_states):
                note = (
                    f"  [carries the influence of {list(carried[p])} to the next step: "
                    "see carried_state_route]"
                    if p in carried
                    else "  [a HiddenState that cannot be traced: see hidden_state_not_float]"
                    if p in untraceable
                    else ""
                )
                lines.append(f"   State {i}: {p}{note}")
            lines.append("")
        if g.hidden_param_op_relations:
            lines.append("Weights traced online:")
            for rel in g.hidden_param_op_relations:
                groups = rel.hidden_groups
                where = (
                    f"hidden group {groups[0]}"
                    if len(groups) == 1
                    else f"hidden groups {list(groups)}"
                )
                caveats = "; ".join(self._relation_notes(rel.index))
                extra = f"  ({caveats})" if caveats else ""
                name = rel.primitive.name
                lines.append(
                    f"   Weight {rel.index}: {rel.weight_path} via {name} -> {where}{extra}"
                )
            lines.append("")
        recognised = g.explain(kind=DiagnosticKind.WEIGHT_OP_RECOGNISED)
        if recognised:
            lines.append("Weight operations recognised automatically (no etrax op in the model):")
            lines.extend(f"   {r.message}" for r in recognised)
            lines.append("")
        rules = self.graph.weight_rules()
        unused = {p for p, st in rules.items() if st.rule is WeightRule.UNUSED}
        excluded = [(p, why) for p, why in self.excluded_weights if p not in unused]
        if excluded:
            lines.append("Weights not (wholly) traced through time (exact instantaneous gradient):")
            for i, (path, reason) in enumerate(excluded):
                why = f"  ({reason})" if reason else ""
                lines.append(f"   Weight {i}: {path}{why}")
            lines.append("")
        if unused:
            lines.append(
                "Weights the step never reads, or reads only into values nothing uses "
                "(nothing to learn: left out of the compiled state's params, the gradients "
                "and learner.params, or, if read by dead code only, kept with a zero "
                "gradient):"
            )
            lines.extend(f"   {path}" for path in rules if path in unused)
            lines.append("")
        lines.extend(self._parameter_lines())
        warnings = sum(r.level is DiagnosticLevel.WARNING for r in g.diagnostics)
        if level < 2 and warnings:
            lines.append(
                f"{warnings} warning(s): report().to_str(2) or graph.explain() lists them."
            )
            lines.append("")
        if level >= 2:
            notable = [r for r in g.diagnostics if r.level is not DiagnosticLevel.INFO]
            if notable:
                lines.append("Warnings and errors:")
                for r in notable:
                    lines.append(f"   [{r.level.value}] {r.kind.value}: {r.message}")
                lines.append("")
        return "\n".join(lines) + "\n"

    def _relation_notes(self, index: int) -> list[str]:
        """Why relation `index`'s traces are not its weight's whole gradient, if so:
        each note names the diagnostic that explains it."""
        g = self.graph
        rel = g.hidden_param_op_relations[index]
        groups = set(rel.hidden_groups)
        members = {p for grp in g.hidden_groups if grp.index in groups for p in grp.hidden_paths}

        def context(r: CompilationRecord, key: str) -> tuple[object, ...]:
            found: tuple[object, ...] = dict(r.context).get(key, ())
            return found

        unread = {
            i for r in g.explain(kind=DiagnosticKind.HIDDEN_GROUP_NOT_READ)
            for i in context(r, "hidden_group_indices")
        }  # fmt: skip
        notes: list[str] = []
        if groups <= unread:
            notes.append(
                "no learning signal: the group reaches the outputs only in later steps; see "
                "hidden_group_not_read"
            )
        if rel.partial_path:
            notes.append("partial: an indirect path is not traced")
        if any(not t.is_diagonal for t in rel.tails):
            notes.append("approximate: the path to the hidden state mixes positions")
        if any(
            members & set(r.hidden_paths)
            for r in g.explain(kind=DiagnosticKind.RECURRENT_CONSTANT_PRODUCT)
        ):
            notes.append(
                "approximate: a product in the recurrence is left out of D; see "
                "recurrent_constant_product"
            )
        for r in g.explain(kind=DiagnosticKind.CARRIED_STATE_ROUTE):
            if rel.weight_path in context(r, "weight_paths"):
                notes.append(
                    f"approximate: {r.hidden_paths[0]} carries its influence to later steps; "
                    "see carried_state_route"
                )
        for r in g.explain(kind=DiagnosticKind.CROSS_GROUP_ROUTE):
            indices = context(r, "hidden_group_indices")
            if indices and indices[0] in groups:
                notes.append(
                    f"diagonal approximation: its group feeds hidden groups {list(indices[1:])}; "
                    "see cross_group_route"
                )
        for r in g.explain(kind=DiagnosticKind.RECURRENT_WEIGHT_ROUTE):
            indices = context(r, "hidden_group_indices")
            if indices and indices[0] in groups:
                notes.append(
                    "diagonal approximation: a weight reads its group's previous values; see "
                    "recurrent_weight_route"
                )
        return notes

    def _parameter_lines(self) -> list[str]:
        """Every ParamState, its rule, and each of its uses with its own rule."""
        rules = self.graph.weight_rules()
        lines = [f"Parameters ({len(rules)}), use by use:"]
        for path, status in rules.items():
            lines.append(f"   {path}: {status.rule.value}")
            for u in status.uses:
                how = u.rule.value
                if u.relation is not None:
                    how += f" by relation {u.relation}"
                if u.reason is not None:
                    how += f" ({u.reason.value})"
                what = "output" if u.eqn_index is None else f"{u.primitive} operand {u.slot}"
                lines.append(f"      {what} at {u.location}: {how}")
            if not status.uses and status.reason is not None:
                lines.append(f"      ({status.reason.value})")
        lines.append("")
        return lines

    def show(self, level: int = 1, file: TextIO | None = None) -> None:
        print(self.to_str(level), file=file)

    def __str__(self) -> str:
        return self.to_str(1)

    def __repr__(self) -> str:
        c = self.counts
        inner = ", ".join(f"{k}={v}" for k, v in c.items())
        return f"CompilationReport({inner})"
