"""Sequence drivers: `online_grad` (one `lax.scan`, memory independent of the
sequence length) and `bptt_grad` (exact backpropagation through time)."""

import contextlib
import functools
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    NamedTuple,
    NotRequired,
    SupportsIndex,
    TypeAlias,
    TypedDict,
    TypeVar,
    cast,
)

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._compat import (
    DropVar,
    Literal,
    aval_of,
    bind_equation,
    equation_location,
    forward_mode,
    map_over,
    not_differentiable,
    shape_struct,
    struct_of,
    vary_like,
    vary_tree,
)
from .._errors import CompilationError, NotSupportedError, StepInputError
from .._pathdict import PathDict
from .._typing import ArrayTree, Path, PyTree
from ..compiler import ETraceGraph, WeightRule
from ..compiler._perturbation import Region, zero_perturbation
from ..executor import (
    ModelState,
    StepJacobians,
    StepPoint,
    as_args,
    cast_inputs,
    check_sequence_length,
    fast_check_inputs,
    fast_check_state,
    flat_state,
    forward_pure,
    model_state,
    next_state,
    require_graph,
    shape_dtype,
    step_env,
    step_jacobians,
    step_pure,
)
from ..executor._state import without_units
from ._base import (
    EffGrads,
    OnlineAlgorithm,
    Weights,
    add_eff,
    add_into,
    as_int,
    check_algorithm,
    loop_hint,
    zeros_eff,
)
from ._dni import SyntheticGradient
from ._kernels import instant_contribution, squeezed
from ._plan import direct_routes, plan_of
from ._weights import (
    add_param_grads,
    differentiable,
    leaf_grads_to_params,
    operand_leaf_grads,
    operand_values,
    operands_to_params,
    use_leaf_grads,
    use_value,
    zeros_like_params,
)

__all__ = [
    "BPTTAux",
    "BPTTResult",
    "OnlineAux",
    "OnlineResult",
    "bptt_grad",
    "online_evolve",
    "online_grad",
]

LossFn = Callable[[PyTree, PyTree], Array]
AuxT = TypeVar("AuxT")
AuxLossFn = Callable[[PyTree, PyTree], tuple[Array, AuxT]]
"""A loss that also returns auxiliary data: ``loss_fn(y_t, target_t) -> (scalar, aux_t)``."""
TraceT = TypeVar("TraceT")


class OnlineAux(TypedDict, Generic[TraceT]):
    """The ``aux`` of an `OnlineResult`: a dict with these keys."""

    losses: Array
    state: "ModelState"
    traces: TraceT
    loss_aux: NotRequired[ArrayTree]
    synthesiser: NotRequired[SyntheticGradient]


class BPTTAux(TypedDict):
    """The ``aux`` of a `BPTTResult`: a dict with these keys."""

    losses: Array
    state: "ModelState"
    loss_aux: NotRequired[ArrayTree]


class OnlineResult(NamedTuple, Generic[TraceT]):
    """What `online_grad` returns: unpacks as ``grads, aux`` (SPEC's contract), and
    names each part.

    **Arguments:**

    - `grads`: the gradient of every parameter, shaped like ``state.params``.
    - `aux`: ``losses`` ``(T,)``, the final ``state`` and ``traces``, with
      ``has_aux=True`` the loss's stacked auxiliary data ``loss_aux``, and (for `DNI`)
      the trained ``synthesiser``.
    """

    grads: PathDict[ArrayTree]
    aux: OnlineAux[TraceT]

    @property
    def losses(self) -> Array:
        """The per-step losses, ``(T,)``."""
        return self.aux["losses"]

    @property
    def state(self) -> ModelState:
        """The state after the sequence."""
        return self.aux["state"]

    @property
    def loss_aux(self) -> ArrayTree:
        """With ``has_aux=True``, the auxiliary data the loss returned at each step,
        stacked over time (a leading axis ``T``); else `None`."""
        return self.aux.get("loss_aux")

    @property
    def traces(self) -> TraceT:
        """The traces after the sequence (pass them to the next call); of the type the
        rule's ``init`` returns."""
        return self.aux["traces"]

    @property
    def synthesiser(self) -> SyntheticGradient | None:
        """The trained synthesiser of a rule with synthetic gradients, else `None`."""
        return self.aux.get("synthesiser")


if TYPE_CHECKING:
    _OnlineResultOf: TypeAlias = OnlineResult[TraceT]
else:

    class _OnlineResultOf:
        """A plain ``tuple`` at run time, whatever its subscript: the runtime checker
        (beartype) refuses a generic `NamedTuple` as a hint (the tests check the
        result's type)."""

        def __class_getitem__(cls, item: object) -> type:
            return tuple


class BPTTResult(NamedTuple):
    """What `bptt_grad` returns: unpacks as ``grads, aux``.

    **Arguments:**

    - `grads`: the exact gradient of every parameter.
    - `aux`: ``losses`` ``(T,)``, the final ``state`` and, with ``has_aux=True``, the
      loss's stacked auxiliary data ``loss_aux``.
    """

    grads: PathDict[ArrayTree]
    aux: BPTTAux

    @property
    def loss_aux(self) -> ArrayTree:
        """With ``has_aux=True``, the auxiliary data the loss returned at each step,
        stacked over time (a leading axis ``T``); else `None`."""
        return self.aux.get("loss_aux")

    @property
    def losses(self) -> Array:
        """The per-step losses, ``(T,)``."""
        return self.aux["losses"]

    @property
    def state(self) -> ModelState:
        """The state after the sequence."""
        return self.aux["state"]


# --- one step with the learning signal and the instantaneous gradient --------------------


def _perturbed_outputs(
    graph: ETraceGraph,
    flat: list[Array],
    fixed: tuple[list[Array], list[Array]],
    live: tuple[tuple[int, ...], tuple[int, ...]],
    perturbs: list[Array],
    olds: list[Array],
    deltas: list[Array],
    eps: list[Array],
) -> Any:
    """The perturbed step's output and, as auxiliary data, its hidden, other and
    hoisted outputs and the operands and region values of its instant equations.
    `deltas` and `eps` are the use and output perturbations at the positions `live`
    names (`_live`); the others are the `fixed` ones (zeros, not differentiated)."""
    hp = graph.hidden_perturb
    assert hp is not None
    all_deltas, all_eps = list(fixed[0]), list(fixed[1])
    for n, d in zip(live[0], deltas, strict=True):
        all_deltas[n] = d
    for n, e in zip(live[1], eps, strict=True):
        all_eps[n] = e
    outs, operands = hp.eval_with_operands(flat, perturbs, olds, all_deltas, all_eps)
    out, hidden, other, hoisted = graph.module_info.split_outputs(outs)
    return out, (hidden, other, hoisted, operands)


def _live(graph: ETraceGraph, defer: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The use perturbations ``δ`` and output perturbations ``ε`` a step differentiates:
    every ``δ`` and no ``ε`` per step; with `defer`, the ``δ`` of the uses outside
    `deferred_eqns` and the ``ε`` of `live_eps`."""
    uses = plan_of(graph).instant_uses
    if not defer:
        return tuple(n for n, u in enumerate(uses) if differentiable(u)), ()
    later = deferred_eqns(graph)
    live = tuple(n for n, u in enumerate(uses) if u.eqn_index not in later and differentiable(u))
    return live, live_eps(graph)


def _step_grads(
    graph: ETraceGraph,
    state: ModelState,
    x: Any,
    target: Any,
    loss_fn: AuxLossFn[Any],
    with_point: bool = False,
    defer: bool = False,
) -> tuple[
    tuple[Array, PyTree],
    ModelState,
    StepJacobians,
    tuple[Array, ...],
    tuple[Array, ...],
    list[Array],
    PyTree,
    "Deferred | None",
]:
    """One step: the loss and its auxiliary data, the new state, the Jacobians,
    ``∂L/∂h^t`` and the direct ``∂L/∂h^{t-1}`` per group, the instantaneous gradient
    of each injected use, and the output cotangent ``∂L/∂y``.

    With `defer`, the instantaneous gradients of the uses inside `deferred_eqns` are
    left out (zero, and not differentiated) and the step returns what forms them later
    instead (`Deferred`): the equations' operands and output cotangents (or their
    regions' frontier cotangents and values), to be contracted over stacked steps by
    `_deferred_use_grads`."""
    hp = graph.hidden_perturb
    assert hp is not None
    flat = [*jax.tree.leaves(as_args(graph, x)), *flat_state(graph, state)]
    # zero perturbations that vary like the step's inputs under `shard_map`: an
    # invariant one's cotangent would come back summed over the devices
    deltas = _zero_uses(graph, state, x)
    eps = vary_tree(hp.init_eps_data(), state, x)
    live = _live(graph, defer)
    f = functools.partial(_perturbed_outputs, graph, flat, (deltas, eps), live)
    zeros = [zero_perturbation(state.hidden[p]) for p in hp.perturb_hidden_paths]
    out, vjp_fn, (hidden, other, hoisted, kept) = jax.vjp(
        f,
        zeros,
        zeros,
        [deltas[n] for n in live[0]],
        [eps[n] for n in live[1]],
        has_aux=True,
    )
    loss_and_aux, cot, signal_cot = _output_cotangent(loss_fn, out, target)
    g_pert, g_old, g_live, g_eps = vjp_fn(cot)
    g_use = list(deltas)  # zero where the use is deferred
    for n, g in zip(live[0], g_live, strict=True):
        g_use[n] = g
    deferred = None
    if defer:
        cots: list[Array | None] = [None] * len(eps)
        for n, g in zip(live[1], g_eps, strict=True):
            cots[n] = g
        later = deferred_eqns(graph)
        operands, values = kept[: len(hp.operand_slots)], kept[len(hp.operand_slots) :]
        needed = {n for r in regions_of(graph).values() for n in r.values}
        deferred = Deferred(  # only what the deferred equations need is stacked
            [
                v if i in later else None
                for (i, _), v in zip(hp.operand_slots, operands, strict=True)
            ],
            cots,
            [v if n in needed else None for n, v in enumerate(values)],
        )
    groups = graph.hidden_groups
    signals = tuple(hp.perturb_data_to_hidden_group_data(g_pert, groups))
    olds = tuple(hp.perturb_data_to_hidden_group_data(g_old, groups))
    jac = step_jacobians(graph, step_env(graph, flat, hidden, hoisted))
    if with_point:  # the whole transition, for rules beyond the diagonal scope
        jac = StepJacobians(jac.x, jac.df, jac.D, StepPoint(state, as_args(graph, x)))
    new = next_state(graph, state, hidden, other)
    return loss_and_aux, new, jac, signals, olds, list(g_use), signal_cot, deferred


def _output_cotangent(
    loss_fn: Callable[[Any, Any], tuple[Array, Any]], out: PyTree, target: PyTree
) -> tuple[tuple[Array, Any], PyTree, PyTree]:
    """The step's ``(loss, aux)`` and ``∂L/∂y``: for the pullback (a boolean or
    integer output, a spike raster or a count the loss may read, gets a `float0`
    zero: nothing is differentiated through it), and for the learning signal (those
    outputs left out, `None`)."""
    leaves, treedef = jax.tree.flatten(out)
    inexact = [jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in leaves]
    if all(inexact):
        value, cot = jax.value_and_grad(loss_fn, has_aux=True)(out, target)
        return value, cot, cot

    def on_floats(floats: list[Array]) -> tuple[Array, Any]:
        given = iter(floats)
        full = [next(given) if f else leaf for leaf, f in zip(leaves, inexact, strict=True)]
        return loss_fn(jax.tree.unflatten(treedef, full), target)

    floats = [leaf for leaf, f in zip(leaves, inexact, strict=True) if f]
    value, grads = jax.value_and_grad(on_floats, has_aux=True)(floats)
    found = iter(grads)
    cot = [
        next(found) if f else np.zeros(np.shape(leaf), jax.dtypes.float0)
        for leaf, f in zip(leaves, inexact, strict=True)
    ]
    signal = [g if f else None for g, f in zip(cot, inexact, strict=True)]
    return value, jax.tree.unflatten(treedef, cot), jax.tree.unflatten(treedef, signal)


class Deferred(NamedTuple):
    """What forms the instantaneous gradients of the uses inside equations, per step
    (stacked over a chunk by the scan): the instant equations' non-weight operands
    (`HiddenPerturbation.operand_slots`), the cotangents ``ε`` of their outputs or of
    their regions' frontier products (`live_eps`), and the values their regions read
    (`HiddenPerturbation.value_slots`); `None` where no deferred equation needs one."""

    operands: list[Array | None]
    cotangents: list[Array | None]
    values: list[Array | None]


def _without_inputs(graph: ETraceGraph, d: Deferred) -> Deferred:
    """`d` without the operands that are also a relation's input (`Plan.operand_inputs`):
    stacked once, with the Jacobians (`_with_inputs` puts them back)."""
    shared = plan_of(graph).operand_inputs
    ops = [None if r is not None else v for v, r in zip(d.operands, shared, strict=True)]
    return d._replace(operands=ops)


def _with_inputs(graph: ETraceGraph, d: Deferred | None, jacs: StepJacobians) -> Deferred | None:
    """`d` with the operands that `_without_inputs` left out, taken from the stacked
    Jacobians' inputs, where a deferred equation needs them."""
    hp = graph.hidden_perturb
    if d is None or hp is None:
        return d
    later = deferred_eqns(graph)
    ops = [
        jacs.x[r] if v is None and r is not None and i in later else v
        for v, r, (i, _) in zip(
            d.operands, plan_of(graph).operand_inputs, hp.operand_slots, strict=True
        )
    ]
    return d._replace(operands=ops)


def deferred_eqns(graph: ETraceGraph) -> frozenset[int]:
    """The instant equations whose weights' instantaneous gradients the chunked driver
    forms once per chunk, as one product over the stacked steps: those whose weights
    hold at least as many elements as the per-step operands and output cotangents kept
    for it (a batched readout to a few outputs, say, is cheaper to contract at every
    step than to stack; on one sample, a readout to one output keeps as many elements
    as its weights, and stacking them saves the step its accumulating kernels)."""
    return graph.memo.get("deferred_eqns", lambda: _deferred_eqns(graph))


def _deferred_eqns(graph: ETraceGraph) -> frozenset[int]:
    hp = graph.hidden_perturb
    if hp is None:
        return frozenset()
    eqns = graph.module_info.jaxpr.eqns
    weights: dict[int, int] = {}
    for u in plan_of(graph).instant_uses:
        if u.eqn_index is not None:
            weights[u.eqn_index] = weights.get(u.eqn_index, 0) + math.prod(u.shape)
    kept = dict.fromkeys(hp.instant_eqns, 0)
    for i, p in hp.operand_slots:
        kept[i] += math.prod(struct_of(eqns[i].invars[p]).shape)
    for i, slots in zip(hp.instant_eqns, hp.eps_slots, strict=True):
        kept[i] += sum(math.prod(hp.eps_shapes[e]) for e in slots if e is not None)
    return frozenset(i for i in hp.instant_eqns if weights.get(i, 0) >= kept[i])


def regions_of(graph: ETraceGraph) -> dict[int, Region]:
    """The `Region` of each deferred equation that has one: its output cotangent is
    pulled back from its frontier products' once per chunk (`_region_cotangents`)."""
    return graph.memo.get("deferred_regions", lambda: _regions_of(graph))


def _regions_of(graph: ETraceGraph) -> dict[int, Region]:
    hp = graph.hidden_perturb
    if hp is None:
        return {}
    later = deferred_eqns(graph)
    return {
        i: r
        for i, r in zip(hp.instant_eqns, hp.regions, strict=True)
        if r is not None and i in later
    }


def live_eps(graph: ETraceGraph) -> tuple[int, ...]:
    """The output perturbations ``ε`` whose cotangents a chunk's steps keep: a
    deferred equation's own, or its region's frontier products' if it has a region."""
    return graph.memo.get("live_eps", lambda: _live_eps(graph))


def _live_eps(graph: ETraceGraph) -> tuple[int, ...]:
    hp = graph.hidden_perturb
    if hp is None:
        return ()
    later, regions = deferred_eqns(graph), regions_of(graph)
    live: set[int] = set()
    for i, slots in zip(hp.instant_eqns, hp.eps_slots, strict=True):
        if i in regions:
            live.update(n for _, _, n in regions[i].frontier)
        elif i in later:
            live.update(n for n in slots if n is not None)
    return tuple(sorted(live))


def _kept(value: Array | None) -> Array:
    assert value is not None  # `_step_grads` keeps what every deferred equation needs
    return value


def _region_cotangents(
    graph: ETraceGraph, params: Mapping[Path, PyTree], i: int, d: Deferred
) -> list[Array | None]:
    """The cotangents of instant equation `i`'s outputs over the stacked steps of `d`,
    pulled back from its region's frontier cotangents: the region's equations mapped
    over the steps with the weights unbatched, so each product with a frontier weight's
    transpose contracts the steps and the batch together (`None` for a dropped output)."""
    hp = graph.hidden_perturb
    assert hp is not None
    region = regions_of(graph)[i]
    closed = graph.module_info.closed_jaxpr
    eqns = closed.jaxpr.eqns
    fixed: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    weights = {(u.eqn_index, u.slot): u for u in graph.param_uses if u.eqn_index is not None}
    at = [hp.value_slots[n] for n in region.values]
    names = [eqns[e].invars[p] if p >= 0 else eqns[e].outvars[-1 - p] for e, p in at]
    stacked = [_kept(d.values[n]) for n in region.values]
    for e, p, n, axis, start, size in region.slices:  # a piece of a kept operand
        names.append(eqns[e].invars[p])
        stacked.append(
            jax.lax.slice_in_dim(_kept(d.operands[n]), start, start + size, axis=axis + 1)
        )
    starts = sum(1 for v in eqns[i].outvars if not isinstance(v, DropVar))

    def operand(env: Mapping[Any, Any], e: int, p: int, atom: Any) -> Any:
        if isinstance(atom, Literal):
            return atom.val
        if (e, p) in weights:
            return use_value(graph, weights[(e, p)], params)
        return env[atom] if atom in env else fixed[atom]

    def run(start: list[Array], rest: list[Array]) -> list[Array]:
        env = dict(zip(names, [*start, *rest], strict=True))
        for e in region.eqns:
            eqn = eqns[e]
            ins = [operand(env, e, p, a) for p, a in enumerate(eqn.invars)]
            for v, o in zip(eqn.outvars, bind_equation(eqn, ins), strict=True):
                if not isinstance(v, DropVar):
                    env[v] = o
        return [env[eqns[e].outvars[k]] for e, k, _ in region.frontier]

    steps, rest = stacked[0].shape[0], stacked[starts:]

    def mapped(start: list[Array]) -> list[Array]:
        return map_over(run, start, rest, axis_size=steps)  # type: ignore[no-any-return]

    _, vjp = jax.vjp(mapped, stacked[:starts])
    (g,) = vjp([_kept(d.cotangents[n]) for _, _, n in region.frontier])
    it = iter(g)
    return [None if isinstance(v, DropVar) else next(it) for v in eqns[i].outvars]


def _deferred_use_grads(
    graph: ETraceGraph, params: Mapping[Path, PyTree], d: Deferred
) -> list[Array]:
    """``Σ_k`` of each injected use's instantaneous gradient over the stacked steps of
    `d` (zero for the uses that `_step_grads` still contracts per step: those outside
    equations and those of equations not in `deferred_eqns`)."""
    hp = graph.hidden_perturb
    assert hp is not None
    eqns = graph.module_info.jaxpr.eqns
    uses = plan_of(graph).instant_uses
    later = deferred_eqns(graph)
    values = [use_value(graph, u, params) for u in uses]
    weight_at = {(u.eqn_index, u.slot): n for n, u in enumerate(uses) if u.eqn_index is not None}
    operand_at = {slot: n for n, slot in enumerate(hp.operand_slots)}
    regions = regions_of(graph)
    pulled: dict[int, list[Array | None]] = {}
    out: list[Array] = []
    for n, u in enumerate(uses):
        if u.eqn_index not in later or not differentiable(u):
            out.append(jnp.zeros(u.shape, u.dtype))
            continue
        i, eqn = u.eqn_index, eqns[u.eqn_index]
        if i in regions:
            if i not in pulled:
                pulled[i] = _region_cotangents(graph, params, i, d)
            kept = pulled[i]
        else:
            kept = [
                None if e is None else d.cotangents[e]
                for e in hp.eps_slots[hp.instant_eqns.index(i)]
            ]
        steps = next(c for c in kept if c is not None).shape[0]
        given = [c for c in kept if c is not None]
        cots = [
            vary_tree(jnp.zeros((steps, *struct_of(v).shape), struct_of(v).dtype), given)
            if c is None
            else c
            for v, c in zip(eqn.outvars, kept, strict=True)
        ]
        inputs: list[Array | None] = []  # per operand: a fixed value, or None (stacked)
        stacked: list[Array] = []
        for p, a in enumerate(eqn.invars):
            if (i, p) in operand_at:
                inputs.append(None)
                operand = d.operands[operand_at[(i, p)]]
                assert operand is not None  # kept for every deferred equation
                stacked.append(operand)
            elif (i, p) in weight_at:
                inputs.append(values[weight_at[(i, p)]])
            else:
                assert isinstance(a, Literal)
                inputs.append(a.val)
        out.append(_stacked_use_grad(eqn, u.slot, inputs, stacked, values[n], cots, steps))
    return out


def _equation_at(
    eqn: Any, slot: int, inputs: list[Array | None], w: Array, *per_step: Array
) -> Any:
    it = iter(per_step)
    ins = [next(it) if v is None else v for v in inputs]
    ins[slot] = w
    return bind_equation(eqn, ins)


def _mapped_equation(
    eqn: Any, slot: int, inputs: list[Array | None], stacked: list[Array], steps: int, w: Array
) -> Any:
    one = functools.partial(_equation_at, eqn, slot, inputs, w)
    return map_over(one, *stacked, axis_size=steps)


def _stacked_use_grad(
    eqn: Any,
    slot: int,
    inputs: list[Array | None],
    stacked: list[Array],
    weight: Array,
    cots: list[Array],
    steps: int,
) -> Array:
    """The VJP, with respect to operand `slot` (the weight), of `eqn` mapped over the
    steps of `stacked` with the weight unbatched: one product that contracts the steps
    and the batch together, exactly the sum of the per-step VJPs. `inputs` holds the
    fixed operands (`None` where a stacked one goes); an equation of fixed operands
    alone (weights and literals) is mapped over `steps` all the same."""
    apply = functools.partial(_mapped_equation, eqn, slot, inputs, stacked, steps)
    _, vjp = jax.vjp(apply, weight)
    (g,) = vjp(cots)
    return g  # type: ignore[no-any-return]


def _overlap(
    graph: ETraceGraph, jac: StepJacobians, signals: tuple[Array, ...], weights: Weights
) -> EffGrads:
    """Within-step traced contributions that the instantaneous gradient also contains."""
    plan = plan_of(graph)
    out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
    for slot in plan.slots:
        if slot.relation not in plan.overlap:
            continue
        g = instant_contribution(
            slot,
            jac.x[slot.relation],
            jac.df[slot.relation][slot.tail],
            signals[slot.group],
            weights[slot.relation],
        )
        add_into(out[slot.relation], g)
    return tuple(out)


def _finish(
    graph: ETraceGraph,
    params: Mapping[Path, PyTree],
    weights: Weights,
    acc_eff: EffGrads,
    acc_uses: list[Array],
) -> PathDict[PyTree]:
    leaf_grads = operand_leaf_grads(graph, acc_eff, params, weights)
    use_leaf_grads(graph, plan_of(graph).instant_uses, acc_uses, params, into=leaf_grads)
    return leaf_grads_to_params(params, leaf_grads)


Moving = tuple[PathDict[Any], PathDict[ArrayTree]]
"""The hidden and other values of a `ModelState`: what changes over a sequence."""


def moving_parts(state: ModelState) -> Moving:
    """What of `state` a loop over steps carries, and a compiled driver returns: its
    hidden and other values. The weights, which do not change within a call, are
    closed over instead, and the drivers' wrappers put the given ones back: XLA copies
    an argument that a loop carries, and one that the program returns, at every call
    (all of a large model's weights, for nothing)."""
    return state.hidden, state.other


def rejoin(params: PathDict[ArrayTree], moving: Moving) -> ModelState:
    """The state of `params` and a loop's carried values (`moving_parts`)."""
    return model_state(params, *moving)


def _zero_uses(graph: ETraceGraph, state: ModelState, *likes: Any) -> list[Array]:
    """Zero gradients of the injected uses' weight values (varying like the state and
    `likes` under `shard_map`)."""
    zeros = [jnp.zeros(u.shape, u.dtype) for u in plan_of(graph).instant_uses]
    return list(vary_tree(zeros, state, *likes))


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _with_aux(loss_fn: LossFn | AuxLossFn[Any], has_aux: bool) -> AuxLossFn[Any]:
    """`loss_fn` as a loss that returns ``(loss, aux)`` (``aux`` `None` without one),
    as arrays (a Python or NumPy number becomes a 0-d array)."""
    return functools.partial(_as_arrays, loss_fn, has_aux)


def _as_arrays(
    loss_fn: LossFn | AuxLossFn[Any], has_aux: bool, y: PyTree, target: PyTree
) -> tuple[Array, PyTree]:
    out = loss_fn(y, target)
    loss, aux = out if has_aux else (out, None)
    return jnp.asarray(loss), jax.tree.map(jnp.asarray, aux)


# --- online, per step or chunked ------------------------------------------------------------


PACK_MAX_BYTES = 1 << 14
"""A chunk's per-step outputs of at most this many bytes per step (per dtype) are
stacked as one array (`_packed_scan`): one buffer write per step instead of one per
output, which is what a small model's step spends its time on."""


def _pack_plan(leaves: list[Any]) -> dict[Any, list[int]]:
    """Which of a step's output `leaves` go into one vector per dtype: the smallest
    first, while they fit in `PACK_MAX_BYTES`; only groups of two or more (weakly
    typed leaves and PRNG keys stay apart, so they keep their type)."""
    groups: dict[Any, list[int]] = {}
    for i in sorted(range(len(leaves)), key=lambda i: leaves[i].size):
        if aval_of(leaves[i]).weak_type or jnp.issubdtype(
            leaves[i].dtype, jax.dtypes.extended
        ):  # a weak type would be lost; PRNG keys are not numbers to concatenate
            continue
        dt = jnp.dtype(leaves[i].dtype)
        taken = groups.setdefault(dt, [])
        if (sum(leaves[j].size for j in taken) + leaves[i].size) * dt.itemsize <= PACK_MAX_BYTES:
            taken.append(i)
    return {dt: sorted(idx) for dt, idx in groups.items() if len(idx) > 1}


def _packed_scan(
    body: Callable[[Any, Any], tuple[Any, PyTree]], carry: Any, xs: Any
) -> tuple[Any, PyTree]:
    """``jax.lax.scan(body, carry, xs)`` whose small per-step outputs of each dtype
    (`_pack_plan`) are raveled into one vector per step, stacked as one ``(K, n)``
    array and split again after the loop: the same values, with one buffer write per
    step instead of one per output (what a small model's step spends its time on).
    The other outputs are stacked without their axes of length 1 (`squeezed`), so
    that those that differ only by such axes share their buffers' kernels."""
    layout: list[Any] = []  # (treedef, leaf shapes, plan), set when `body` is traced

    def packed_body(c: Any, x: Any) -> Any:
        c, out = body(c, x)
        flat, treedef = jax.tree.flatten(out)
        plan = _pack_plan(flat)
        layout.append((treedef, [a.shape for a in flat], plan))
        members = {i for idx in plan.values() for i in idx}
        rest = [squeezed(a) for i, a in enumerate(flat) if i not in members]
        vecs = [jnp.concatenate([flat[i].ravel() for i in idx]) for idx in plan.values()]
        return c, (vecs, rest)

    carry, (vecs, rest) = jax.lax.scan(packed_body, carry, xs)
    treedef, shapes, plan = layout[-1]
    flat_out: list[Any] = [None] * len(shapes)
    members = {i for idx in plan.values() for i in idx}
    rest_iter = iter(rest)
    for i in range(len(shapes)):
        if i not in members:
            a = next(rest_iter)
            flat_out[i] = a.reshape(a.shape[0], *shapes[i])
    for vec, idx in zip(vecs, plan.values(), strict=True):
        start = 0
        for i in idx:
            n = math.prod(shapes[i])
            flat_out[i] = vec[:, start : start + n].reshape(vec.shape[0], *shapes[i])
            start += n
    return carry, jax.tree.unflatten(treedef, flat_out)


def _block_length(T: int, K: int) -> int:
    """The steps per chunk for a sequence of `T` steps and ``chunk_steps = K``: `K`, or,
    when `K` leaves a shorter last chunk, the largest divisor of `T` from ``K / 2`` up
    (at least 2) if there is one. The chunks are then all alike, so the program holds
    one chunk body instead of two (a loop of full chunks and the last one), which
    roughly halves its compile time; the gradient is the same for every chunk length."""
    if T <= K or T % K == 0:
        return K
    for k in range(K - 1, max(2, -(-K // 2)) - 1, -1):
        if T % k == 0:
            return k
    return K


def _scan_blocks(
    body: Callable[[Any, Any], Any], carry: Any, seq: Any, K: int, T: int
) -> tuple[Any, PyTree]:
    """Run `body` over consecutive blocks of `K` steps of `seq` (the last block may be
    shorter) and concatenate its per-step outputs (a pytree, each leaf ``(K, ...)``
    per block). Blocks are sliced inside the loop, so the sequence is never copied."""
    n_full, rem = divmod(T, K)
    if n_full == 1 and not rem:  # one block: no loop around it (a smaller program)
        return body(carry, seq)  # type: ignore[no-any-return]
    parts = []
    if n_full:

        def block(c: Any, i: Array) -> Any:
            piece = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i * K, K, axis=0), seq)
            return body(c, piece)

        carry, outs = jax.lax.scan(block, carry, jnp.arange(n_full))
        parts.append(jax.tree.map(lambda a: a.reshape(n_full * K, *a.shape[2:]), outs))
    if rem:
        tail = jax.tree.map(lambda a: a[n_full * K :], seq)
        carry, outs_rem = body(carry, tail)
        parts.append(outs_rem)
    return carry, jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def _online_impl(
    graph: ETraceGraph,
    user_loss: LossFn | AuxLossFn[Any],
    window: int | None,
    algo: OnlineAlgorithm[TraceT],
    state: ModelState,
    traces: TraceT,
    xs: Any,
    targets: Any,
    modulators: PyTree | None = None,
    synthesiser: SyntheticGradient | None = None,
    has_aux: bool = False,
) -> tuple[PathDict[PyTree], dict[str, Any]]:
    loss_fn = _with_aux(user_loss, has_aux)
    if window is not None:
        grads, aux = _window_impl(
            graph, loss_fn, window, algo, state, traces, xs, targets, synthesiser
        )
        grads = not_differentiable(_ONLINE_NOT_DIFFERENTIABLE, grads, (state, xs, targets))
        return grads, _split_losses(aux, has_aux)
    weights = operand_values(graph, state.params)
    T = jax.tree.leaves(xs)[0].shape[0]
    dtype = jnp.result_type(*jax.tree.leaves(state.hidden))
    K = algo.chunk_for(graph)

    direct = direct_routes(graph)

    # closed over, not carried (`moving_parts`); varying like the carry under shard_map
    params = vary_tree(state.params, state, xs)

    def signal_step(carry: Any, inp: Any, stacked_jacobians: bool = False) -> Any:
        moving, acc_pi, acc_sub = carry
        x, tgt, mod = inp
        loss, st, jac, sig, old, g_pi, cot, deferred = _step_grads(
            graph, rejoin(params, moving), x, tgt, loss_fn, algo.needs_point, defer=K > 1
        )
        if stacked_jacobians and deferred is not None:  # an operand that is some `x`
            deferred = _without_inputs(graph, deferred)  # is stacked with the Jacobians
        # the within-step traced part that the instantaneous gradient also holds is
        # counted with the true signal; the traces then learn from the rule's signal
        acc_sub = add_eff(acc_sub, _overlap(graph, jac, sig, weights))
        sig, old = algo.learning_signals(graph, sig, old, cot, mod)
        # no route from the old hidden values: nothing to carry or stack (None below)
        kept = old if direct else None
        return (moving_parts(st), _add(acc_pi, g_pi), acc_sub), (loss, jac, sig, kept, deferred)

    zeros = zeros_eff(graph, dtype)
    if K == 1:

        def body(carry: Any, inp: Any) -> Any:
            st, tr, acc_eff, acc_pi, acc_sub = carry
            (st, acc_pi, acc_sub), (loss, jac, sig, old, _) = signal_step(
                (st, acc_pi, acc_sub), inp
            )
            if direct:  # routes from the old hidden values: the trace before the update
                acc_eff = add_eff(acc_eff, algo.eff_grads(graph, tr, old, weights))
            tr = algo.update(graph, tr, jac, weights)
            acc_eff = add_eff(acc_eff, algo.eff_grads(graph, tr, sig, weights))
            return (st, tr, acc_eff, acc_pi, acc_sub), loss

        init = vary_tree(
            (moving_parts(state), traces, zeros, _zero_uses(graph, state), zeros), state, xs
        )
        (moving, traces, acc_eff, acc_pi, acc_sub), losses = jax.lax.scan(
            body, init, (xs, targets, modulators)
        )
    else:
        streamed = algo.streams(graph)

        def stream_step(carry: Any, inp: Any) -> Any:
            st, tr, acc_eff, acc_pi, acc_sub = carry
            (st, acc_pi, acc_sub), (loss, jac, sig, old, deferred) = signal_step(
                (st, acc_pi, acc_sub), inp
            )
            tr, now, saved = algo.stream_step(graph, tr, jac, sig, weights, old)
            return (st, tr, add_eff(acc_eff, now), acc_pi, acc_sub), (loss, deferred, saved)

        def chunk_body(carry: Any, inp: Any) -> Any:
            if streamed:  # one scan; only what the stacked products need is kept per step
                carry, (loss, deferred, saved) = _packed_scan(stream_step, carry, inp)
                st, tr, acc_eff, acc_pi, acc_sub = carry
                acc_eff = add_eff(acc_eff, algo.stream_finish(graph, tr, saved, weights))
            else:  # the chunk's Jacobians stacked, for the rule's re-associated update
                st, tr, acc_eff, acc_pi, acc_sub = carry
                (st, acc_pi, acc_sub), (loss, jacs, sigs, olds, deferred) = _packed_scan(
                    functools.partial(signal_step, stacked_jacobians=True),
                    (st, acc_pi, acc_sub),
                    inp,
                )
                deferred = _with_inputs(graph, deferred, jacs)
                tr, g = algo.chunk(graph, tr, jacs, sigs, weights, olds)
                acc_eff = add_eff(acc_eff, g)
            # the instantaneous gradients of the uses inside equations: one product per
            # use over the chunk's stacked steps (off the per-step critical path)
            acc_pi = _add(acc_pi, _deferred_use_grads(graph, params, deferred))
            return (st, tr, acc_eff, acc_pi, acc_sub), loss

        carry = vary_tree(
            (moving_parts(state), traces, zeros, _zero_uses(graph, state), zeros), state, xs
        )
        carry, losses = _scan_blocks(
            chunk_body, carry, (xs, targets, modulators), _block_length(T, K), T
        )
        moving, traces, acc_eff, acc_pi, acc_sub = carry
    grads = _finish(graph, params, weights, add_eff(acc_eff, acc_sub, -1.0), acc_pi)
    # values only: in the program, so an eager call pays nothing for the check
    grads = not_differentiable(_ONLINE_NOT_DIFFERENTIABLE, grads, (state, xs, targets))
    aux = {"losses": losses, "state": moving, "traces": traces}  # the wrapper adds the weights
    return grads, _split_losses(aux, has_aux)


def _split_losses(aux: dict[str, Any], has_aux: bool) -> dict[str, Any]:
    """`aux` with the stacked ``(losses, loss_aux)`` pair split into its two entries
    (``loss_aux`` only for a loss with auxiliary data)."""
    losses, loss_aux = aux["losses"]
    out = {**aux, "losses": losses}
    if has_aux:
        out["loss_aux"] = loss_aux
    return out


def _window_impl(
    graph: ETraceGraph,
    loss_fn: AuxLossFn[Any],
    window: int,
    algo: OnlineAlgorithm[TraceT],
    state: ModelState,
    traces: TraceT,
    xs: Any,
    targets: Any,
    synthesiser: SyntheticGradient | None,
) -> tuple[PathDict[PyTree], dict[str, Any]]:
    weights = operand_values(graph, state.params)
    params = vary_tree(state.params, state, xs)  # closed over, not carried (`moving_parts`)
    T = jax.tree.leaves(xs)[0].shape[0]
    dtype = jnp.result_type(*jax.tree.leaves(state.hidden))
    rate = algo.synthetic_rate
    untraced = _untraced_paths(graph)
    # 1 at the steps of every window but the last: where a synthetic cotangent enters
    n_last = T - ((T - 1) // window) * window
    later = jnp.concatenate([jnp.ones((T - n_last,), dtype), jnp.zeros((n_last,), dtype)])

    def slabs(hidden: Any) -> list[Array]:
        return [g.concat_hidden([hidden[p] for p in g.hidden_paths]) for g in graph.hidden_groups]

    def run_window(carry: Any, inp: Any) -> Any:
        moving, tr, acc_eff, acc_params, synth = carry
        st = rejoin(params, moving)
        xw, tw, lw = inp

        def window_loss(params: PathDict[PyTree], hidden: PathDict[PyTree]) -> Any:
            def body(m: Any, a: Any) -> Any:
                x, t = a
                args = as_args(graph, x)
                s = rejoin(params, m)
                out, s2, jac = step_pure(graph, s, args, False)
                if algo.needs_point:
                    jac = StepJacobians(jac.x, jac.df, jac.D, StepPoint(s, args))
                return moving_parts(s2), (loss_fn(out, t), jac)

            m_end, ((losses, loss_aux), jacs) = jax.lax.scan(body, (hidden, st.other), (xw, tw))
            return (jnp.sum(losses), slabs(m_end[0])), ((losses, loss_aux), jacs, m_end)

        (total, exits), vjp_fn, (losses, jacs, m_end) = jax.vjp(
            window_loss, st.params, st.hidden, has_aux=True
        )
        one, zero = vary_like(jnp.ones((), dtype), total), vary_like(jnp.zeros((), dtype), total)
        zero_exits = [jnp.zeros_like(e) for e in exits]
        g_params, g_hidden = vjp_fn((one, zero_exits))
        signals = [
            g.concat_hidden([g_hidden[p] for p in g.hidden_paths]) for g in graph.hidden_groups
        ]
        acc_eff = add_eff(acc_eff, algo.eff_grads(graph, tr, signals, weights))
        if synth is not None and rate is not None:
            # the synthetic future, pushed back through the window: credit for the
            # untraced parameters, and (with the true credit) the entry's target
            synthetic = [lw[-1] * p for p in synth.predict(graph, exits)]
            s_params, s_hidden = vjp_fn((zero, synthetic))
            g_params = PathDict(
                (p, _add(v, s_params[p]) if p in untraced else v) for p, v in g_params.items()
            )
            targets_in = [
                a + b for a, b in zip(signals, slabs(s_hidden), strict=True)
            ]  # fmt: skip
            synth = synth.step(graph, slabs(st.hidden), targets_in, rate)

        def advance(t_: Any, jac: StepJacobians) -> Any:
            return algo.update(graph, t_, jac, weights), None

        tr, _ = jax.lax.scan(advance, tr, jacs)
        return (m_end, tr, acc_eff, _add(acc_params, g_params), synth), losses

    carry = vary_tree(
        (
            moving_parts(state), traces, zeros_eff(graph, dtype), zeros_like_params(state.params),
            synthesiser,
        ),
        state,
        xs,
    )  # fmt: skip
    carry, losses = _scan_blocks(run_window, carry, (xs, targets, later), window, T)
    moving, traces, acc_eff, acc_params, synthesiser = carry
    traced = operands_to_params(graph, acc_eff, params, weights)
    grads = add_param_grads(traced, acc_params)
    aux: dict[str, Any] = {"losses": losses, "state": moving, "traces": traces}
    if synthesiser is not None:
        aux["synthesiser"] = synthesiser
    return grads, aux


def _untraced_paths(graph: ETraceGraph) -> frozenset[Path]:
    """Parameters not traced by any relation: the ones synthetic gradients add to."""
    return frozenset(
        p for p, status in graph.weight_rules().items() if status.rule is not WeightRule.TRACED
    )


_online_jit = jax.jit(_online_impl, static_argnums=(0, 1, 2, 10))
"""`_online_impl` compiled once per graph, loss function, window and `has_aux`."""


# --- validation -------------------------------------------------------------------------------


def _check_sequences(
    graph: ETraceGraph, xs: Any, targets: Any, loss_fn: LossFn | AuxLossFn[Any]
) -> int:
    x_leaves = jax.tree.leaves(xs)
    t_leaves = jax.tree.leaves(targets)
    if not x_leaves:
        raise StepInputError("xs holds no arrays: pass inputs with a leading time axis")
    for name, tree, group in (("xs", xs, x_leaves), ("targets", targets, t_leaves)):
        if any(isinstance(a, numbers.Number) for a in group) or _nested_numbers(tree, group):
            raise StepInputError(
                f"{name} holds Python numbers as leaves (a nested list?): convert it to an "
                f"array with a leading time axis first, e.g. jnp.asarray({name})"
            )
    shapes = [shape_dtype(a)[0] for a in x_leaves + t_leaves]
    lengths = {s[0] if s else -1 for s in shapes}
    if len(lengths) != 1 or -1 in lengths:
        shown = [
            f"{name}: {jnp.shape(a)}"
            for name, group in (("xs", x_leaves), ("targets", t_leaves))
            for a in group
        ]
        more = f", … ({len(shown)} leaves)" if len(shown) > 8 else ""
        raise StepInputError(
            "xs and targets must share one leading time axis (one slice per step); got "
            + ", ".join(shown[:8])
            + more
        )
    (T,) = lengths
    check_sequence_length(T)
    check_time_major(graph, xs, "xs and targets are")
    return T


def _nested_numbers(tree: Any, leaves: list[Any]) -> bool:
    """Whether `tree` looks like a nested Python list or tuple of numbers: a list or
    tuple whose leaves are all scalars, at least two of them. Under `jax.jit` (a
    learner's program) the numbers arrive as 0-d tracers, not as Python numbers."""
    return (
        isinstance(tree, list | tuple)
        and len(leaves) > 1
        and all(shape_dtype(a)[0] == () for a in leaves)
    )


def check_time_major(graph: ETraceGraph, xs: Any, what: str) -> None:
    """Check one step's slice of the sequence `xs` against the graph's inputs; on a
    mismatch, say that sequences are time-major (`what` names the sequences)."""
    step: tuple[Any, ...] | None = None
    try:
        step = as_args(graph, _step_structs(xs))
        fast_check_inputs(graph, step)
    except StepInputError as err:
        if step is not None and _shapes_fit(graph, step):  # a dtype or a unit at fault
            raise
        raise StepInputError(
            f"{err} Sequences are time-major: {what} (T, …) with one step's input after "
            "the time axis (for a batched model, (T, B, …)); move a leading batch axis "
            "with jnp.swapaxes(xs, 0, 1)."
        ) from None


def _shapes_fit(graph: ETraceGraph, step: tuple[Any, ...]) -> bool:
    """Whether one step's arguments have the graph's input structure (units aside) and
    leaf shapes, so that only dtypes or units can differ."""
    mi = graph.module_info
    leaves, treedef = jax.tree.flatten(step)
    return without_units(treedef) == without_units(mi.in_tree) and [
        tuple(leaf.shape) for leaf in leaves
    ] == [tuple(s) for s, _ in mi.in_avals]


def _cast_sequence(graph: ETraceGraph, xs: Any) -> Any:
    """`xs` with its leaves cast as `cast_inputs` casts one step's (a NumPy float64
    sequence into a float32 graph); left unchanged where the structure does not fit."""
    try:
        args = as_args(graph, xs)
    except StepInputError:
        return xs  # the sequence check names the problem
    cast = cast_inputs(graph, args, leading=1)
    return cast[0] if len(graph.module_info.in_tree.children()) == 1 else cast


def _step_structs(seq: Any) -> Any:
    """Shape/dtype structs of one step's slice of a sequence (no device work)."""

    return jax.tree.map(_step_struct, seq)


def _step_struct(a: Any) -> jax.ShapeDtypeStruct:
    shape, dtype = shape_dtype(a)
    return shape_struct(shape[1:], dtype)


def _fits_targets_like(loss_fn: LossFn | AuxLossFn[Any], y: Any) -> bool:
    """Whether `loss_fn` traces with targets shaped exactly like the outputs `y`.

    Used after `loss_fn` failed for the given targets with a `TypeError` or
    `ValueError`: if it works for targets shaped like `y_t`, the given targets'
    shape or structure is to blame; otherwise the failure is the loss's own.
    """
    try:
        jax.eval_shape(loss_fn, y, y)
    except Exception:  # any failure means the targets are not what is wrong
        return False
    return True


def _check_loss(
    graph: ETraceGraph,
    targets: Any,
    loss_fn: LossFn | AuxLossFn[Any],
    has_aux: bool = False,
) -> None:
    """Check that `loss_fn` maps one step's output and target to a float scalar (with
    `has_aux`, to a pair ``(scalar, aux)``).

    A `TypeError` or `ValueError` that `loss_fn` raises only because of the targets'
    shape or structure (it traces with targets shaped like ``y_t``) becomes a
    `StepInputError`; any other exception from `loss_fn` is the user's own and
    propagates unchanged.
    """
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(y_t, target_t), got {type(loss_fn).__name__}"
        )
    target0 = _step_structs(targets)
    # the output's shapes as traced at compile time (state and inputs are checked
    # against the graph before this, so they are the step's shapes)
    y = graph.module_info.output_structs()
    try:
        out = jax.eval_shape(loss_fn, y, target0)
    except (TypeError, ValueError) as err:
        if not _fits_targets_like(loss_fn, y):
            raise  # a failure of loss_fn itself, not of these targets: propagate it unchanged
        raise StepInputError(
            f"loss_fn(y_t, target_t) failed for y_t {jax.tree.map(lambda a: a.shape, y)} and "
            f"target_t {jax.tree.map(lambda a: a.shape, target0)}: {type(err).__name__}: "
            f"{str(err).rstrip('.')}. Pass targets whose per-step slices fit loss_fn."
        ) from err
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise StepInputError(
                f"with has_aux=True, loss_fn(y_t, target_t) must return a pair (loss, aux), "
                f"got {out}"
            )
        out = out[0]
    if not (
        isinstance(out, jax.ShapeDtypeStruct)
        and out.shape == ()
        and jnp.issubdtype(out.dtype, jnp.floating)
    ):
        pair = " (the first of the pair it returns)" if has_aux else ""
        raise StepInputError(
            f"loss_fn(y_t, target_t){pair} must return a float scalar, got {out}. Reduce the "
            "per-step loss to a scalar (e.g. with jnp.mean or jnp.sum)."
            + ("" if has_aux else " A loss that also returns data needs has_aux=True.")
        )


def _avals(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(shape_dtype(a) for a in leaves)


class _ByIdentity:
    """A loss function that cannot be hashed (an `equinox.Module` holding arrays, a
    plain dataclass), keyed by identity in the compiled-program caches: its values
    are those of the object when a call first compiles with it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __hash__(self) -> int:  # equal wrappers hold the same object, so share its type
        return hash(type(self.fn))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.fn is self.fn

    def __repr__(self) -> str:
        return repr(self.fn)


LossT = TypeVar("LossT")


def keyed(loss_fn: LossT) -> LossT:
    """`loss_fn` itself when it can be hashed (a static argument of the compiled
    drivers), else a wrapper keyed by its identity (`_ByIdentity`)."""
    try:
        hash(loss_fn)
    except TypeError:
        return cast(LossT, _ByIdentity(cast(Callable[..., Any], loss_fn)))
    return loss_fn


def _checked(graph: ETraceGraph) -> set[Any]:
    return graph.memo.get("checked", set)


def _seen(graph: ETraceGraph, key: Any) -> bool:
    """Whether these argument types were already validated for `graph` (the checks
    trace the step, so they run once per graph and argument types)."""
    try:
        return key in _checked(graph)
    except TypeError:  # an unhashable loss_fn: always check
        return False


def _remember(graph: ETraceGraph, key: Any) -> None:
    with contextlib.suppress(TypeError):  # an unhashable loss_fn is never cached
        _checked(graph).add(key)


def online_grad(
    graph: ETraceGraph,
    algo: OnlineAlgorithm[TraceT],
    state: ModelState,
    traces: TraceT,
    xs: Any,
    targets: Any,
    loss_fn: LossFn | AuxLossFn[Any],
    *,
    window: SupportsIndex | None = None,
    modulators: PyTree | None = None,
    synthesiser: SyntheticGradient | None = None,
    has_aux: bool = False,
) -> _OnlineResultOf[TraceT]:
    """Online gradient of ``Σ_t loss_fn(y_t, target_t)`` over a sequence.

    One `lax.scan` runs the step, the learning signal ``∂L_t/∂h^t``, the trace update
    and the gradient contraction; memory does not grow with the sequence length.
    Traced weights get ``Σ_t L_t · ε_t``; every other parameter (readouts, excluded
    or plainly used weights) gets its exact instantaneous gradient each step.

    **Arguments:**

    - `graph`: the `ETraceGraph`. Without `window` it must be compiled with the
      hidden perturbation (the default), which supplies ``∂L_t/∂h^t``; with `window`
      the signals come from reverse mode inside each window and it is not needed.
    - `algo`: a learning rule (`DRTRL`, `PPProp`, `EProp`, any `LearningRule`).
    - `state`: the `ModelState` at the start of the sequence.
    - `traces`: the traces at the start (``algo.init(graph, state)``).
    - `xs`, `targets`: per-step inputs and targets with a leading time axis.
    - `loss_fn`: ``loss_fn(y_t, target_t) -> scalar``, summed over steps. Pass the same
      function object on every call to avoid recompiling.
    - `window`: ``k`` for truncated windows: exact reverse mode inside each window of
      ``k`` steps plus the traces for credit across windows. ``T`` need not be a
      multiple of ``k`` (the last window is shorter). Needs a rule with the symmetric
      learning signal.
    - `modulators`: for a modulated rule (`etrax.ThreeFactor`, signal `Modulatory`),
      the per-step modulators with a leading time axis: each step's slice is one
      array broadcastable to every group's ``(*varshape, S)``, or a tuple with one
      per hidden group. Passed as data, so new values never recompile.
    - `has_aux`: `loss_fn` returns ``(loss, aux)``; the per-step ``aux`` values come
      back stacked over time as ``result.loss_aux`` (``aux["loss_aux"]``).
    - `synthesiser`: for a rule with synthetic gradients (`etrax.DNI`, signal
      `Bootstrapped`), the `SyntheticGradient` to start from (default: an untrained
      one); the trained synthesiser is returned as ``aux["synthesiser"]``.

    **Returns:** an `OnlineResult`, which unpacks as ``(grads, aux)``: `grads` is a
    `PathDict` shaped like ``state.params``; `aux` has ``losses`` ``(T,)``, the final
    ``state`` and ``traces`` (and ``loss_aux`` with `has_aux`, ``synthesiser`` for
    `DNI`), also readable as ``result.losses``, ``result.state``, ``result.traces``,
    ``result.loss_aux``. The gradients are values only: differentiating through them
    (a meta-gradient) is a `TypeError` (`not_differentiable`); use `bptt_grad` there.

    **Raises:** `StepInputError` before tracing for an empty sequence (``T = 0``),
    inputs or targets that do not fit the graph, or targets whose shape or structure
    `loss_fn` cannot take. An exception raised by `loss_fn` itself propagates
    unchanged.
    """
    require_graph(graph, "online_grad")
    loss_fn = keyed(loss_fn)
    xs = _cast_sequence(graph, xs)
    check_algorithm(algo)
    if not graph.hidden_param_op_relations:
        raise CompilationError(
            "online_grad needs a graph with at least one relation (a weight traced into a hidden "
            "state); this graph has none. Use etrax.bptt_grad instead." + loop_hint(graph)
        )
    if graph.hidden_perturb is None and window is None:
        raise ValueError(
            "online_grad needs the hidden perturbation: compile with include_hidden_perturb=True"
        )
    state = fast_check_state(graph, state)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be True or False, got {has_aux!r}")
    T = _check_sequences(graph, xs, targets, loss_fn)
    if forward_mode((state, xs, targets)):  # under jax.jit, JAX's own message instead
        raise TypeError(f"{_ONLINE_NOT_DIFFERENTIABLE} (Here: forward mode, jax.jvp / jacfwd.)")
    w: object = as_int(window)  # a NumPy or concrete 0-d integer is an int
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= T):
        raise ValueError(f"window must be an int in [1, T={T}], got {window!r}")
    win: int | None = w
    if w is not None and not algo.symmetric:
        raise ValueError(
            f"{algo.name} learns from a signal other than the true ∂L/∂h, but windows compute "
            "that signal by reverse mode; run it without window="
        )
    modulators = _check_modulators(algo, modulators, T)
    synthesiser = _check_synthesiser(graph, algo, synthesiser, win, state)
    key = (
        "online",
        _avals(xs),
        _avals(targets),
        loss_fn,
        has_aux,
        _avals(traces),
        jax.tree.structure(algo),
    )
    if not _seen(graph, key):
        expected = jax.eval_shape(lambda: algo.init(graph, state))
        if _avals(traces) != _avals(expected):
            raise StepInputError(
                f"traces do not match {type(algo).__name__}.init(graph, state) for this graph "
                "(a different graph or algorithm?)"
            )
        _check_loss(graph, targets, loss_fn, has_aux)
        _remember(graph, key)
    with _reverse_mode_explained(graph, "online_grad"):
        grads, aux = _online_jit(
            graph, loss_fn, win, algo, state, traces, xs, targets, modulators, synthesiser, has_aux
        )
    aux["state"] = rejoin(state.params, aux["state"])  # the weights, not a copy of them
    return OnlineResult(grads, cast("OnlineAux[TraceT]", aux))


@contextlib.contextmanager
def _reverse_mode_explained(graph: ETraceGraph, what: str) -> Iterator[None]:
    """Turn JAX's refusal to reverse-differentiate a ``lax.while_loop`` of the step
    into a `NotSupportedError` that names the loops and says what to write instead."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        if "Reverse-mode differentiation" not in text or "while_loop" not in text:
            raise
        loops = [
            equation_location(eqn)
            for eqn in graph.module_info.jaxpr.eqns
            if eqn.primitive.name == "while"
        ]
        where = f" (at {', '.join(loops)})" if loops else ""
        raise NotSupportedError(
            f"{what} differentiates the step in reverse mode through a lax.while_loop"
            f"{where}, which JAX cannot do for a loop whose length is not fixed. Write it "
            "as lax.fori_loop with Python-int bounds, or lax.scan, which reverse mode can "
            "cross; or keep it off the routes the gradient takes: the online rules "
            "differentiate, at each step, only the routes from the new hidden values and "
            "the untraced weight uses to the step's outputs (a loop that only computes a "
            "new hidden value from the old ones is fine for them; BPTT and windows "
            "differentiate every route)."
        ) from e


_ONLINE_NOT_DIFFERENTIABLE = (
    "etrax.online_grad's gradients cannot be differentiated (a meta-gradient through "
    "them would be wrong: the traces hold the step's weight operations constant). "
    "Differentiate through etrax.bptt_grad instead, or stop the gradient before it "
    "(jax.lax.stop_gradient) if the online gradient is only a value there."
)


def _check_synthesiser(
    graph: ETraceGraph,
    algo: OnlineAlgorithm[Any],
    synthesiser: SyntheticGradient | None,
    window: int | None,
    state: ModelState,
) -> SyntheticGradient | None:
    """The synthesiser to run with: given or untrained for a rule with synthetic
    gradients (which needs windows), absent otherwise."""
    if algo.synthetic_rate is None:
        if synthesiser is not None:
            raise ValueError(
                f"{algo.name} has no synthetic gradients; synthesiser= is for etrax.DNI "
                "(signal Bootstrapped)"
            )
        return None
    if window is None:
        raise ValueError(f"{algo.name} predicts the cotangent at each window's exit: pass window=k")
    if synthesiser is None:
        dtype = jnp.result_type(*jax.tree.leaves(state.hidden))
        return SyntheticGradient.zeros(graph, dtype)
    if not isinstance(synthesiser, SyntheticGradient):
        raise TypeError(f"synthesiser must be an etrax.SyntheticGradient, got {synthesiser!r}")
    expected = SyntheticGradient.zeros(graph)
    if [a.shape for a in jax.tree.leaves(synthesiser)] != [
        a.shape for a in jax.tree.leaves(expected)
    ]:
        raise StepInputError(
            "synthesiser does not fit this graph's hidden groups: build it with "
            "etrax.SyntheticGradient.zeros(graph)"
        )
    dtype = jnp.result_type(*jax.tree.leaves(state.hidden))
    given = {jnp.dtype(a.dtype) for a in jax.tree.leaves(synthesiser)}
    if given != {jnp.dtype(dtype)}:
        raise StepInputError(
            f"synthesiser holds {sorted(str(d) for d in given)} values but the hidden states "
            f"are {jnp.dtype(dtype)}: build it with etrax.SyntheticGradient.zeros(graph, "
            f"{str(jnp.dtype(dtype))!r}) (it is trained in the states' precision)"
        )
    return synthesiser


def _check_modulators(algo: OnlineAlgorithm[Any], modulators: PyTree | None, T: int) -> Any:
    """`modulators` as arrays with a leading axis of length `T`, present exactly when
    `algo` learns from a modulator."""
    if not algo.needs_modulator:
        if modulators is not None:
            raise ValueError(
                f"{algo.name} does not learn from a modulator; modulators= is for a modulated "
                "rule such as etrax.ThreeFactor()"
            )
        return None
    if modulators is None:
        raise ValueError(
            f"{algo.name} learns from a modulator: pass modulators= with one modulator per "
            f"step (a leading time axis of length T = {T})"
        )
    # a strong dtype: a weakly typed array (``jnp.full(T, 0.5)``) would recompile
    modulators = jax.tree.map(lambda m: jnp.asarray(m, dtype=jnp.result_type(m)), modulators)
    for leaf in jax.tree.leaves(modulators):
        if leaf.ndim == 0 or leaf.shape[0] != T:
            raise StepInputError(
                f"modulators need a leading time axis of length T = {T}, got an array shaped "
                f"{leaf.shape}"
            )
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise StepInputError(f"modulators must be float arrays, got dtype {leaf.dtype}")
    return modulators


def _evolve_impl(
    graph: ETraceGraph,
    outputs: bool,
    algo: OnlineAlgorithm[TraceT],
    state: ModelState,
    traces: TraceT,
    xs: Any,
) -> tuple[Moving, TraceT, PyTree]:
    weights = operand_values(graph, state.params)

    params = vary_tree(state.params, state, xs)  # closed over, not carried (`moving_parts`)

    def body(carry: Any, x: Any) -> Any:
        moving, tr = carry
        st = rejoin(params, moving)
        args = as_args(graph, x)
        out, new, jac = step_pure(graph, st, args, False)
        if algo.needs_point:
            jac = StepJacobians(jac.x, jac.df, jac.D, StepPoint(st, args))
        tr = algo.update(graph, tr, jac, weights)
        return (moving_parts(new), tr), (out if outputs else None)

    init = vary_tree((moving_parts(state), traces), state, xs)
    (moving, traces), outs = jax.lax.scan(body, init, xs)
    return moving, traces, outs


_evolve_jit = jax.jit(_evolve_impl, static_argnums=(0, 1))


def online_evolve(
    graph: ETraceGraph,
    algo: OnlineAlgorithm[TraceT],
    state: ModelState,
    traces: TraceT,
    xs: Any,
    *,
    return_outputs: bool = False,
) -> tuple[ModelState, TraceT, PyTree]:
    """Advance the state and the traces over a sequence, computing no gradient (e.g. to
    warm a network up before learning, or to run a streaming model between updates).

    The state and traces it leaves are exactly those `online_grad` leaves on the same
    inputs. Memory does not grow with the length, unless outputs are returned.

    **Arguments:**

    - `graph`, `algo`, `state`, `traces`: as for `online_grad`.
    - `xs`: per-step inputs with a leading time axis.
    - `return_outputs`: also return the stacked outputs ``(T, ...)``.

    **Returns:** ``(state, traces, outputs)`` with `outputs` `None` unless asked for.
    """
    require_graph(graph, "online_evolve")
    check_algorithm(algo)
    xs = _cast_sequence(graph, xs)
    state = fast_check_state(graph, state)
    leaves = jax.tree.leaves(xs)
    if not leaves or any(jnp.ndim(a) == 0 for a in leaves):
        raise StepInputError("xs needs a leading time axis (one slice per step)")
    check_sequence_length(int(jnp.shape(leaves[0])[0]))
    fast_check_inputs(graph, as_args(graph, _step_structs(xs)))
    key = ("evolve", _avals(traces), jax.tree.structure(algo))
    if not _seen(graph, key):
        expected = jax.eval_shape(lambda: algo.init(graph, state))
        if _avals(traces) != _avals(expected):
            raise StepInputError(
                f"traces do not match {algo.name}.init(graph, state) for this graph"
            )
        _remember(graph, key)
    moving, traces, outs = _evolve_jit(graph, return_outputs, algo, state, traces, xs)
    return rejoin(state.params, moving), traces, outs


def _bptt_impl(
    graph: ETraceGraph,
    user_loss: LossFn | AuxLossFn[Any],
    state: ModelState,
    xs: Any,
    targets: Any,
    has_aux: bool = False,
) -> tuple[PathDict[PyTree], dict[str, Any]]:
    loss_fn = _with_aux(user_loss, has_aux)

    def total(params: PathDict[PyTree]) -> Any:
        def body(m: Any, inp: Any) -> Any:
            x, t = inp
            out, s2 = forward_pure(graph, rejoin(params, m), as_args(graph, x))
            return moving_parts(s2), loss_fn(out, t)

        final, (losses, loss_aux) = jax.lax.scan(body, moving_parts(state), (xs, targets))
        return jnp.sum(losses), (losses, loss_aux, final)

    # under `shard_map`, each device's own gradient (as `online_grad`'s): replicated
    # weights would otherwise get theirs summed over the devices by autodiff
    params = vary_tree(state.params, state, xs)
    (_, (losses, loss_aux, final)), grads = jax.value_and_grad(total, has_aux=True)(params)
    aux = {"losses": losses, "state": final}
    if has_aux:
        aux["loss_aux"] = loss_aux
    return grads, aux


_bptt_jit = jax.jit(_bptt_impl, static_argnums=(0, 1, 5))


def bptt_grad(
    graph: ETraceGraph,
    state: ModelState,
    xs: Any,
    targets: Any,
    loss_fn: LossFn | AuxLossFn[Any],
    *,
    has_aux: bool = False,
) -> BPTTResult:
    """Exact gradient of ``Σ_t loss_fn(y_t, target_t)`` by backpropagation through time
    (`jax.grad` over one `lax.scan`): the reference to check an online approximation
    against. Same data contracts as `online_grad`; memory grows with the length.
    With ``has_aux=True``, `loss_fn` returns ``(loss, aux)`` as for `online_grad`.

    **Returns:** a `BPTTResult`, which unpacks as ``(grads, aux)`` with ``aux['losses']``
    and the final ``aux['state']`` (also ``result.losses``, ``result.state``), and with
    `has_aux` the stacked ``aux['loss_aux']`` (``result.loss_aux``).

    **Raises:** as `online_grad`.
    """
    require_graph(graph, "bptt_grad")
    loss_fn = keyed(loss_fn)
    xs = _cast_sequence(graph, xs)
    state = fast_check_state(graph, state)
    _check_sequences(graph, xs, targets, loss_fn)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be True or False, got {has_aux!r}")
    key = ("bptt", _avals(xs), _avals(targets), loss_fn, has_aux)
    if not _seen(graph, key):
        _check_loss(graph, targets, loss_fn, has_aux)
        _remember(graph, key)
    with _reverse_mode_explained(graph, "bptt_grad"):
        grads, aux = _bptt_jit(graph, loss_fn, state, xs, targets, has_aux)
    aux["state"] = rejoin(state.params, aux["state"])  # the weights, not a copy of them
    return BPTTResult(grads, cast(BPTTAux, aux))
