"""`ModuleInfo`: the artifact of stage 1 (`extract`, in `_extract.py`).

It is pure metadata: the flat jaxpr of the step (nested
``jit`` inlined), where every state's leaves enter and leave it, and each state's
role (weight, hidden or other). Nothing here mutates a brainstate state.
"""

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Final, final

import brainstate
import equinox as eqx
import jax
import numpy as np

from .._compat import (
    ClosedJaxpr,
    Jaxpr,
    shape_struct,
)
from .._typing import Path, PyTree, Shape, VarId
from ._diagnostics import CompilationRecord
from ._jaxpr import Program

__all__ = [
    "ModuleInfo",
    "StateInfo",
    "StateKind",
    "StateRefs",
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
    - `shapes`, `dtypes`: shape and dtype of each leaf (a NumPy dtype, or JAX's
      extended dtype for a typed PRNG key).
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
    dtypes: tuple[Any, ...] = eqx.field(static=True)  # JAX has no public extended-dtype type
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
        outputs, in order, skipping ids already hoisted). See `rewrite`."""
        from ._rewrite import hoist_outputs

        return hoist_outputs(self, var_ids)

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

    def output_structs(self) -> PyTree:
        """The model output's shapes and dtypes (`jax.ShapeDtypeStruct` leaves in the
        output's structure), read from the traced step: no tracing."""
        avals = self.program.closed.out_avals[: self.num_var_out]
        structs = [shape_struct(a.shape, a.dtype, a.weak_type) for a in avals]
        return jax.tree.unflatten(self.out_tree, structs)

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
