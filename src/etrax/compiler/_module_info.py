"""Stage 1, `extract`: trace a model's one-step ``update`` once and describe it.

The result, `ModuleInfo`, is pure metadata: the flat jaxpr of the step (nested
``jit`` inlined), where every state's leaves enter and leave it, and each state's
role (weight, hidden or other). Nothing here mutates a brainstate state.
"""

import dataclasses
import enum
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Final, final

import brainstate
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._compat import (
    ClosedJaxpr,
    Jaxpr,
    equation_location,
    inner_closed_jaxprs,
    is_tracer,
    replace_outvars,
)
from .._errors import (
    InputStructureError,
    NotSupportedError,
    ParamStateWriteError,
    RecursiveCompileError,
    StateNotInitializedError,
    StateShapeChangedError,
    WeightNotFloatError,
)
from .._typing import Path, PyTree, Shape, VarId
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel, record
from ._jaxpr import Program, VarTable, inline_calls

__all__ = [
    "ModuleInfo",
    "StateInfo",
    "StateKind",
    "StateRefs",
    "extract",
    "extract_module_info",
]


class StateKind(enum.Enum):
    """The role of a brainstate state in the compiled step."""

    WEIGHT = "weight"
    HIDDEN = "hidden"
    OTHER = "other"


class StateInfo(eqx.Module):
    """Static description of one state of the step.

    **Arguments:**

    - `path`: the state's path in ``model.states()``.
    - `kind`: its `StateKind`.
    - `type_name`: the brainstate class name.
    - `treedef`: structure of its value (a ParamState may hold a dict of arrays).
    - `shapes`, `dtypes`: shape and dtype of each leaf.
    - `invars`: `VarId` of each leaf where it enters the step.
    - `outvars`: `VarId` of each leaf's new value (`None` for a literal).
    - `written`: whether the step writes the state.
    - `varshape`, `num_state`: for a hidden state, its positions and the number of
      states it stacks on a trailing axis (1 for a plain `HiddenState`).
    """

    path: Path = eqx.field(static=True)
    kind: StateKind = eqx.field(static=True)
    type_name: str = eqx.field(static=True)
    treedef: Any = eqx.field(static=True)
    shapes: tuple[Shape, ...] = eqx.field(static=True)
    dtypes: tuple[np.dtype[Any], ...] = eqx.field(static=True)
    invars: tuple[VarId, ...] = eqx.field(static=True)
    outvars: tuple[VarId | None, ...] = eqx.field(static=True)
    written: bool = eqx.field(static=True)
    varshape: Shape = eqx.field(static=True, default=())
    num_state: int = eqx.field(static=True, default=1)

    @property
    def is_stacked(self) -> bool:
        """Whether the hidden value stacks several states on its last axis."""
        return (
            self.type_name != "HiddenState"
            and self.kind is StateKind.HIDDEN
            and len(self.shapes[0]) == len(self.varshape) + 1
        )


@final
class StateRefs:
    """The brainstate `State` objects of a compiled model, in compiled order.

    Held only so that facades can read current values and write new ones back;
    the pipeline itself never mutates them. Equality is by identity of the
    referenced states.
    """

    __slots__ = ("states",)

    states: Final[tuple[brainstate.State[Any], ...]]  # type: ignore[misc]

    def __init__(self, states: Sequence[brainstate.State[Any]]) -> None:
        object.__setattr__(self, "states", tuple(states))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StateRefs):
            return NotImplemented
        return len(self.states) == len(other.states) and all(
            a is b for a, b in zip(self.states, other.states, strict=True)
        )

    def __hash__(self) -> int:
        return hash(tuple(hash(s) for s in self.states))

    def __repr__(self) -> str:
        return f"StateRefs({len(self.states)} states)"


class ModuleInfo(eqx.Module):
    """The traced one-step function of a model and where its states live in it.

    The step's jaxpr has inputs ``[flat args..., flat state values...]`` and outputs
    ``[flat model outputs..., flat new state values..., hoisted values...]``; the
    hoisted values are intermediates later stages ask for (`add_jaxpr_outs`).
    """

    program: Program = eqx.field(static=True)
    states: tuple[StateInfo, ...] = eqx.field(static=True)
    state_refs: StateRefs = eqx.field(static=True)
    in_tree: Any = eqx.field(static=True)
    in_avals: tuple[tuple[Shape, np.dtype[Any]], ...] = eqx.field(static=True)
    out_tree: Any = eqx.field(static=True)
    num_var_out: int = eqx.field(static=True)
    num_var_state: int = eqx.field(static=True)
    hoisted: tuple[VarId, ...] = eqx.field(static=True, default=())
    diagnostics: tuple[CompilationRecord, ...] = eqx.field(static=True, default=())
    model_name: str = eqx.field(static=True, default="")

    # ----- views -------------------------------------------------------------------
    @property
    def closed_jaxpr(self) -> ClosedJaxpr:
        return self.program.closed

    @property
    def jaxpr(self) -> Jaxpr:
        return self.program.jaxpr

    @property
    def num_in(self) -> int:
        return len(self.in_avals)

    def states_of(self, kind: StateKind) -> tuple[StateInfo, ...]:
        return tuple(s for s in self.states if s.kind is kind)

    @property
    def weight_states(self) -> tuple[StateInfo, ...]:
        return self.states_of(StateKind.WEIGHT)

    @property
    def hidden_states(self) -> tuple[StateInfo, ...]:
        return self.states_of(StateKind.HIDDEN)

    @property
    def other_states(self) -> tuple[StateInfo, ...]:
        return self.states_of(StateKind.OTHER)

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(s.path for s in self.states)

    @property
    def weight_paths(self) -> tuple[Path, ...]:
        return tuple(s.path for s in self.weight_states)

    @property
    def hidden_paths(self) -> tuple[Path, ...]:
        return tuple(s.path for s in self.hidden_states)

    @property
    def hidden_path_to_invar(self) -> dict[Path, VarId]:
        return {s.path: s.invars[0] for s in self.hidden_states}

    @property
    def hidden_path_to_outvar(self) -> dict[Path, VarId | None]:
        return {s.path: s.outvars[0] for s in self.hidden_states}

    @property
    def weight_path_to_invars(self) -> dict[Path, tuple[VarId, ...]]:
        return {s.path: s.invars for s in self.weight_states}

    def state_info(self, path: Path) -> StateInfo:
        for s in self.states:
            if s.path == path:
                return s
        raise KeyError(f"no state with path {path!r}; known paths: {list(self.paths)}")

    def state_out_atoms(self, path: Path) -> list[Any]:
        """The jaxpr output atoms (Vars or literals) of a state's new value."""
        outvars = self.jaxpr.outvars
        pos = self.num_var_out
        for s in self.states:
            n = len(s.invars)
            if s.path == path:
                return list(outvars[pos : pos + n])
            pos += n
        raise KeyError(f"no state with path {path!r}")

    def split_state_outvars(
        self,
    ) -> tuple[tuple[tuple[VarId | None, ...], ...], ...]:
        """The new-value `VarId`s of weight, hidden and other states (compiled order)."""
        return tuple(
            tuple(s.outvars for s in self.states_of(kind))
            for kind in (StateKind.WEIGHT, StateKind.HIDDEN, StateKind.OTHER)
        )

    # ----- transformations -----------------------------------------------------------
    def add_jaxpr_outs(self, var_ids: Sequence[VarId]) -> "ModuleInfo":
        """A copy whose step also returns the values of `var_ids` (after the existing
        outputs, in order, skipping ids already hoisted)."""
        table = VarTable(self.jaxpr)
        new = [v for v in dict.fromkeys(var_ids) if v not in self.hoisted]
        if not new:
            return self
        jaxpr = self.jaxpr
        extended = replace_outvars(jaxpr, [*jaxpr.outvars, *(table.var(v) for v in new)])
        program = Program(
            ClosedJaxpr(extended, self.closed_jaxpr.consts),
            self.program.input_ids,
            [*self.program.output_ids, *new],
        )
        return dataclasses.replace(self, program=program, hoisted=(*self.hoisted, *new))

    # ----- evaluation ------------------------------------------------------------------
    def current_state_values(self) -> dict[Path, PyTree]:
        """Read the current value of every compiled state (path → value)."""
        return {
            s.path: ref.value for s, ref in zip(self.states, self.state_refs.states, strict=True)
        }

    def flatten_inputs(
        self, args: Sequence[Any], state_vals: Mapping[Path, PyTree] | None
    ) -> list[Any]:
        """The step's flat inputs from positional args and a path → value mapping."""
        if state_vals is None:
            state_vals = self.current_state_values()
        flat = list(jax.tree.leaves(tuple(args)))
        for s in self.states:
            flat.extend(jax.tree.leaves(state_vals[s.path]))
        return flat

    def split_outputs(
        self, outs: Sequence[Any]
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Path, PyTree], dict[VarId, Any]]:
        """Split flat step outputs into ``(out, hidden, other, hoisted)``."""
        out = jax.tree.unflatten(self.out_tree, list(outs[: self.num_var_out]))
        pos = self.num_var_out
        hidden: dict[Path, PyTree] = {}
        other: dict[Path, PyTree] = {}
        for s in self.states:
            n = len(s.invars)
            value = jax.tree.unflatten(s.treedef, list(outs[pos : pos + n]))
            pos += n
            if s.kind is StateKind.HIDDEN:
                hidden[s.path] = value
            elif s.kind is StateKind.OTHER:
                other[s.path] = value
        hoisted = dict(zip(self.hoisted, outs[pos:], strict=True))
        return out, hidden, other, hoisted

    def jaxpr_call(
        self, *args: Any, old_state_vals: Mapping[Path, PyTree] | None = None
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Path, PyTree], dict[VarId, Any]]:
        """Evaluate the step.

        **Arguments:**

        - `*args`: the step's positional inputs.
        - `old_state_vals`: ``path → value`` of every compiled state; defaults to the
          states' current values (read, never written).

        **Returns:** ``(out, new hidden values, new other values, hoisted)`` where
        `hoisted` maps each hoisted `VarId` to its value. Weights are unchanged by
        construction and not returned.
        """
        flat = self.flatten_inputs(args, old_state_vals)
        outs = self.program(*flat)
        return self.split_outputs(outs)


# ---------------------------------------------------------------------------------------
# extract


def _value_has_tracer(value: PyTree) -> bool:
    return any(is_tracer(leaf) for leaf in jax.tree.leaves(value))


def _overrides_init_state(module: brainstate.nn.Module) -> bool:
    return type(module).init_state is not brainstate.nn.Module.init_state


def _check_initialised(model: brainstate.nn.Module, states: Mapping[Path, Any]) -> None:
    has_short_term = any(isinstance(s, brainstate.ShortTermState) for s in states.values())
    if has_short_term:
        return
    needs = [
        path for path, m in model.nodes(brainstate.nn.Module).items() if _overrides_init_state(m)
    ]
    if needs:
        where = ", ".join(repr(p) if p else "the model itself" for p in needs)
        raise StateNotInitializedError(
            f"{type(model).__name__} has no hidden or short-term states yet, but "
            f"{where} define init_state(). Call brainstate.nn.init_all_states(model) "
            "(with batch_size=... for a batched model) before compiling."
        )


def _check_signature(model: brainstate.nn.Module, args: tuple[Any, ...]) -> None:
    try:
        sig = inspect.signature(model.update)
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return
    try:
        sig.bind(*args)
    except TypeError as err:
        raise InputStructureError(
            f"The example inputs do not match {type(model).__name__}.update{sig}: {err}. "
            f"Pass exactly the positional arguments update() takes (got {len(args)})."
        ) from err


def _describe_args(args: tuple[Any, ...]) -> str:
    def one(x: Any) -> str:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        return f"{type(x).__name__}{tuple(shape)}:{dtype}" if shape is not None else repr(x)

    return ", ".join(str(jax.tree.map(one, a)) for a in args)


def _leaf_aval(leaf: Any) -> tuple[Shape, np.dtype[Any]]:
    arr = jnp.asarray(leaf)
    return tuple(arr.shape), np.dtype(arr.dtype)


def _classify(state: brainstate.State[Any]) -> StateKind:
    if isinstance(state, brainstate.HiddenState):
        return StateKind.HIDDEN
    if isinstance(state, brainstate.ParamState):
        return StateKind.WEIGHT
    return StateKind.OTHER


def _check_no_nested_etp(closed: ClosedJaxpr, records: list[CompilationRecord]) -> None:
    from ..ops import is_etp_primitive
    from ._positions import contains_primitive

    for eqn in closed.jaxpr.eqns:
        for sub in inner_closed_jaxprs(eqn):
            if contains_primitive(sub, is_etp_primitive):
                where = equation_location(eqn)
                rec = record(
                    DiagnosticKind.PRIMITIVE_INSIDE_CONTROL_FLOW,
                    DiagnosticLevel.ERROR,
                    f"An ETP operation is used inside '{eqn.primitive.name}' at {where}.",
                    primitive=str(eqn.primitive.name),
                )
                raise NotSupportedError(
                    f"An ETP operation (a traced weight) is used inside '{eqn.primitive.name}' at "
                    f"{where}. Weight operations must sit at the top level of update(): replace "
                    "lax.cond/switch with jnp.where or lax.select, unroll short loops in Python, "
                    "and keep custom_jvp/custom_vjp functions free of weight operations.",
                    [*records, rec],
                )


def _leaf_names(value: PyTree) -> list[str]:
    """``''`` for a single-array value, else each leaf's key path (``"['weight']"``)."""
    leaves = jax.tree_util.tree_flatten_with_path(value)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        return [""]
    return [jax.tree_util.keystr(kp) for kp, _ in leaves]


def _check_state_avals(
    model_name: str,
    closed: ClosedJaxpr,
    states: Sequence[brainstate.State[Any]],
    paths: Sequence[Path],
    num_in: int,
    num_out: int,
    records: Sequence[CompilationRecord],
) -> None:
    """Refuse a step whose new value of a state differs in shape or dtype from the old."""
    invars = closed.jaxpr.invars
    outvars = closed.jaxpr.outvars
    pos_in, pos_out = num_in, num_out
    for st, p in zip(states, paths, strict=True):
        names = _leaf_names(st.value)
        n = len(names)
        olds = [v.aval for v in invars[pos_in : pos_in + n]]
        news = [v.aval for v in outvars[pos_out : pos_out + n]]
        pos_in += n
        pos_out += n
        for name, old, new in zip(names, olds, news, strict=True):
            if old.shape == new.shape and old.dtype == new.dtype:
                continue
            old_shape, new_shape = tuple(old.shape), tuple(new.shape)
            if old_shape != new_shape:
                change = f"shape {old_shape} to {new_shape}"
                if len(new_shape) == len(old_shape) + 1 and new_shape[1:] == old_shape:
                    fix = (
                        "The example input seems to carry a batch axis the states lack: call "
                        f"brainstate.nn.init_all_states(model, batch_size={new_shape[0]}) "
                        "before compiling (or pass an unbatched example input)."
                    )
                else:
                    fix = (
                        "update() must return a new value of the state's own shape: check the "
                        "shapes of the example inputs, or initialise the states to fit them "
                        "(brainstate.nn.init_all_states(model, batch_size=...))."
                    )
            else:
                change = f"dtype {old.dtype} to {new.dtype}"
                fix = (
                    f"Cast the new value to {old.dtype} (e.g. jnp.asarray(value, "
                    f"{old.dtype})), or initialise the state with dtype {new.dtype}."
                )
            raise StateShapeChangedError(
                f"update() of {model_name} changes the {type(st).__name__} {p}{name} from "
                f"{change}; a state must keep its shape and dtype from step to step. {fix}",
                records,
            )


def _check_weight_dtypes(
    model_name: str,
    states: Sequence[brainstate.State[Any]],
    paths: Sequence[Path],
    records: Sequence[CompilationRecord],
) -> None:
    """Refuse a ParamState with a non-floating-point leaf: it could not be differentiated."""
    for st, p in zip(states, paths, strict=True):
        if not isinstance(st, brainstate.ParamState):
            continue
        leaves = jax.tree_util.tree_flatten_with_path(st.value)[0]
        for kp, leaf in leaves:
            dtype = jnp.result_type(leaf)
            if jnp.issubdtype(dtype, jnp.inexact):
                continue
            where = f"{p}{jax.tree_util.keystr(kp)}"
            rec = record(
                DiagnosticKind.WEIGHT_NOT_FLOAT,
                DiagnosticLevel.ERROR,
                f"ParamState {where} has dtype {dtype}, which has no gradient.",
                weight_path=p,
            )
            raise WeightNotFloatError(
                f"The ParamState {where} used by {model_name}.update has dtype {dtype}; "
                "weights are differentiated, and integer or boolean arrays have no gradient. "
                "Store integer tables (indices, masks, counters) in a plain brainstate.State "
                "or a brainstate.ShortTermState, or keep them as a constant attribute of the "
                "module (a jnp/np array); make trainable weights floating point.",
                [*records, rec],
            )


def extract(model: brainstate.nn.Module, *args: Any) -> ModuleInfo:
    """Trace ``model.update(*args)`` once and describe the step (stage 1).

    **Arguments:**

    - `model`: a `brainstate.nn.Module` whose states are initialised.
    - `*args`: example positional inputs of one step (only shapes and dtypes matter).

    **Returns:** a `ModuleInfo`.

    **Raises:** `TypeError` for a non-Module, `StateNotInitializedError`,
    `InputStructureError` when the inputs do not fit ``update``,
    `ParamStateWriteError` when the step writes a weight, `StateShapeChangedError`
    when it gives a state a new value of another shape or dtype (typically states
    initialised without the batch axis of the example input), `WeightNotFloatError`
    for an integer or boolean ParamState (refused, not left untrained: keep such
    tables in a plain ``brainstate.State`` or as constants), `RecursiveCompileError`
    when called inside a JAX transformation of a model.
    """
    if not isinstance(model, brainstate.nn.Module):
        raise TypeError(
            f"compile_etrace_graph expects a brainstate.nn.Module, got {type(model).__name__}. "
            "Wrap your step in a brainstate.nn.Module whose update(x) performs one time step."
        )
    retrieved: dict[Path, brainstate.State[Any]] = dict(model.states().items())
    if _value_has_tracer(args) or any(_value_has_tracer(s.value) for s in retrieved.values()):
        raise RecursiveCompileError(
            "compile_etrace_graph was called while a JAX transformation (jit, grad, vmap, "
            "or another compile) was tracing: the model's states or the example inputs are "
            "tracers. Compile once, outside of any transformation, and reuse the graph."
        )
    _check_initialised(model, retrieved)
    _check_signature(model, args)

    fn = brainstate.transform.StatefulFunction(model.update, return_only_write=False)
    try:
        fn.make_jaxpr(*args)
    except AttributeError as err:
        raise StateNotInitializedError(
            f"Tracing {type(model).__name__}.update failed with AttributeError: {err}. "
            "If this names a state attribute, the model's states are not initialised: call "
            "brainstate.nn.init_all_states(model) before compiling."
        ) from err
    except (TypeError, ValueError) as err:
        raise InputStructureError(
            f"Tracing {type(model).__name__}.update failed for example inputs "
            f"({_describe_args(args)}): {type(err).__name__}: {err}. Check that the example "
            "inputs have the structure, shapes and dtypes update() expects (and that the "
            "model's states were initialised with the matching batch size)."
        ) from err
    key = fn.get_arg_cache_key(*args)
    closed = fn.get_jaxpr_by_cache(key)
    compiled_states = tuple(fn.get_states_by_cache(key))
    written = set(fn.get_write_states_by_cache(key))
    out_shapes, _ = fn.get_out_shapes_by_cache(key)

    records: list[CompilationRecord] = []
    path_of: dict[brainstate.State[Any], Path] = {st: p for p, st in retrieved.items()}
    paths: list[Path] = []
    n_unknown = 0
    for st in compiled_states:
        if st in path_of:
            paths.append(path_of[st])
        else:
            p: Path = (f"_unknown_path_{n_unknown}",)
            n_unknown += 1
            paths.append(p)
            records.append(
                record(
                    DiagnosticKind.STATE_MISMATCH,
                    DiagnosticLevel.WARNING,
                    f"A {type(st).__name__} used by the step is not reachable from "
                    f"model.states(); it is named {p}. Store states as attributes of "
                    "submodules so that brainstate can find them.",
                    weight_path=p,
                    direction="compiled_not_in_retrieved",
                )
            )
    compiled_set = set(compiled_states)
    for p, st in retrieved.items():
        if st not in compiled_set:
            is_weight = isinstance(st, brainstate.ParamState)
            records.append(
                record(
                    DiagnosticKind.STATE_MISMATCH,
                    DiagnosticLevel.WARNING if is_weight else DiagnosticLevel.INFO,
                    f"{type(st).__name__} {p} is never read or written by update(); "
                    + ("its gradient is always zero." if is_weight else "it is ignored."),
                    weight_path=p if is_weight else None,
                    direction="retrieved_not_in_compiled",
                )
            )

    bad_writes = [
        p
        for st, p in zip(compiled_states, paths, strict=True)
        if st in written and isinstance(st, brainstate.ParamState)
    ]
    if bad_writes:
        rec = record(
            DiagnosticKind.PARAM_STATE_WRITE,
            DiagnosticLevel.ERROR,
            f"update() writes the ParamState(s) {bad_writes}.",
            weight_path=bad_writes[0],
        )
        raise ParamStateWriteError(
            f"update() of {type(model).__name__} writes the weight state(s) {bad_writes}. "
            "Weights must be constant within a step: keep values that change over time "
            "in a brainstate.HiddenState (traced) or a ShortTermState (not traced).",
            [*records, rec],
        )
    _check_state_avals(
        type(model).__name__,
        closed,
        compiled_states,
        paths,
        len(jax.tree.leaves(tuple(args))),
        len(jax.tree.leaves(out_shapes)),
        records,
    )
    _check_weight_dtypes(type(model).__name__, compiled_states, paths, records)

    closed = inline_calls(closed)
    _check_no_nested_etp(closed, records)
    jaxpr = closed.jaxpr
    table = VarTable(jaxpr)
    arg_leaves = jax.tree.leaves(tuple(args))
    num_in = len(arg_leaves)
    num_out = len(jax.tree.leaves(out_shapes))
    invars = jaxpr.invars
    outvars = jaxpr.outvars

    infos: list[StateInfo] = []
    pos_in = num_in
    pos_out = num_out
    for st, p in zip(compiled_states, paths, strict=True):
        leaves, treedef = jax.tree.flatten(st.value)
        n = len(leaves)
        ins = tuple(table.ids[v] for v in invars[pos_in : pos_in + n])
        outs = tuple(table.id_of(v) for v in outvars[pos_out : pos_out + n])
        pos_in += n
        pos_out += n
        shapes = tuple(tuple(jnp.shape(leaf)) for leaf in leaves)
        dtypes = tuple(np.dtype(jnp.result_type(leaf)) for leaf in leaves)
        kind = _classify(st)
        varshape: Shape = ()
        num_state = 1
        if kind is StateKind.HIDDEN:
            if n != 1:
                kind = StateKind.OTHER
                records.append(
                    record(
                        DiagnosticKind.HIDDEN_STATE_NOT_FLOAT,
                        DiagnosticLevel.WARNING,
                        f"Hidden state {p} holds a pytree of {n} arrays; only single-array "
                        "hidden states are traced. It is treated as an untraced state.",
                        hidden_paths=(p,),
                    )
                )
            elif not jnp.issubdtype(dtypes[0], jnp.floating):
                kind = StateKind.OTHER
                records.append(
                    record(
                        DiagnosticKind.HIDDEN_STATE_NOT_FLOAT,
                        DiagnosticLevel.WARNING,
                        f"Hidden state {p} has dtype {dtypes[0]}; only floating-point "
                        "hidden states are traced. It is treated as an untraced state.",
                        hidden_paths=(p,),
                    )
                )
            elif isinstance(st, brainstate.HiddenGroupState):
                varshape = shapes[0][:-1]
                num_state = int(shapes[0][-1])
            else:
                varshape = shapes[0]
        infos.append(
            StateInfo(
                path=p,
                kind=kind,
                type_name=type(st).__name__,
                treedef=treedef,
                shapes=shapes,
                dtypes=dtypes,
                invars=ins,
                outvars=outs,
                written=st in written,
                varshape=varshape,
                num_state=num_state,
            )
        )
        if kind is StateKind.OTHER and isinstance(st, brainstate.ShortTermState) and st in written:
            records.append(
                record(
                    DiagnosticKind.DYNAMIC_STATE,
                    DiagnosticLevel.INFO,
                    f"{type(st).__name__} {p} is carried across steps but is not a HiddenState: "
                    "gradients do not flow through it over time.",
                    hidden_paths=(p,),
                )
            )
    assert pos_in == len(invars), "state leaves do not line up with jaxpr inputs"

    program = Program(closed, [table.ids[v] for v in invars], [table.id_of(v) for v in outvars])
    return ModuleInfo(
        program=program,
        states=tuple(infos),
        state_refs=StateRefs(compiled_states),
        in_tree=jax.tree.structure(tuple(args)),
        in_avals=tuple(_leaf_aval(leaf) for leaf in arg_leaves),
        out_tree=jax.tree.structure(out_shapes),
        num_var_out=num_out,
        num_var_state=pos_out - num_out,
        diagnostics=tuple(records),
        model_name=type(model).__name__,
    )


def extract_module_info(model: brainstate.nn.Module, *args: Any) -> ModuleInfo:
    """Trace a model's one-step ``update`` and return its `ModuleInfo` (alias of `extract`)."""
    return extract(model, *args)
