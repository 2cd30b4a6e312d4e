"""The pure executor: ``step(graph, state, x) -> (y, state, jac)`` and its VJP variant.

Everything here is a pure function of arrays; the graph is static. Inputs are
validated against the graph before tracing (`check_inputs`, `check_state`), and
the jitted body is compiled once per graph and input shapes.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._compat import jacobian, vary_like
from .._errors import StepInputError
from .._pathdict import PathDict
from .._typing import Path, PyTree, VarId
from ..compiler import ETraceGraph, StateKind
from ..compiler._module_info import StateInfo
from ..compiler._perturbation import zero_perturbation
from ._state import (
    ModelState,
    cast_inputs,
    check_inputs,
    check_sequence_length,
    check_state,
    fast_check,
    fast_check_state,
    flat_state,
    require_graph,
)

__all__ = [
    "Pullback",
    "StepJacobians",
    "StepPoint",
    "as_args",
    "forward",
    "multi_step",
    "step",
    "step_vjp",
]


class StepJacobians(eqx.Module):
    """The Jacobians of one step, all with stopped gradients.

    **Arguments:**

    - `x`: per relation, the op's data input as read in the step (`None` for ops
      without one).
    - `df`: per relation, per connected group (in `relation.tails` order), the
      diagonal ``∂h^t/∂y`` shaped ``(*varshape, S)``.
    - `D`: per hidden group, ``∂h^t/∂h^{t-1}`` per position, ``(*varshape, S, S)``.
    """

    x: tuple[Array | None, ...]
    df: tuple[tuple[Array, ...], ...]
    D: tuple[Array, ...]
    point: "StepPoint | None" = None


class StepPoint(eqx.Module):
    """Where a step was taken: the state before it and the step's arguments.

    Carried in `StepJacobians.point` for learning rules that need more of the
    transition than its per-position Jacobian ``D`` (the coupled and sparse scopes,
    random projections); `None` otherwise.
    """

    state: ModelState
    args: tuple[Any, ...]

    def group_step(self, graph: ETraceGraph, index: int) -> Any:
        """The map from hidden group `index`'s old values ``(*varshape, S)`` to its new
        values, with every other input and state held at this point."""
        group = graph.hidden_groups[index]

        def new_slab(slab: Array) -> Array:
            hidden = dict(self.state.hidden)
            old = [hidden[p] for p in group.hidden_paths]
            hidden.update(zip(group.hidden_paths, group.split_hidden(slab, old), strict=True))
            _, new = forward_pure(graph, self.state.replace_hidden(hidden), self.args)
            return group.concat_hidden([new.hidden[p] for p in group.hidden_paths])

        return new_slab

    def group_slab(self, graph: ETraceGraph, index: int) -> Array:
        """Hidden group `index`'s old values as one ``(*varshape, S)`` slab."""
        group = graph.hidden_groups[index]
        return group.concat_hidden([self.state.hidden[p] for p in group.hidden_paths])

    def transition_jacobian(self, graph: ETraceGraph, index: int) -> Array:
        """The group's whole within-group transition ``∂h^t/∂h^{t-1}`` (through every
        op, weight ops included), ``(*varshape, S, *varshape, S)``, with no gradient."""
        jac: Array = jacobian(self.group_step(graph, index), self.group_slab(graph, index))
        return jax.lax.stop_gradient(jac)

    def transition_jvp(self, graph: ETraceGraph, index: int, tangent: Array) -> Array:
        """``(∂h^t/∂h^{t-1}) · tangent`` for one group, without forming the Jacobian."""
        out: Array
        _, out = jax.jvp(
            self.group_step(graph, index), (self.group_slab(graph, index),), (tangent,)
        )
        return jax.lax.stop_gradient(out)


class Pullback(eqx.Module):
    """Maps cotangents of a step's output (and optionally of its new hidden values)
    to the loss-to-hidden gradient ``∂L/∂h^t`` of every hidden group.

    A pytree: it can be returned from `jax.jit` and carried through `lax.scan`.
    """

    graph: ETraceGraph = eqx.field(static=True)
    vjp: Any
    y: PyTree
    hidden: tuple[Array, ...]

    def __call__(
        self, y_cot: PyTree, hidden_cot: Mapping[Path, Array] | None = None
    ) -> tuple[Array, ...]:
        """``∂L/∂h^t`` per group, each ``(*varshape, S)``.

        **Arguments:**

        - `y_cot`: cotangent of the step output ``y`` (same structure).
        - `hidden_cot`: optional ``path → cotangent`` of the new hidden values (e.g.
          a gradient arriving from later steps).
        """
        return self.with_old(y_cot, hidden_cot)[0]

    def with_old(
        self, y_cot: PyTree, hidden_cot: Mapping[Path, Array] | None = None
    ) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
        """``(∂L/∂h^t, ∂L/∂h^{t-1}|direct)`` per group: the second part is the gradient
        with respect to the *old* hidden values along routes to the outputs that avoid
        every new hidden value (zero for most models)."""
        hp = self.graph.hidden_perturb
        assert hp is not None
        _check_cotangent("y_cot (the step output's cotangent)", y_cot, self.y)
        if hidden_cot is not None:
            paths = list(hp.perturb_hidden_paths)
            if set(hidden_cot) != set(paths):
                raise StepInputError(
                    f"Pullback: hidden_cot has paths {list(hidden_cot)}, expected {paths}"
                )
            for p, h in zip(paths, self.hidden, strict=True):
                _check_cotangent(f"hidden_cot[{p!r}]", hidden_cot[p], h)
        if hidden_cot is None:
            h_cots = [jnp.zeros_like(h) for h in self.hidden]
        else:
            h_cots = [
                vary_like(jnp.asarray(hidden_cot[p], h.dtype), h)
                for p, h in zip(hp.perturb_hidden_paths, self.hidden, strict=True)
            ]
        y_cot = jax.tree.map(lambda c, y: vary_like(jnp.asarray(c, y.dtype), y), y_cot, self.y)
        grads, olds = self.vjp((y_cot, h_cots))
        groups = self.graph.hidden_groups
        return (
            tuple(hp.perturb_data_to_hidden_group_data(grads, groups)),
            tuple(hp.perturb_data_to_hidden_group_data(olds, groups)),
        )


def _check_cotangent(what: str, given: PyTree, like: PyTree) -> None:
    """A `StepInputError` unless `given` has the structure and leaf shapes of `like`."""
    g_leaves, g_def = jax.tree.flatten(given)
    l_leaves, l_def = jax.tree.flatten(like)
    expected: Any = l_def  # PyTreeDef's comparison is untyped
    same = bool(expected == g_def)
    g_shapes = [tuple(jnp.shape(a)) for a in g_leaves]
    l_shapes = [tuple(jnp.shape(a)) for a in l_leaves]
    if not same or g_shapes != l_shapes:
        raise StepInputError(
            f"Pullback: {what} has structure {g_def} and shapes {g_shapes}, expected {l_def} "
            f"and shapes {l_shapes} (one cotangent per value, shaped like it)"
        )


def as_args(graph: ETraceGraph, x: Any) -> tuple[Any, ...]:
    """The positional arguments of ``update`` from a step input ``x``."""
    n = len(graph.module_info.in_tree.children())
    if n == 1:
        return (x,)
    if not isinstance(x, tuple) or len(x) != n:
        raise StepInputError(
            f"update() of this graph takes {n} positional arguments: pass x as a tuple of {n} "
            f"values, got {type(x).__name__}"
        )
    return x


def step_env(
    graph: ETraceGraph,
    flat: Sequence[Any],
    hidden: Mapping[Path, Any],
    hoisted: Mapping[VarId, Any],
) -> dict[VarId, Any]:
    """The values of the step's variables that its Jacobians read: the consts, the
    inputs (`flat`), the `hoisted` values and the new hidden values, each hidden
    state's leaves by its output variables (a brainunit ``Quantity``'s mantissa: the
    step's variables carry no units)."""
    mi = graph.module_info
    env: dict[VarId, Any] = dict(enumerate(mi.closed_jaxpr.consts))
    env.update(zip(mi.program.input_ids, flat, strict=True))
    env.update(hoisted)
    for s in mi.hidden_states:
        leaves = jax.tree.leaves(hidden[s.path])
        for v, leaf in zip(s.outvars, leaves, strict=True):
            if v is not None:
                env[v] = leaf
    return env


def step_jacobians(graph: ETraceGraph, env: Mapping[VarId, Any]) -> StepJacobians:
    """The `StepJacobians` of one step from its value environment (`step_env`)."""
    groups = graph.hidden_groups
    D = tuple(
        g.diagonal_jacobian(
            [env[v] for v in g.hidden_invars], [env[c] for c in g.transition_consts]
        )
        for g in groups
    )
    xs: list[Array | None] = []
    dfs: list[tuple[Array, ...]] = []
    for rel in graph.hidden_param_op_relations:
        xs.append(None if rel.x_var is None else jnp.asarray(env[rel.x_var]))
        y = env[rel.y_var]
        dfs.append(
            tuple(
                t.diagonal_jacobian(y, [env[c] for c in t.consts], groups[t.group_index])
                for t in rel.tails
            )
        )
    jac = StepJacobians(x=tuple(xs), df=tuple(dfs), D=D)
    return jax.lax.stop_gradient(jac)


def next_state(
    graph: ETraceGraph, state: ModelState, hidden: Mapping[Path, Any], other: Mapping[Path, Any]
) -> ModelState:
    mi = graph.module_info
    return ModelState(
        params=state.params,
        hidden=PathDict((s.path, hidden[s.path]) for s in mi.states_of(StateKind.HIDDEN)),
        other=PathDict(
            (s.path, _keys_as_compiled(s, other[s.path])) for s in mi.states_of(StateKind.OTHER)
        ),
    )


def _keys_as_compiled(info: StateInfo, value: Any) -> Any:
    """`value` with each leaf that the state holds as a typed PRNG key wrapped back into
    one: brainstate's global random state comes out of a traced step as the key's
    raw ``uint32`` data."""
    if not any(jnp.issubdtype(d, jax.dtypes.extended) for d in info.dtypes):
        return value
    leaves = jax.tree.leaves(value)
    fixed = [
        jax.random.wrap_key_data(leaf, impl=d._impl)  # the key type's own implementation
        if jnp.issubdtype(d, jax.dtypes.extended)
        and not jnp.issubdtype(leaf.dtype, jax.dtypes.extended)
        else leaf
        for leaf, d in zip(leaves, info.dtypes, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(value), fixed)


def forward_pure(graph: ETraceGraph, state: ModelState, args: tuple[Any, ...]) -> Any:
    """`forward` without validation or `jit`: for use inside traced code."""
    mi = graph.module_info
    flat = [*jax.tree.leaves(args), *flat_state(graph, state)]
    out, hidden, other, _ = mi.split_outputs(mi.program(*flat))
    return out, next_state(graph, state, hidden, other)


def step_pure(graph: ETraceGraph, state: ModelState, args: tuple[Any, ...], with_vjp: bool) -> Any:
    """`step` (or `step_vjp` with `with_vjp`) without validation or `jit`: for use
    inside traced code (the sequence drivers' scans)."""
    mi = graph.module_info
    flat = [*jax.tree.leaves(args), *flat_state(graph, state)]
    if not with_vjp:
        out, hidden, other, hoisted = mi.split_outputs(mi.program(*flat))
        env = step_env(graph, flat, hidden, hoisted)
        return out, next_state(graph, state, hidden, other), step_jacobians(graph, env)
    hp = graph.hidden_perturb
    assert hp is not None

    def perturbed(perturbs: list[Array], olds: list[Array]) -> Any:
        out, hidden, other, hoisted = mi.split_outputs(hp.eval_jaxpr(flat, perturbs, olds))
        main = (out, [hidden[p] for p in hp.perturb_hidden_paths])
        return main, (hidden, other, hoisted)

    zeros = [zero_perturbation(state.hidden[p]) for p in hp.perturb_hidden_paths]
    (out, hidden_out), vjp_fn, (hidden, other, hoisted) = jax.vjp(
        perturbed, zeros, zeros, has_aux=True
    )
    env = step_env(graph, flat, hidden, hoisted)
    new = next_state(graph, state, hidden, other)
    pullback = Pullback(graph, vjp_fn, out, tuple(hidden_out))
    return out, new, step_jacobians(graph, env), pullback


_forward_jit = jax.jit(forward_pure, static_argnums=0)
_step_jit = jax.jit(step_pure, static_argnums=(0, 3))


def _validate(graph: ETraceGraph, state: ModelState, x: Any) -> tuple[ModelState, tuple[Any, ...]]:
    require_graph(graph, "the step")
    state_obj: object = state
    if not isinstance(state_obj, ModelState):
        check_state(graph, state)
    args: tuple[Any, ...] = cast_inputs(graph, as_args(graph, x))
    return fast_check(graph, state, args), args


def forward(graph: ETraceGraph, state: ModelState, x: Any) -> tuple[PyTree, ModelState]:
    """Run one step without Jacobians: ``(y, new state)`` (the forward-only floor)."""
    state, args = _validate(graph, state, x)
    out, new = _forward_jit(graph, state, args)
    return out, new


def step(graph: ETraceGraph, state: ModelState, x: Any) -> tuple[PyTree, ModelState, StepJacobians]:
    """Run one step and return its output, new state and Jacobians.

    **Arguments:**

    - `graph`: an `ETraceGraph` (static: compiled once per graph and shapes).
    - `state`: a `ModelState` of this graph (`etrax.state_of(graph)` to start).
    - `x`: the step input: the array itself for a one-argument ``update(x)``, a
      tuple for several arguments.

    **Returns:** ``(y, new_state, jac)`` with `jac` a `StepJacobians`. `y` and the new
    state can be differentiated; the Jacobians carry no gradient (a function of them
    differentiates to zero).

    **Raises:** `StepInputError` when `x` or `state` do not match the graph (checked
    before tracing).

    !!! Example

        ```python
        state = etrax.state_of(graph)
        y, state, jac = etrax.step(graph, state, x)
        jac.D[0].shape   # (*varshape, S, S)
        ```
    """
    state, args = _validate(graph, state, x)
    out, new, jac = _step_jit(graph, state, args, False)
    return out, new, jac


def step_vjp(
    graph: ETraceGraph, state: ModelState, x: Any
) -> tuple[PyTree, ModelState, StepJacobians, Pullback]:
    """`step` plus a `Pullback` that maps output cotangents to ``∂L/∂h^t`` per group."""
    if graph.hidden_perturb is None:
        raise ValueError(
            "step_vjp needs the hidden perturbation: compile with include_hidden_perturb=True"
        )
    state, args = _validate(graph, state, x)
    out, new, jac, pullback = _step_jit(graph, state, args, True)
    return out, new, jac, pullback


def _check_sequence(graph: ETraceGraph, xs: Any) -> tuple[int, tuple[Any, ...]]:
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise StepInputError("xs has no arrays; pass inputs with a leading time axis")
    lengths = {int(jnp.shape(leaf)[0]) if jnp.ndim(leaf) > 0 else -1 for leaf in leaves}
    if len(lengths) != 1 or -1 in lengths:
        shown = sorted(str(n) if n >= 0 else "none" for n in lengths)
        raise StepInputError(f"every leaf of xs needs the same leading time axis, got {shown}")
    (T,) = lengths
    check_sequence_length(T)
    seq = cast_inputs(graph, as_args(graph, xs), leading=1)
    check_inputs(graph, jax.tree.map(lambda a: a[0], seq))
    return T, seq


def _multi_impl(graph: ETraceGraph, state: ModelState, args: tuple[Any, ...]) -> Any:
    def body(carry: ModelState, a: tuple[Any, ...]) -> Any:
        out, new, jac = step_pure(graph, carry, a, False)
        return new, (out, jac)

    final, (outs, jacs) = jax.lax.scan(body, state, args)
    return outs, final, jacs


_multi_jit = jax.jit(_multi_impl, static_argnums=0)


def multi_step(
    graph: ETraceGraph, state: ModelState, xs: Any
) -> tuple[PyTree, ModelState, StepJacobians]:
    """Run `step` over a leading time axis of `xs` with one `lax.scan`.

    **Returns:** stacked outputs ``(T, ...)``, the final state, and `StepJacobians`
    whose arrays carry a leading ``T``.
    """
    state = fast_check_state(graph, state)
    _, args = _check_sequence(graph, xs)
    outs, final, jacs = _multi_jit(graph, state, args)
    return outs, final, jacs
