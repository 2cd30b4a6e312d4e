"""Sparse-n traces (SnAp-n): per-parameter traces over the n-step neighbourhood of
the position each weight entry feeds.

A weight entry that feeds position ``p`` of a group first changes ``h[p]``; one step
later it reaches the positions that ``p`` feeds through the group's whole
transition (weight ops included), and so on. SnAp-n keeps the trace entries of the
positions reached in fewer than ``n`` steps (``n − 1`` hops of the position graph)
and drops the rest: SnAp-1 is the coupled scope, and once ``n − 1`` reaches the
position graph's diameter the traces are full within-group RTRL.

The position graph is probed once per graph and group: the transition's Jacobian at
random points (random parameters, hidden values and inputs, around zero and around
the model's current values, at three spreads); an entry that is non-zero at any of
them is an edge. A sparse recurrent weight gives its pattern, a dense one all-to-all
(within each batch entry, which no op mixes). A dependence whose derivative vanishes
on a large region (a ReLU, a surrogate spike function with compact support) can be
missed at every point; the traces then drop it, as they drop every dependence outside
the neighbourhood. A `ProbeWarning` says when the pattern changes from point to point,
and when a weight reads the group's previous values but no dependence showed at all.
"""

import warnings
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._compat import Literal
from .._errors import CompilationError, ProbeWarning
from .._pathdict import PathDict
from ..compiler import ETraceGraph, StateKind
from ..executor import ModelState, StepPoint
from ._plan import Slot

__all__ = ["Neighbourhood", "neighbourhood", "snap_init", "snap_solve", "snap_update"]

Trace = dict[str, Array]


@dataclass(frozen=True)
class Neighbourhood:
    """The positions each position's trace covers (static, NumPy).

    **Arguments:**

    - `index`: ``(P, K)`` neighbour positions of each position (padded with itself).
    - `mask`: ``(P, K)`` 1 for a real neighbour, 0 for padding.
    - `own`: ``(P, K)`` 1 where the neighbour is the position itself.
    """

    index: np.ndarray
    mask: np.ndarray
    own: np.ndarray

    @property
    def width(self) -> int:
        """``K``: the most positions any trace covers."""
        return int(self.index.shape[1])


def _random_point(
    graph: ETraceGraph, seed: int, scale: float = 1.0, around_model: bool = False
) -> StepPoint:
    """A point with random float parameters, hidden values, other states and inputs
    (normal, with standard deviation `scale`); with `around_model`, the states are
    drawn around the model's own current values instead of zero, the spread scaled by
    their size (a membrane near −65 mV with a threshold at −50 mV only crosses it
    there)."""
    rng = np.random.default_rng(seed)

    def draw(a: Any, center: Any = None) -> Any:
        a = np.asarray(a)
        if not np.issubdtype(a.dtype, np.floating):
            return jnp.asarray(a)
        noise = scale * rng.standard_normal(a.shape)
        if center is not None:
            c = np.asarray(center, np.float64)
            noise = c + noise * (np.abs(c) + 1.0)
        return jnp.asarray(noise.astype(a.dtype))

    def blank(shape: Any, dtype: Any, current: Any) -> Any:
        if jnp.issubdtype(dtype, jax.dtypes.extended):  # a typed PRNG key
            return jnp.broadcast_to(jax.random.key(0, impl=dtype._impl), shape)
        center = None
        if around_model and current is not None and tuple(np.shape(current)) == tuple(shape):
            center = _mantissa(current)  # the live value, when of the compiled shape
        return draw(np.zeros(shape, dtype), center)

    mi = graph.module_info  # the compiled shapes (one sample's under a vmap learner)
    kinds: dict[StateKind, PathDict[Any]] = {k: PathDict() for k in StateKind}
    for info, ref in zip(mi.states, mi.state_refs.states, strict=True):
        live = jax.tree.leaves(ref.value) if around_model else []
        if len(live) != len(info.shapes):
            live = [None] * len(info.shapes)
        leaves = [
            blank(sh, dt, cur) for sh, dt, cur in zip(info.shapes, info.dtypes, live, strict=True)
        ]
        kinds[info.kind][info.path] = jax.tree.unflatten(info.treedef, leaves)
    state = ModelState(kinds[StateKind.WEIGHT], kinds[StateKind.HIDDEN], kinds[StateKind.OTHER])
    leaves = [draw(np.zeros(shape, dtype)) for shape, dtype in mi.in_avals]
    return StepPoint(state, tuple(jax.tree.unflatten(mi.in_tree, leaves)))


def _adjacency(graph: ETraceGraph, index: int, max_elements: int) -> np.ndarray:
    """``A[q, p]``: whether ``h^t[q]`` depends on ``h^{t-1}[p]`` (``P × P``, boolean)."""
    group = graph.hidden_groups[index]
    P = int(np.prod(group.varshape, dtype=np.int64))
    S = group.num_state
    if max_elements < (P * S) ** 2:
        raise CompilationError(
            f"SnAp probes hidden group {index}'s transition Jacobian ({P * S}² = "
            f"{(P * S) ** 2} elements), more than max_elements={max_elements}; raise "
            "max_elements or use the coupled or diagonal scope"
        )
    found = np.zeros((P, P), dtype=bool)
    varies = False  # whether the pattern depends on the point
    with jax.ensure_compile_time_eval():
        small = np.zeros((P, P), dtype=bool)
        for seed in range(PROBES):  # an edge is a dependence at any of the points
            scale = _SCALES[(seed // 2) % len(_SCALES)]
            point = _random_point(graph, seed, scale, around_model=seed % 2 == 1)
            jac = np.asarray(point.transition_jacobian(graph, index))
            edges = np.abs(jac.reshape(P, S, P, S)).sum(axis=(1, 3)) > 0
            found |= edges
            if scale < 1.0:  # a wide point may saturate a tanh to an exact zero slope
                varies |= seed > 1 and not np.array_equal(edges, small)
                small |= edges
    off_diagonal = bool((found & ~np.eye(P, dtype=bool)).any())
    if not off_diagonal and P > 1 and _recurrent_weight(graph, index):
        warnings.warn(
            f"SnAp: hidden group {index}'s previous values feed a weight operation whose "
            "output reaches the group again, yet no dependence between its positions showed "
            f"at any of {PROBES} points (around zero and around the model's current "
            "values): its neighbourhoods hold each position alone, so SnAp runs as "
            "OSTLRecurrent() here. A dependence that only shows in a narrow range of values "
            "(a spike threshold far from the probes) is missed; check the model's values, "
            "or use OSTLRecurrent() or D-RTRL knowingly.",
            ProbeWarning,
            stacklevel=2,
        )
    if varies:
        warnings.warn(
            f"SnAp: the dependences between positions of hidden group {index} differ from "
            f"point to point (a derivative that vanishes over a region, such as a ReLU's); "
            f"its neighbourhoods are their union over {PROBES} random points, which can miss "
            "a dependence that is rarely active. OSTLRecurrent() (the whole within-group "
            "transition) has no such risk.",
            ProbeWarning,
            stacklevel=2,
        )
    return found | np.eye(P, dtype=bool)


PROBES = 16
"""How many random points `SnAp`'s position graph is probed at: half around zero, half
around the model's current values."""


def _mantissa(value: Any) -> Any:
    """A state value as a plain array (the mantissa of a quantity with units)."""
    mantissa = getattr(value, "mantissa", None)
    return np.asarray(value if mantissa is None else mantissa)


def _recurrent_weight(graph: ETraceGraph, index: int) -> bool:
    """Whether a relation into group `index` reads a value computed from the group's
    own previous values (a recurrent weight: a dependence between positions)."""
    from ..compiler._jaxpr import VarTable

    group = graph.hidden_groups[index]
    jaxpr = graph.module_info.jaxpr
    vt = VarTable(jaxpr)
    reach = {vt.var(v) for v in group.hidden_invars}
    for eqn in jaxpr.eqns:
        if any(not isinstance(a, Literal) and a in reach for a in eqn.invars):
            reach.update(eqn.outvars)
    return any(
        index in rel.hidden_groups and rel.x_var is not None and vt.var(rel.x_var) in reach
        for rel in graph.hidden_param_op_relations
    )
_SCALES = (0.1, 0.3, 1.0)  # spreads: units switch on and off at different points


def neighbourhood(graph: ETraceGraph, index: int, n: int, max_elements: int) -> Neighbourhood:
    """The positions reached from each position of group `index` in at most ``n − 1``
    steps of its transition (computed once per graph, group and ``n``)."""

    def build() -> Neighbourhood:
        A = _adjacency(graph, index, max_elements)
        reach = np.eye(A.shape[0], dtype=bool)  # reach[p, q]: q reached from p
        for _ in range(n - 1):
            reach = reach | ((reach.astype(np.int64) @ A.T.astype(np.int64)) > 0)
        P = A.shape[0]
        width = int(reach.sum(axis=1).max())
        idx = np.tile(np.arange(P)[:, None], (1, width))
        mask = np.zeros((P, width), dtype=np.float64)
        for p in range(P):
            qs = np.flatnonzero(reach[p])
            idx[p, : qs.size] = qs
            mask[p, : qs.size] = 1.0
        own = ((idx == np.arange(P)[:, None]) & (mask > 0)).astype(np.float64)
        return Neighbourhood(idx, mask, own)

    return graph.memo.get(f"snap:{index}:{n}:{max_elements}", build)


# --- kernels (factorised slots, canonical layout (NB, [I,] O, K, S)) ----------------------


def _check_slot(slot: Slot) -> None:
    P = int(np.prod(slot.varshape, dtype=np.int64))
    if not slot.factorized or slot.nb * slot.out != P:
        raise CompilationError(
            "the sparse-n scope (SnAp) traces ops whose rules factorise (matmul, conv, …) "
            f"and whose output covers the group's positions; relation {slot.relation} does "
            "not. Use the coupled or diagonal scope for this model."
        )


def snap_init(slot: Slot, hood: Neighbourhood, dtype: Any) -> Trace:
    _check_slot(slot)
    K, S = hood.width, slot.num_state
    out: Trace = {}
    for key in slot.keys:
        i = slot.inputs[key]
        lead = (slot.nb,) if i is None else (slot.nb, i)
        out[key] = jnp.zeros((*lead, slot.out, K, S), dtype)
    return out


def gather_transition(
    full: Float[Array, "..."], hood: Neighbourhood, P: int, S: int
) -> Float[Array, "P K S K S"]:
    """``Jn[p, k, a, l, b] = J[N(p)_k, a, N(p)_l, b]`` (zero on padding), from the full
    ``(*varshape, S, *varshape, S)`` transition."""
    J = full.reshape(P, S, P, S)
    idx = jnp.asarray(hood.index)
    rows = J[idx]  # (P, K, S, P, S): J[N(p)_k, a, :, :]
    Jn = jnp.take_along_axis(rows, idx[:, None, None, :, None], axis=3)  # (P, K, S, K, S)
    m = jnp.asarray(hood.mask, J.dtype)
    return Jn * m[:, :, None, None, None] * m[:, None, None, :, None]


def _factor_inputs(slot: Slot, x: Array | None) -> dict[str, Array | None]:
    assert slot.rules.factor is not None
    fac = slot.rules.factor(x, slot.params)
    out: dict[str, Array | None] = {}
    for key, u in fac.inputs.items():
        if u is None:
            out[key] = None
        else:
            full = jnp.broadcast_to(u, (*slot.extra, *u.shape))
            out[key] = full.reshape(slot.nb, u.shape[-1])
    return out


def snap_update(
    slot: Slot,
    hood: Neighbourhood,
    eps: Trace,
    x: Array | None,
    df: Float[Array, "*pos S"],
    Jn: Float[Array, "P K S K S"],
) -> Trace:
    """``ε ← Jn ε + [own] u ⊗ df`` on each position's neighbourhood."""
    K, S = hood.width, slot.num_state
    J = Jn.reshape(slot.nb, slot.out, K, S, K, S)
    d = df.reshape(slot.nb, slot.out, S)
    own = jnp.asarray(hood.own, d.dtype).reshape(slot.nb, slot.out, K)
    inst = own[..., None] * d[:, :, None, :]  # (NB, O, K, S)
    us = _factor_inputs(slot, x)
    out: Trace = {}
    for key in slot.keys:
        e = eps[key]
        u = us[key]
        if u is None:
            out[key] = jnp.einsum("nokalb,nolb->noka", J, e) + inst
        else:
            mixed = jnp.einsum("nokalb,niolb->nioka", J, e)
            out[key] = mixed + u[:, :, None, None, None] * inst[:, None]
    return out


def snap_solve(slot: Slot, hood: Neighbourhood, eps: Trace, L: Float[Array, "*pos S"]) -> Trace:
    """``Σ_{k,a} L[N(p)_k, a] ε[..., p, k, a]`` per weight entry."""
    K, S = hood.width, slot.num_state
    flat = L.reshape(-1, S)
    Lg = flat[jnp.asarray(hood.index)] * jnp.asarray(hood.mask, L.dtype)[..., None]
    Lg = Lg.reshape(slot.nb, slot.out, K, S)
    out: Trace = {}
    for key in slot.keys:
        e = eps[key]
        if slot.inputs[key] is None:
            g = jnp.einsum("noka,noka->o", Lg, e)
        else:
            g = jnp.einsum("noka,nioka->io", Lg, e)
        out[key] = g.reshape(tuple(slot.eff_shapes[key]))
    return out
