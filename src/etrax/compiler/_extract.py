"""Stage 1, `extract`: trace a model's one-step ``update`` once and describe it as a
`ModuleInfo` (nested ``jit`` inlined, every state's role and place in the jaxpr).

Every check that needs only the model and the example inputs runs here, before any
later stage: bad input fails with a typed error that says what to do, and no
brainstate state is written.
"""

import inspect
import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from .._compat import ClosedJaxpr, equation_location, inner_closed_jaxprs, is_tracer
from .._errors import (
    EtraxError,
    InputStructureError,
    NotSupportedError,
    OpArgumentError,
    ParamStateWriteError,
    RecursiveCompileError,
    StateNotInitializedError,
    StateShapeChangedError,
    WeightNotFloatError,
)
from .._typing import Path, PyTree, Shape
from ._diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel, record
from ._jaxpr import Program, VarTable, drop_dead_equations, inline_calls
from ._module_info import ModuleInfo, StateInfo, StateKind, StateRefs
from ._normalise import CompilePolicy, normalise, note_dead_reads

__all__ = ["extract", "extract_module_info"]

States = tuple[brainstate.State[Any], ...]


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
                    f"{where}, which stays whole: weight operations must reach the top level of "
                    "update(). lax.cond/switch are if-converted and lax.scan/fori_loop of at most "
                    "CompilePolicy.unroll_limit steps are unrolled unless the policy turns that "
                    "off: allow it (CompilePolicy(if_convert=True, unroll_limit=...)), or replace "
                    "the branch with jnp.where / lax.select, and keep custom_jvp/custom_vjp "
                    "functions free of weight operations.",
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
                "Keep a fixed table that multiplies or indexes a weight (a connectivity mask, "
                "say) as a constant attribute of the module (a jnp/np array): the weight's "
                "product then stays traced. A table the step changes (a counter) goes in a "
                "plain brainstate.State or ShortTermState; a weight computed from such a "
                "State (W * mask.value) learns from its instantaneous gradient only. Make "
                "trainable weights floating point.",
                [*records, rec],
            )


def _check_model(model: object, args: tuple[Any, ...]) -> dict[Path, Any]:
    """The model's states, after the checks that need no tracing."""
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
    return retrieved


_VALUE_DEPENDENT = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)
"""JAX's errors for Python code that needs a traced array's value (the bool case,
`jax.errors.TracerBoolConversionError`, is a `ConcretizationTypeError`)."""


_ETRAX = os.path.dirname(__file__)  # etrax/compiler: its parent is etrax
_LIBRARIES = tuple(
    os.path.dirname(path) + os.sep
    for path in (jax.__file__, np.__file__, brainstate.__file__, inspect.__file__, _ETRAX)
)
"""Folders whose frames are not the user's code: JAX, NumPy, brainstate, the standard
library and etrax itself."""


def _user_frame(err: BaseException) -> str | None:
    """``file:line (function)`` of the innermost frame of `err`'s traceback outside the
    libraries (`_LIBRARIES`, site-packages): the line of the model that failed."""
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        name = os.path.abspath(frame.filename)
        if name.startswith(_LIBRARIES) or "site-packages" in name or name.startswith("<"):
            continue
        return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return None


def _trace(
    model: brainstate.nn.Module, args: tuple[Any, ...]
) -> tuple[ClosedJaxpr, States, set[brainstate.State[Any]], Any]:
    """brainstate's jaxpr of ``update``, its states, the states it writes, its output."""
    fn = brainstate.transform.StatefulFunction(model.update, return_only_write=False)
    try:
        fn.make_jaxpr(*args)
    except OpArgumentError as err:  # an etrax op refused its operands or arguments
        raise InputStructureError(
            f"Tracing {type(model).__name__}.update failed inside an etrax op: {err} If this "
            "is about the data the op receives, check that the example inputs "
            f"({_describe_args(args)}) have the structure, shapes and dtypes update() expects "
            "and the states the matching batch size; if it is about the op's own arguments, "
            "fix that call in update()."
        ) from err
    except EtraxError:
        raise
    except AttributeError as err:
        raise StateNotInitializedError(
            f"Tracing {type(model).__name__}.update failed with AttributeError: {err}. "
            "If this names a state attribute, the model's states are not initialised: call "
            "brainstate.nn.init_all_states(model) before compiling."
        ) from err
    except _VALUE_DEPENDENT as err:
        first = str(err).split("\n", 1)[0].rstrip(".")
        raise NotSupportedError(
            f"Tracing {type(model).__name__}.update failed: {type(err).__name__}: {first}. "
            "update() is traced once into a program, so it cannot branch in Python on an "
            "array's value (if x.sum() > 0: ...) or turn a traced array into a NumPy array or "
            "a Python number (np.asarray(x), float(x), int(x)). Use jnp functions, jnp.where "
            "or jax.lax.cond instead, or keep such values static (Python numbers set at "
            "construction)."
        ) from err
    except (TypeError, ValueError) as err:
        where = _user_frame(err)
        line = (
            f" It was raised at {where}: if that line's own values are at fault (an index "
            "of another integer type, an argument of the wrong kind), fix it there;"
            " otherwise check"
            if where
            else " Check"
        )
        raise InputStructureError(
            f"Tracing {type(model).__name__}.update failed for example inputs "
            f"({_describe_args(args)}): {type(err).__name__}: {str(err).rstrip('.')}.{line} "
            "that the example inputs have the structure, shapes and dtypes update() "
            "expects (and that the model's states were initialised with the matching batch "
            "size)."
        ) from err
    key = fn.get_arg_cache_key(*args)
    closed = fn.get_jaxpr_by_cache(key)
    compiled_states = tuple(fn.get_states_by_cache(key))
    written = set(fn.get_write_states_by_cache(key))
    out_shapes, _ = fn.get_out_shapes_by_cache(key)

    return closed, compiled_states, written, out_shapes


def _name_states(
    retrieved: Mapping[Path, Any], compiled_states: States, records: list[CompilationRecord]
) -> list[Path]:
    """The path of each compiled state (records states the two sides disagree on)."""
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
            if isinstance(st, brainstate.random.RandomState):  # brainstate.random's own
                level, message = (
                    DiagnosticLevel.INFO,
                    f"The step draws from a brainstate random state that is not one of "
                    f"the model's (brainstate.random's global one, say); it is carried "
                    f"between steps as an untraced state named {p}.",
                )
            else:
                level, message = (
                    DiagnosticLevel.WARNING,
                    f"A {type(st).__name__} used by the step is not reachable from "
                    f"model.states(); it is named {p}. Store states as attributes of "
                    "submodules so that brainstate can find them.",
                )
            records.append(
                record(
                    DiagnosticKind.STATE_MISMATCH,
                    level,
                    message,
                    weight_path=p if isinstance(st, brainstate.ParamState) else None,
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
                    + (
                        "nothing of it is learned: it is left out of the compiled state's "
                        "params, the gradients and learner.params (read it in update(), or "
                        "drop it from the model, if that is not intended)."
                        if is_weight
                        else "it is ignored."
                    ),
                    weight_path=p if is_weight else None,
                    direction="retrieved_not_in_compiled",
                )
            )

    return paths


def _check_param_writes(
    model: brainstate.nn.Module,
    compiled_states: States,
    written: set[brainstate.State[Any]],
    paths: Sequence[Path],
    records: list[CompilationRecord],
) -> None:
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


def _dtype_of(leaf: Any) -> Any:
    """A state leaf's dtype: a NumPy dtype, or JAX's own for an extended one (a typed
    PRNG key's ``key<fry>``, which NumPy cannot represent)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return np.dtype(jnp.result_type(leaf))


def _state_info(
    st: brainstate.State[Any],
    p: Path,
    ins: tuple[int, ...],
    outs: tuple[int | None, ...],
    written: bool,
    records: list[CompilationRecord],
) -> StateInfo:
    """The `StateInfo` of one compiled state (a hidden state that cannot be traced is
    demoted to `StateKind.OTHER`, with a record)."""
    leaves, treedef = jax.tree.flatten(st.value)
    n = len(leaves)
    shapes = tuple(tuple(jnp.shape(leaf)) for leaf in leaves)
    dtypes = tuple(_dtype_of(leaf) for leaf in leaves)
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
    info = StateInfo(
        path=p,
        kind=kind,
        type_name=type(st).__name__,
        treedef=treedef,
        shapes=shapes,
        dtypes=dtypes,
        invars=ins,
        outvars=outs,
        written=written,
        varshape=varshape,
        num_state=num_state,
    )
    if kind is StateKind.OTHER and isinstance(st, brainstate.ShortTermState) and written:
        why = (
            "is a HiddenState that cannot be traced (see hidden_state_not_float)"
            if isinstance(st, brainstate.HiddenState)
            else "is not a HiddenState"
        )
        records.append(
            record(
                DiagnosticKind.DYNAMIC_STATE,
                DiagnosticLevel.INFO,
                f"{type(st).__name__} {p} is carried across steps but {why}: gradients do not "
                "flow through it over time.",
                hidden_paths=(p,),
            )
        )
    return info


def _state_infos(
    closed: ClosedJaxpr,
    compiled_states: States,
    written: set[brainstate.State[Any]],
    paths: Sequence[Path],
    num_in: int,
    num_out: int,
    records: list[CompilationRecord],
) -> tuple[StateInfo, ...]:
    """Where each state's leaves enter and leave the step, and its role."""
    jaxpr = closed.jaxpr
    table = VarTable(jaxpr)
    infos: list[StateInfo] = []
    pos_in, pos_out = num_in, num_out
    for st, p in zip(compiled_states, paths, strict=True):
        n = len(jax.tree.leaves(st.value))
        ins = tuple(table.ids[v] for v in jaxpr.invars[pos_in : pos_in + n])
        outs = tuple(table.id_of(v) for v in jaxpr.outvars[pos_out : pos_out + n])
        pos_in += n
        pos_out += n
        infos.append(_state_info(st, p, ins, outs, st in written, records))
    assert pos_in == len(jaxpr.invars), "state leaves do not line up with jaxpr inputs"
    return tuple(infos)


def _weight_inputs(compiled_states: States, paths: Sequence[Path], num_in: int) -> dict[int, Path]:
    """Jaxpr input position → ParamState path, for every leaf of every weight."""
    out: dict[int, Path] = {}
    pos = num_in
    for st, p in zip(compiled_states, paths, strict=True):
        n = len(jax.tree.leaves(st.value))
        if isinstance(st, brainstate.ParamState):
            out.update((pos + k, p) for k in range(n))
        pos += n
    return out


def extract(
    model: brainstate.nn.Module, *args: Any, policy: CompilePolicy | None = None
) -> ModuleInfo:
    """Trace ``model.update(*args)`` once and describe the step (stage 1).

    **Arguments:**

    - `model`: a `brainstate.nn.Module` whose states are initialised.
    - `*args`: example positional inputs of one step (only shapes and dtypes matter).
    - `policy`: how the step is rewritten before tracing (`CompilePolicy`: weight ops
      recognised, fused gates split, control flow flattened); the default policy when
      `None`.

    **Returns:** a `ModuleInfo`.

    **Raises:** `TypeError` for a non-Module or a `policy` that is not a
    `CompilePolicy`, `StateNotInitializedError`,
    `InputStructureError` when the inputs do not fit ``update``,
    `ParamStateWriteError` when the step writes a weight, `StateShapeChangedError`
    when it gives a state a new value of another shape or dtype (typically states
    initialised without the batch axis of the example input), `WeightNotFloatError`
    for an integer or boolean ParamState (refused, not left untrained: keep such
    tables in a plain ``brainstate.State`` or as constants), `RecursiveCompileError`
    when called inside a JAX transformation of a model.
    """
    if policy is not None and not isinstance(policy, CompilePolicy):
        raise TypeError(
            f"policy must be an etrax.CompilePolicy (e.g. etrax.CompilePolicy(unroll_limit=4)) "
            f"or None, got {type(policy).__name__} {policy!r}"
        )
    retrieved = _check_model(model, args)
    closed, compiled_states, written, out_shapes = _trace(model, args)
    records: list[CompilationRecord] = []
    paths = _name_states(retrieved, compiled_states, records)
    _check_param_writes(model, compiled_states, written, paths, records)
    arg_leaves = jax.tree.leaves(tuple(args))
    num_in, num_out = len(arg_leaves), len(jax.tree.leaves(out_shapes))
    name = type(model).__name__
    _check_state_avals(name, closed, compiled_states, paths, num_in, num_out, records)
    _check_weight_dtypes(name, compiled_states, paths, records)
    policy = CompilePolicy() if policy is None else policy
    # libraries' jitted products as what they stand for, before their names are gone
    closed = inline_calls(closed, products=policy.recognise_weight_ops)
    weights = _weight_inputs(compiled_states, paths, num_in)
    live = drop_dead_equations(closed)
    note_dead_reads(closed, live, weights, records)
    closed = live
    hidden_sizes = frozenset(
        int(d)
        for st in compiled_states
        if _classify(st) is StateKind.HIDDEN
        for leaf in jax.tree.leaves(st.value)
        for d in np.shape(leaf)
    )
    closed, rewrites = normalise(closed, weights, policy, hidden_sizes)
    closed = inline_calls(closed)
    records.extend(rewrites)
    _check_no_nested_etp(closed, records)
    infos = _state_infos(closed, compiled_states, written, paths, num_in, num_out, records)
    table = VarTable(closed.jaxpr)
    program = Program(
        closed,
        [table.ids[v] for v in closed.jaxpr.invars],
        [table.id_of(v) for v in closed.jaxpr.outvars],
        rules=True,
    )
    return ModuleInfo(
        program=program,
        states=infos,
        state_refs=StateRefs(compiled_states),
        in_tree=jax.tree.structure(tuple(args)),
        in_avals=tuple(_leaf_aval(leaf) for leaf in arg_leaves),
        out_tree=jax.tree.structure(out_shapes),
        num_var_out=num_out,
        num_var_state=len(closed.jaxpr.outvars) - num_out,
        diagnostics=tuple(records),
        model_name=name,
    )


def extract_module_info(
    model: brainstate.nn.Module, *args: Any, policy: CompilePolicy | None = None
) -> ModuleInfo:
    """Trace a model's one-step ``update`` and return its `ModuleInfo` (alias of `extract`)."""
    return extract(model, *args, policy=policy)
