"""`ModelState`: the values a step reads, as a frozen pytree of arrays keyed by path."""

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import brainstate
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._errors import StepInputError
from .._pathdict import PathDict
from .._typing import ArrayTree, Path, PyTree
from ..compiler import ETraceGraph, StateKind

__all__ = [
    "ModelState",
    "check_inputs",
    "check_sequence_length",
    "check_state",
    "state_of",
    "write_back",
]


if TYPE_CHECKING:
    _Hidden: TypeAlias = Array
else:
    _Hidden = Any  # unchecked at run time: transforms pass axis specs through ModelState


class ModelState(eqx.Module):
    """The values of a compiled model's states.

    **Arguments:**

    - `params`: ``path → value`` of every ParamState (a value may be a pytree, e.g.
      ``{'weight': W, 'bias': b}``).
    - `hidden`: ``path → array`` of every traced hidden state.
    - `other`: ``path → value`` of every other state the step reads or writes.

    Each field is a `PathDict` in the graph's state order, so states, gradients
    and optimiser updates share one tree structure. Any other mapping given (a plain
    ``dict``) becomes a `PathDict` of its items; the entry points put the fields in
    the graph's order.
    """

    params: PathDict[ArrayTree]
    hidden: PathDict[_Hidden]
    other: PathDict[ArrayTree]

    def __init__(
        self,
        params: Mapping[Path, ArrayTree],
        hidden: Mapping[Path, _Hidden],
        other: Mapping[Path, ArrayTree],
    ) -> None:
        self.params = params if isinstance(params, PathDict) else PathDict(params)
        self.hidden = hidden if isinstance(hidden, PathDict) else PathDict(hidden)
        self.other = other if isinstance(other, PathDict) else PathDict(other)

    def value(self, path: Path) -> ArrayTree:
        """The value of the state at `path`, whichever field holds it."""
        for d in (self.params, self.hidden, self.other):
            if path in d:
                return d[path]
        raise KeyError(f"no state with path {path!r}")

    def replace_params(self, params: Mapping[Path, PyTree]) -> "ModelState":
        """A copy with new parameter values (same paths)."""
        _same_paths("replace_params", self.params, params)
        return ModelState(PathDict((p, params[p]) for p in self.params), self.hidden, self.other)

    def replace_hidden(self, hidden: Mapping[Path, PyTree]) -> "ModelState":
        """A copy with new hidden values (same paths)."""
        _same_paths("replace_hidden", self.hidden, hidden)
        return ModelState(self.params, PathDict((p, hidden[p]) for p in self.hidden), self.other)


def path_diff(expected: Iterable[Path], given: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """The paths of `expected` that `given` lacks, and those of `given` not expected."""
    want, have = list(expected), list(given)
    return [p for p in want if p not in have], [p for p in have if p not in want]


def _same_paths(where: str, have: Mapping[Path, Any], given: Mapping[Path, Any]) -> None:
    """A `KeyError` that lists the missing and unknown paths unless `given` has exactly
    the paths of `have`."""
    missing, unknown = path_diff(have, given)
    if missing or unknown:
        raise KeyError(
            f"{where} needs a value for every path {list(have)}: missing {missing}, unknown "
            f"{unknown}. To change some, start from the current ones, e.g. "
            f"{{**state.params, path: value}}."
        )


def _as_dtype(leaf: Any, dtype: Any) -> Any:
    """`leaf` as a strongly typed array of `dtype`: itself when it already is one (a
    concrete array: no dispatch, which a learner's every call would pay per state)."""
    if (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, jax.core.Tracer)
        and leaf.dtype == dtype
        and not getattr(leaf, "weak_type", False)  # a typed PRNG key has none
    ):
        return leaf
    return jnp.asarray(leaf, dtype=dtype)


def require_graph(graph: object, where: str) -> None:
    """Raise a `TypeError` that says how to get a graph unless `graph` is one (the
    common slip: passing the model itself)."""
    if isinstance(graph, ETraceGraph):
        return
    hint = (
        "; compile it first: graph = etrax.compile_etrace_graph(model, *example_inputs)"
        if isinstance(graph, brainstate.nn.Module)
        else ""
    )
    raise TypeError(f"{where} needs an etrax.ETraceGraph, got {type(graph).__name__}{hint}")


def state_of(graph: ETraceGraph) -> ModelState:
    """The current values of a compiled model's states, as a `ModelState`.

    Values are read (never written) from the brainstate states the graph was
    compiled from and given their compiled dtypes as strongly typed arrays, so a
    jitted step sees the same types on every call.
    """
    require_graph(graph, "state_of")
    groups: dict[StateKind, PathDict[PyTree]] = {k: PathDict() for k in StateKind}
    for kind, path, dtypes, treedef, ref in _reads(graph):
        value = ref.value
        if treedef.num_leaves == 1 and treedef.num_nodes == 1:  # one array
            groups[kind][path] = _as_dtype(value, dtypes[0])
            continue
        leaves = jax.tree.leaves(value)
        fixed = [_as_dtype(leaf, dt) for leaf, dt in zip(leaves, dtypes, strict=True)]
        groups[kind][path] = jax.tree.unflatten(treedef, fixed)
    return model_state(groups[StateKind.WEIGHT], groups[StateKind.HIDDEN], groups[StateKind.OTHER])


def model_state(
    params: PathDict[ArrayTree], hidden: PathDict[Any], other: PathDict[ArrayTree]
) -> ModelState:
    """``ModelState(params, hidden, other)`` built the way equinox rebuilds a module
    from its leaves, without the constructor's checks (about 12 µs, which a learner
    would pay at every call for fields it has just built)."""
    state = object.__new__(ModelState)
    object.__setattr__(state, "params", params)
    object.__setattr__(state, "hidden", hidden)
    object.__setattr__(state, "other", other)
    return state


_Read: TypeAlias = tuple[StateKind, Path, tuple[Any, ...], Any, Any]


def _reads(graph: ETraceGraph) -> tuple[_Read, ...]:
    """Per state: its kind, path, leaf dtypes, tree structure and brainstate state,
    listed once per graph as plain tuples (a learner reads them at every call)."""

    def build() -> tuple[_Read, ...]:
        mi = graph.module_info
        return tuple(
            (info.kind, info.path, tuple(info.dtypes), info.treedef, ref)
            for info, ref in zip(mi.states, mi.state_refs.states, strict=True)
        )

    return graph.memo.get("state_reads", build)


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None:
        return f"shape {tuple(shape)} and dtype {dtype}"
    return f"a {type(value).__name__}"


def _check_leaves(
    where: str, value: PyTree, treedef: Any, shapes: Sequence[Any], dtypes: Sequence[Any]
) -> None:
    leaves, got_def = jax.tree.flatten(value)
    if got_def != treedef:
        raise StepInputError(
            f"{where} has structure {got_def}, expected {treedef}. Pass values with the "
            "structure the graph was compiled with."
        )
    for k, (leaf, shape, dtype) in enumerate(zip(leaves, shapes, dtypes, strict=True)):
        leaf_shape, leaf_dtype = shape_dtype(leaf)
        if leaf_shape != tuple(shape) or not same_dtype(leaf_dtype, dtype):
            # the leaf's path inside the value, found only now (this runs at every call)
            key = jax.tree_util.tree_flatten_with_path(value)[0][k][0]
            at = where if len(leaves) == 1 else f"{where}{jax.tree_util.keystr(key)}"
            fix = (
                "recompile for other shapes (e.g. another batch size)"
                if leaf_shape != tuple(shape)
                else f"cast it first, e.g. x.astype(jnp.{np.dtype(dtype).name})"
            )
            raise StepInputError(
                f"{at} has {_describe(leaf)}, expected shape {tuple(shape)} and dtype "
                f"{np.dtype(dtype)}. The graph is specialised to the shapes and dtypes it was "
                f"compiled with; {fix}."
            )


_UNIT = re.compile(r"Quantity\[([^\]]*)\]")


def units_in(treedef: Any) -> list[str]:
    """The units of the brainunit quantities in a tree structure, in leaf order."""
    return _UNIT.findall(str(treedef))


def without_units(treedef: Any) -> str:
    """A tree structure's text with the units of its quantities left out."""
    return _UNIT.sub("Quantity[]", str(treedef))


def check_inputs(graph: ETraceGraph, args: tuple[Any, ...]) -> None:
    """Raise `StepInputError` if `args` do not match the graph's example inputs."""
    mi = graph.module_info
    treedef = jax.tree.structure(args)
    if treedef != mi.in_tree:
        got_units, want_units = units_in(treedef), units_in(mi.in_tree)
        if got_units != want_units and without_units(treedef) == without_units(mi.in_tree):
            raise StepInputError(
                f"the step input x is in units {got_units}, but the graph was compiled with "
                f"{want_units}: convert it first (brainunit: x.to(unit) or x.in_unit(unit))."
            )
        raise StepInputError(
            f"the step input x has structure {treedef}, expected {mi.in_tree}: pass the array "
            "itself for a one-argument update(x), or a tuple for several arguments."
        )
    _check_leaves(
        "the step input x",
        args,
        mi.in_tree,
        [s for s, _ in mi.in_avals],
        [d for _, d in mi.in_avals],
    )


class _Signature:
    """Expected tree structures and leaf shapes/dtypes of a graph's inputs (cached)."""

    def __init__(self, graph: ETraceGraph) -> None:
        mi = graph.module_info
        example = ModelState(
            *(
                PathDict(
                    (s.path, jax.tree.unflatten(s.treedef, list(range(len(s.shapes)))))
                    for s in mi.states_of(kind)
                )
                for kind in (StateKind.WEIGHT, StateKind.HIDDEN, StateKind.OTHER)
            )
        )
        self.state_treedef: Any = jax.tree.structure(example)
        by_path = {s.path: s for s in mi.states}
        avals: list[tuple[tuple[int, ...], np.dtype[Any]]] = []
        for d in (example.params, example.hidden, example.other):
            for p in d:
                info = by_path[p]
                avals.extend(zip(info.shapes, info.dtypes, strict=True))
        self.state_avals = tuple(avals)
        self.in_tree = mi.in_tree
        self.in_avals = mi.in_avals


def signature(graph: ETraceGraph) -> _Signature:
    """The graph's `_Signature`, computed once per graph (kept in `graph.memo`)."""
    return graph.memo.get("signature", lambda: _Signature(graph))


def _leaves_match(leaves: Sequence[Any], avals: Sequence[tuple[Any, Any]]) -> bool:
    if len(leaves) != len(avals):
        return False
    for leaf, (shape, dtype) in zip(leaves, avals, strict=True):
        if getattr(leaf, "shape", None) != shape or getattr(leaf, "dtype", None) != dtype:
            return False
    return True


def same_dtype(a: Any, b: Any) -> bool:
    """Whether two dtypes are the same (NumPy's, or typed PRNG keys' extended ones)."""
    extended = [jnp.issubdtype(d, jax.dtypes.extended) for d in (a, b)]
    if any(extended):
        return all(extended) and bool(a == b)
    return bool(np.dtype(a) == np.dtype(b))


def shape_dtype(leaf: Any) -> tuple[tuple[int, ...], Any]:
    """A leaf's shape and dtype: arrays, `jax.ShapeDtypeStruct`s, tracers or scalars
    (a NumPy dtype, or a typed PRNG key's extended dtype, which NumPy cannot name)."""
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        if jnp.issubdtype(dtype, jax.dtypes.extended):
            return shape, dtype
        return shape, np.dtype(dtype)
    return tuple(np.shape(leaf)), np.dtype(jnp.result_type(leaf))


def check_sequence_length(length: int) -> None:
    """Raise `StepInputError` for an empty sequence (no step along the time axis)."""
    if length == 0:
        raise StepInputError(
            "the sequence is empty (T = 0): the leading time axis of xs (and targets) has "
            "length 0. Pass at least one step, or skip the call for an empty sequence."
        )


def fast_check_state(graph: ETraceGraph, state: ModelState) -> ModelState:
    """`check_state`, with a fast path for the common correct case; returns `state`
    with each field a `PathDict` in the graph's state order (a field given as another
    mapping, a plain ``dict`` say, in any order, is rebuilt), the structure every
    compiled program expects."""
    sig = signature(graph)
    leaves, treedef = jax.tree.flatten(state)
    if treedef == sig.state_treedef and _leaves_match(leaves, sig.state_avals):
        return state
    check_state(graph, state)
    mi = graph.module_info

    def ordered(kind: StateKind, d: Mapping[Path, Any]) -> PathDict[Any]:
        return PathDict((info.path, d[info.path]) for info in mi.states_of(kind))

    return ModelState(
        ordered(StateKind.WEIGHT, state.params),
        ordered(StateKind.HIDDEN, state.hidden),
        ordered(StateKind.OTHER, state.other),
    )


def cast_inputs(graph: ETraceGraph, args: Any, leading: int = 0) -> Any:
    """`args` with each leaf that JAX would cast without loss of meaning cast to the
    compiled input dtype: a floating array of another width (a NumPy float64 batch
    into a float32 graph) and Python numbers. Any other mismatch is left for the
    input check, whose error says how to cast. `leading` axes (a time axis) are
    ignored. A structure that does not fit is returned unchanged (the check names it).
    """
    sig = signature(graph)
    leaves, treedef = jax.tree.flatten(args)
    if treedef != sig.in_tree:
        return args
    out: list[Any] = []
    for leaf, (_, dtype) in zip(leaves, sig.in_avals, strict=True):
        want = np.dtype(dtype)
        if isinstance(leaf, bool | np.bool_):
            out.append(leaf)
        elif isinstance(leaf, int | float) and leading == 0:
            out.append(jnp.asarray(leaf, want))
        elif not isinstance(leaf, np.ndarray | jax.Array):
            out.append(leaf)  # structs, quantities with units, …: left to the check
        else:
            have = np.dtype(leaf.dtype)  # the leaf's own dtype (NumPy's too)
            both_float = jnp.issubdtype(have, jnp.floating) and jnp.issubdtype(want, jnp.floating)
            out.append(jnp.asarray(leaf, want) if have != want and both_float else leaf)
    return jax.tree.unflatten(treedef, out)


def fast_check_inputs(graph: ETraceGraph, args: tuple[Any, ...]) -> None:
    """`check_inputs`, with a fast path for the common correct case (`args` may hold
    `jax.ShapeDtypeStruct`s)."""
    sig = signature(graph)
    a_leaves, a_def = jax.tree.flatten(args)
    if a_def != sig.in_tree or not _leaves_match(a_leaves, sig.in_avals):
        check_inputs(graph, args)


def fast_check(graph: ETraceGraph, state: ModelState, args: tuple[Any, ...]) -> ModelState:
    """`check_state` and `check_inputs`, with a fast path for the common correct case;
    returns the state as `fast_check_state` does."""
    state = fast_check_state(graph, state)
    sig = signature(graph)
    a_leaves, a_def = jax.tree.flatten(args)
    if a_def != sig.in_tree or not _leaves_match(a_leaves, sig.in_avals):
        check_inputs(graph, args)
    return state


def check_state(graph: ETraceGraph, state: ModelState) -> None:
    """Raise `StepInputError` if `state` does not belong to `graph`."""
    if not isinstance(state, ModelState):
        raise StepInputError(
            f"state must be an etrax.ModelState (from etrax.state_of(graph)), got "
            f"{type(state).__name__}"
        )
    mi = graph.module_info
    for kind, field, d in (
        (StateKind.WEIGHT, "params", state.params),
        (StateKind.HIDDEN, "hidden", state.hidden),
        (StateKind.OTHER, "other", state.other),
    ):
        missing, extra = path_diff((s.path for s in mi.states_of(kind)), d)
        if missing or extra:
            raise StepInputError(
                f"state.{field} does not match this graph: missing {missing}, unexpected "
                f"{extra}. Use etrax.state_of(graph) of the same graph (a state from another "
                "graph does not fit)."
            )
        for info in mi.states_of(kind):
            _check_leaves(
                f"state.{field}[{info.path!r}]",
                d[info.path],
                info.treedef,
                info.shapes,
                info.dtypes,
            )


def flat_state(graph: ETraceGraph, state: ModelState) -> list[Any]:
    """The state leaves in the order the step's jaxpr reads them."""
    out: list[Any] = []
    for info in graph.module_info.states:
        out.extend(jax.tree.leaves(state.value(info.path)))
    return out


def write_back(graph: ETraceGraph, state: ModelState) -> None:
    """Write hidden and other values of `state` into the model's brainstate states."""
    mi = graph.module_info
    for info, ref in zip(mi.states, mi.state_refs.states, strict=True):
        if info.kind is StateKind.HIDDEN:
            ref.value = state.hidden[info.path]
        elif info.kind is StateKind.OTHER and info.written:
            ref.value = state.other[info.path]
