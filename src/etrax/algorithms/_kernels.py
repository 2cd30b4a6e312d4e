"""Trace kernels shared by the algorithms.

Two implementations of the D-RTRL recursion per slot:

- *generic*: through the op's `ETPRules` (`instant`, `scale`, `solve`), in the rule
  layout ``(*extra, *trace_shape, S)``, vmapped over the extra broadcast axes;
- *fused*: for ops whose rules `factor`, in the canonical layout
  ``(NB, I, O, S)`` (or ``(NB, O, S)``), as einsums, including a *chunked* form that
  re-associates K steps so the trace is read and written once per chunk.

Both compute exactly the same recursion
``ε_t[..., a] = Σ_b D_t[..., a, b] ε_{t-1}[..., b] + instant(x_t, df_t[..., a])``
and gradient ``Σ_a solve(L_t[..., a], ε_t[..., a])``.
"""

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._compat import vary_tree
from ._plan import Slot

__all__ = [
    "ChunkBackward",
    "ChunkParts",
    "chunk_backward",
    "chunk_grads",
    "drtrl_chunk_parts",
    "drtrl_init",
    "drtrl_solve",
    "drtrl_update",
    "instant_contribution",
    "map_extra",
    "matvec",
    "short_sum",
]

Trace = dict[str, Array]


SHORT_AXIS = 8
"""Axes up to this length are summed by `short_sum` as a chain of additions."""


def short_sum(x: Array, axis: int = -1) -> Array:
    """``jnp.sum(x, axis)``, written for a short axis (the ``S`` states of a hidden
    group) as additions of its slices, which fuse into the surrounding element-wise
    loop. XLA:CPU lowers a reduction over a short minor axis to a library kernel
    (YNNPACK) that costs about 100 µs per call whatever its size: a two-state
    model's per-step trace update ran 5-10× slower than with these additions."""
    n = x.shape[axis]
    if n == 0 or n > SHORT_AXIS:
        return jnp.sum(x, axis=axis)
    if n == 1:
        return jax.lax.squeeze(x, (axis % x.ndim,))
    parts = (jax.lax.index_in_dim(x, j, axis, keepdims=False) for j in range(n))
    return functools.reduce(operator.add, parts)


def map_extra(slot: Slot, fn: Callable[..., Any], mapped: tuple[Any, ...], *, reduce: bool) -> Any:
    """Apply `fn` over the slot's extra broadcast axes (leading axes of each mapped
    argument); sum the results over them when `reduce`."""
    n = len(slot.extra)
    f = fn
    for _ in range(n):
        f = jax.vmap(f)
    out = f(*mapped)
    if reduce and n:
        out = jax.tree.map(lambda v: jnp.sum(v, axis=tuple(range(n))), out)
    return out


def drtrl_init(slot: Slot, dtype: Any) -> Trace:
    S = slot.num_state
    return {k: jnp.zeros((*slot.extra, *slot.trace_shapes[k], S), dtype) for k in slot.keys}


# --- canonical layout ------------------------------------------------------------------


def _canon_out(slot: Slot, a: Array, trailing: int) -> Array:
    """``(*varshape, *T)`` with ``len(T) == trailing`` → ``(NB, O, *T)``."""
    tail = a.shape[a.ndim - trailing :] if trailing else ()
    return a.reshape(slot.nb, slot.out, *tail)


def _canon_u(slot: Slot, u: Array) -> Array:
    """An input factor ``(*op_batch, I)`` broadcast over extra axes → ``(NB, I)``."""
    full = jnp.broadcast_to(u, (*slot.extra, *u.shape))
    return full.reshape(slot.nb, u.shape[-1])


def _canon_trace(slot: Slot, key: str, eps: Array) -> Array:
    i = slot.inputs[key]
    S = slot.num_state
    if i is None:
        return eps.reshape(slot.nb, slot.out, S)
    return eps.reshape(slot.nb, i, slot.out, S)


def _factors(slot: Slot, x: Array | None) -> dict[str, Array | None]:
    assert slot.rules.factor is not None
    fac = slot.rules.factor(x, slot.params)
    return {k: None if u is None else _canon_u(slot, u) for k, u in fac.inputs.items()}


def _mix(M: Array, e: Array, has_input: bool) -> Array:
    """``Σ_c M[n, o, a, c] e[n, (i,) o, c]`` as broadcast products (no batched matvecs)."""
    if has_input:
        M = M[:, None]
    return matvec(M, e)


SLICE_LOOP_BACKENDS: tuple[str, ...] = ("cpu",)
"""Backends on which `weigh_many` contracts slice by slice (a loop) instead of in one
contraction."""


Weighing = tuple[Array, Array, bool]
"""One term ``(A, e, has_input)`` of `weigh_many`: ``A (NB, O, S)`` and the trace
``e (NB, (I,) O, S)``."""


def _weigh_slice(A: Array, e: Array, has_input: bool, n: Any) -> Array:
    a = jax.lax.dynamic_index_in_dim(A, n, keepdims=has_input)
    return short_sum(a * jax.lax.dynamic_index_in_dim(e, n, keepdims=False))


def _group_dtype(group: Sequence[Weighing]) -> Any:
    return jnp.result_type(*(x for A, e, _ in group for x in (A, e)))


def _weigh_direct(group: Sequence[Weighing], on_cpu: bool) -> Array:
    parts = []
    for A, e, has_input in group:
        if on_cpu:
            a = A[:, None] if has_input else A
            parts.append(short_sum(short_sum(a * e), axis=0))
        else:
            spec = "noa,nioa->io" if has_input else "noa,noa->o"
            parts.append(jnp.einsum(spec, A, e.astype(jnp.result_type(A, e))))
    return functools.reduce(operator.add, parts).astype(_group_dtype(group))


def _weigh_step(
    groups: Sequence[Sequence[Weighing]], n: Any, accs: tuple[Array, ...]
) -> tuple[Array, ...]:
    return tuple(
        acc + functools.reduce(operator.add, (_weigh_slice(A, e, h, n) for A, e, h in group))
        for acc, group in zip(accs, groups, strict=True)
    )


def weigh_many(groups: Sequence[Sequence[Weighing]]) -> list[Array]:
    """For each group of terms, ``Σ_terms Σ_{n,a} A[n, o, a] e[n, (i,) o, a]`` (the
    terms of a group share the output shape; every term shares the batch ``NB``).

    On CPU, accumulated one batch slice at a time, every group in one loop: XLA's CPU
    reductions over a major axis of a large array are an order of magnitude slower
    than this loop, which reads each trace once. Up to `SHORT_AXIS` slices are summed
    without a loop (`short_sum`: element-wise fusions, and a much smaller program to
    compile). On accelerators, where each loop iteration is a kernel launch and the
    reduction is fast, one contraction per term.
    """
    on_cpu = jax.default_backend() in SLICE_LOOP_BACKENDS
    sizes = {e.shape[0] for group in groups for _, e, _ in group}
    if not on_cpu or max(sizes, default=0) <= SHORT_AXIS:
        return [_weigh_direct(group, on_cpu) for group in groups]
    (count,) = sizes
    operands = [x for group in groups for A, e, _ in group for x in (A, e)]
    init = tuple(jnp.zeros(group[0][1].shape[1:-1], _group_dtype(group)) for group in groups)
    step = functools.partial(_weigh_step, groups)
    return list(jax.lax.fori_loop(0, count, step, vary_tree(init, *operands)))


# --- per-step ----------------------------------------------------------------------------


def _fused_update(slot: Slot, eps: Trace, x: Array | None, df: Array, D: Array) -> Trace:
    dfc = _canon_out(slot, df, 1)  # (NB, O, S)
    Dc = _canon_out(slot, D, 2)  # (NB, O, S, S)
    us = _factors(slot, x)
    out = {}
    for k in slot.keys:
        e = _canon_trace(slot, k, eps[k])
        u = us[k]
        if u is None:
            new = _mix(Dc, e, False) + dfc
        else:
            new = _mix(Dc, e, True) + u[:, :, None, None] * dfc[:, None]
        out[k] = new.reshape(eps[k].shape)
    return out


def _generic_update(
    slot: Slot, eps: Trace, x: Array | None, df: Array, D: Array, weights: Mapping[str, Array]
) -> Trace:
    rules = slot.rules
    S = slot.num_state

    def one(e: Trace, d: Array, jac: Array) -> Trace:
        incs = [rules.instant(x, d[..., a], weights, slot.params) for a in range(S)]
        out = {}
        for k in slot.keys:
            cols = []
            for a in range(S):
                acc = incs[a][k]
                for b in range(S):
                    scaled = rules.scale(
                        jac[..., a, b], {kk: e[kk][..., b] for kk in slot.keys}, slot.params
                    )
                    acc = acc + scaled[k]
                cols.append(acc)
            out[k] = jnp.stack(cols, axis=-1).astype(e[k].dtype)
        return out

    return map_extra(slot, one, (eps, df, D), reduce=False)  # type: ignore[no-any-return]


def drtrl_update(
    slot: Slot,
    eps: Trace,
    x: Array | None,
    df: Float[Array, "*pos S"],
    D: Float[Array, "*pos S S"],
    weights: Mapping[str, Array],
) -> Trace:
    """One step of the D-RTRL recursion for one slot."""
    if slot.factorized:
        return _fused_update(slot, eps, x, df, D)
    return _generic_update(slot, eps, x, df, D, weights)


def _weight_shape(slot: Slot, key: str) -> tuple[int, ...]:
    return tuple(slot.eff_shapes[key])


def drtrl_solve(
    slot: Slot, eps: Trace, L: Float[Array, "*pos S"], weights: Mapping[str, Array]
) -> Trace:
    """Effective-operand gradient ``Σ_a solve(L[..., a], ε[..., a])`` of one slot."""
    if slot.factorized:
        Lc = _canon_out(slot, L, 1)
        terms = [
            [(Lc, _canon_trace(slot, k, eps[k]), slot.inputs[k] is not None)] for k in slot.keys
        ]
        return {
            k: g.reshape(_weight_shape(slot, k))
            for k, g in zip(slot.keys, weigh_many(terms), strict=True)
        }
    rules = slot.rules

    def one(e: Trace, sig: Array) -> Trace:
        total: Trace = {}
        for a in range(slot.num_state):
            g = rules.solve(sig[..., a], {k: e[k][..., a] for k in slot.keys}, weights, slot.params)
            total = {k: total[k] + g[k] if k in total else g[k] for k in g}
        return total

    return map_extra(slot, one, (eps, L), reduce=True)  # type: ignore[no-any-return]


def instant_contribution(
    slot: Slot, x: Array | None, df: Array, L: Array, weights: Mapping[str, Array]
) -> Trace:
    """The within-step traced gradient ``Σ_a solve(L_a, instant(x, df_a))`` of a slot
    (equal to ``contract(x, Σ_a df_a L_a)``)."""
    sig = short_sum(df * L)
    rules = slot.rules

    def one(s: Array) -> Trace:
        return rules.contract(x, s, weights, slot.params)

    return map_extra(slot, one, (sig,), reduce=True)  # type: ignore[no-any-return]


# --- chunked (fused only) --------------------------------------------------------------------


def squeezed(a: Any, lead: int = 0) -> Any:
    """`a` without its axes of length 1 after the first `lead` (a bitcast in XLA).
    A loop's buffers (zero fills, copies, stacking writes) are compiled as a kernel
    per distinct shape on XLA:CPU; stored this way, values that differ only by such
    axes (a one-state group's ``(P, 1)`` signals and ``(P, 1, 1)`` Jacobians) share
    them, which shortens the compile. Other axes are kept: flattening a two-state
    group's ``(P, 2, 2)`` blocks into rows made its loops up to 1.7× slower."""
    if jnp.issubdtype(a.dtype, jax.dtypes.extended) or 1 not in a.shape[lead:]:
        return a
    return a.reshape(*a.shape[:lead], *(d for d in a.shape[lead:] if d != 1))


def squeezed_scan(
    body: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any, reverse: bool = False
) -> tuple[Any, Any]:
    """``jax.lax.scan(body, init, xs, reverse=reverse)`` whose carried values and
    per-step inputs and outputs are stored `squeezed` (reshaped back in and out of
    `body`, so `body` sees the shapes it is given and returns)."""
    init_leaves, init_def = jax.tree.flatten(init)
    x_leaves, x_def = jax.tree.flatten(xs)
    init_shapes = [a.shape for a in init_leaves]
    x_shapes = [a.shape[1:] for a in x_leaves]
    out_layout: list[tuple[Any, list[tuple[int, ...]]]] = []

    def shaped(leaves: list[Any], shapes: list[tuple[int, ...]]) -> list[Any]:
        return [a.reshape(s) for a, s in zip(leaves, shapes, strict=True)]

    def inner(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        carry = jax.tree.unflatten(init_def, shaped(c, init_shapes))
        carry, y = body(carry, jax.tree.unflatten(x_def, shaped(x, x_shapes)))
        y_leaves, y_def = jax.tree.flatten(y)
        out_layout.append((y_def, [a.shape for a in y_leaves]))
        return [squeezed(a) for a in jax.tree.leaves(carry)], [squeezed(a) for a in y_leaves]

    c, ys = jax.lax.scan(
        inner,
        [squeezed(a) for a in init_leaves],
        [squeezed(a, 1) for a in x_leaves],
        reverse=reverse,
    )
    y_def, y_shapes = out_layout[-1]
    stacked = [a.reshape(a.shape[0], *s) for a, s in zip(ys, y_shapes, strict=True)]
    return jax.tree.unflatten(init_def, shaped(c, init_shapes)), jax.tree.unflatten(y_def, stacked)


def matvec(M: Array, v: Array) -> Array:
    """``M[..., a, c] v[..., c] → (..., a)`` for the small ``S × S`` blocks, as
    broadcast products (no batched matvecs). With one state (``S = 1``) it is the
    element-wise product ``M[..., 0] v``, the same arithmetic written without the
    size-1 axes: a loop that updates a trace ``v`` then writes the new trace into
    the old one's buffer, where a reshaped operand made XLA copy it every step."""
    if M.shape[-2:] == (1, 1):
        return M[..., 0] * v
    return short_sum(M * v[..., None, :])


def _matmul(M: Array, N: Array) -> Array:
    """``M[..., a, c] N[..., c, b] → (..., a, b)`` for the small ``S × S`` blocks
    (with ``S = 1`` the element-wise product, as in `matvec`)."""
    if M.shape[-2:] == N.shape[-2:] == (1, 1):
        return M * N
    return short_sum(M[..., :, :, None] * N[..., None, :, :], axis=-2)


def _decay_matrix(K: int, kappa: float, dtype: Any) -> Array:
    """``M[k, j] = κ^{j-k}`` for ``j ≥ k``, else 0 (``K × K``)."""
    lag = np.arange(K)[None, :] - np.arange(K)[:, None]
    return jnp.asarray(np.where(lag >= 0, float(kappa) ** np.maximum(lag, 0), 0.0), dtype)


class ChunkBackward(NamedTuple):
    """A chunk's backward pass for one hidden group, shared by every slot of the
    group (positions flattened: ``P`` is the size of the group's varshape).

    With ``Q_k = D_{K-1} ⋯ D_{k+1}`` and ``G_k = L_k + D_{k+1}^T G_{k+1}``:

    - `A` ``(P, S)``: ``D_0^T G_0`` (plus ``N_0``), the signal on the trace carried in;
    - `P` ``(P, S, S)``: ``Q_0 D_0``, what multiplies the trace carried in;
    - `G` ``(K, P, S)`` and `Q` ``(K, P, S, S)``: ``G_k`` and ``Q_k`` of every step;
    - with e-prop's filter: `Pf` ``(P, S, S)`` (``P̃_0 D_0``), `Pfs` ``(K, P, S, S)``
      (``P̃_k``) and `edge` ``(P, S)`` (the signal on the filtered trace carried in).
    """

    A: Array
    P: Array
    G: Array
    Q: Array
    Pf: Array | None = None
    Pfs: Array | None = None
    edge: Array | None = None


def _back_step(eye: Array | None, carry: tuple[Array, ...], inp: tuple[Array, ...]) -> Any:
    """One step back through a chunk (`chunk_backward`); `eye` only with the filter."""
    g_acc, Q, Pf = carry  # D_{k+1}^T G_{k+1}, Q_k, P̃_k (P̃ only with the filter)
    L_k, D_k, w_k = inp
    G_k = L_k + g_acc
    g_next = matvec(jnp.swapaxes(D_k, -1, -2), G_k)
    Q_next = _matmul(Q, D_k)
    if eye is None:
        return (g_next, Q_next, Pf), (G_k, Q, None)
    return (g_next, Q_next, _matmul(Pf, D_k) + w_k * eye), (G_k, Q, Pf)


def chunk_backward(
    Ds: Array, Ls: Array, Ns: Array | None = None, kappa: float | None = None
) -> ChunkBackward:
    """The backward pass of a chunk of one group's Jacobians ``Ds (K, *pos, S, S)``
    and signals ``Ls (K, *pos, S)`` (`ChunkBackward`): one reverse loop over the
    chunk, whatever the number of weights that feed the group.

    With `Ns` (signals on the *old* hidden values, ``Σ_k N_k ε_{k-1}``), step ``k``'s
    signal gains ``N_{k+1}`` and ``ε_0`` is contracted with ``N_0`` too. With `kappa`
    (e-prop's filter ``ē_k = κ ē_{k-1} + ε_k``), the signals are reverse-filtered,
    ``L̃_j = L_j + κ L̃_{j+1}``, so that the unfiltered chunk formula applies to
    ``L̃``, and ``P̃_k = κ^{K-1-k} + P̃_{k+1} D_{k+1}`` gives the new filtered trace.
    """
    K, S = Ls.shape[0], Ls.shape[-1]
    Dc = Ds.reshape(K, -1, S, S)
    Lc = Ls.reshape(K, -1, S)
    N0 = None
    if Ns is not None:
        Nc = Ns.reshape(K, -1, S)
        N0 = Nc[0]
        Lc = Lc + jnp.concatenate([Nc[1:], jnp.zeros_like(Nc[:1])], axis=0)
    edge = None
    filt = kappa is not None
    if kappa is not None:
        # L̃_k = Σ_{j ≥ k} κ^{j-k} L_j: one product with a triangular decay matrix
        # (K × K, constant) instead of a reverse loop over the chunk
        Lc = jnp.tensordot(_decay_matrix(K, kappa, Lc.dtype), Lc, axes=1)
        edge = kappa * Lc[0] if N0 is None else kappa * Lc[0] + N0
        N0 = None  # with the filter, N_0 reads the filtered trace carried in
    eye = jnp.broadcast_to(jnp.eye(S, dtype=Lc.dtype), Dc.shape[1:])

    # P̃_{K-1} = I and P̃_{k-1} = κ^{K-k} I + P̃_k D_k: stepping back from step k adds
    # κ^{K-k}, except from step 0, whose product P̃_0 D_0 is what multiplies ε_0
    weights = jnp.zeros((K,), Lc.dtype)
    if kappa is not None:
        k_idx = jnp.arange(K)
        power = jnp.asarray(kappa, Lc.dtype) ** (K - k_idx).astype(Lc.dtype)
        weights = jnp.where(k_idx > 0, power, jnp.zeros_like(power))
    init = vary_tree((jnp.zeros_like(Lc[0]), eye, eye), Lc, Dc)
    back = functools.partial(_back_step, eye if filt else None)
    (A, P, Pf), (G, Q, Pfs) = squeezed_scan(back, init, (Lc, Dc, weights), reverse=True)
    if N0 is not None:
        A = A + N0
    if not filt:
        return ChunkBackward(A, P, G, Q)
    return ChunkBackward(A, P, G, Q, Pf, Pfs, edge)


class ChunkParts(NamedTuple):
    """One slot's chunk (`drtrl_chunk_parts`): the new traces (and filtered traces),
    and per trace key the weighing terms of the traces carried in (for `weigh_many`)
    and the gradient of the chunk's fresh inputs."""

    eps: Trace
    filtered: Trace | None
    terms: list[list[Weighing]]
    fresh: list[Array]


def drtrl_chunk_parts(
    slot: Slot,
    eps: Trace,
    xs: Array | None,
    dfs: Array,
    back: ChunkBackward,
    filtered: Trace | None = None,
    kappa: float | None = None,
) -> ChunkParts:
    """K steps of the fused recursion of one slot at once, from its group's
    `ChunkBackward`:

    - ``ε_K = (Q_0 D_0) ε_0 + Σ_k u_k ⊗ (Q_k df_k)``;
    - ``Σ_k Σ_a L_k ε_k = ⟨D_0^T G_0, ε_0⟩ + Σ_k u_k ⊗ ⟨df_k, G_k⟩``;

    so ``ε`` is read and written once per chunk and the per-step terms become
    (batched) matrix products. Equal to K applications of the per-step form. The
    first term of the gradient is left as `weigh_many` terms, so that the traces of
    every slot of a hidden group are weighed in one loop (`chunk_grads`).

    With e-prop's filter (`kappa`, the filtered traces `filtered`, and a filtered
    `back`), the new filtered trace is ``ē_{K-1} = κ^K ē_{-1} + Σ_j κ^{K-1-j} ε_j =
    κ^K ē_{-1} + (P̃_0 D_0) ε_0 + Σ_k u_k ⊗ (P̃_k df_k)`` and the signal on the
    filtered trace carried in is ``κ L̃_0``: one more mixing product and one more
    stacked product than the unfiltered chunk, both per chunk. Equal to K steps of
    the per-step filter.
    """
    S = slot.num_state
    K = dfs.shape[0]
    dfc = dfs.reshape(K, slot.nb, slot.out, S)
    A = _canon_out(slot, back.A, 1)
    P = _canon_out(slot, back.P, 2)
    G = back.G.reshape(K, slot.nb, slot.out, S)
    R = matvec(back.Q.reshape(K, slot.nb, slot.out, S, S), dfc)  # Q_k df_k
    W = short_sum(G * dfc)  # (K, NB, O); G first: every slot gets the same XLA kernel
    us = None if xs is None else jax.vmap(lambda v: _factors(slot, v))(xs)
    filtering = filtered is not None and kappa is not None and back.Pfs is not None
    if filtering:
        assert back.Pf is not None and back.Pfs is not None and back.edge is not None
        Rf = matvec(back.Pfs.reshape(K, slot.nb, slot.out, S, S), dfc)  # P̃_k df_k
        Pf = _canon_out(slot, back.Pf, 2)
        edge = _canon_out(slot, back.edge, 1)
    new_eps: Trace = {}
    new_filt: Trace = {}
    fresh_grads: list[Array] = []
    terms: list[list[Weighing]] = []  # the carried traces' part, weighed in one loop
    for k in slot.keys:
        e0 = _canon_trace(slot, k, eps[k])
        u = None if us is None else us[k]
        has_u = u is not None
        terms.append([(A, e0, has_u)])
        if u is None:
            fresh_grads.append(jnp.sum(W, axis=(0, 1)))
            eK = _mix(P, e0, False) + jnp.sum(R, axis=0)
        else:
            fresh_grads.append(jnp.einsum("kni,kno->io", u, W))
            eK = _mix(P, e0, True) + jnp.einsum("kni,knoa->nioa", u, R)
        if filtering:
            assert filtered is not None and kappa is not None
            f0 = _canon_trace(slot, k, filtered[k])
            terms[-1].append((edge, f0, has_u))
            fresh = jnp.sum(Rf, axis=0) if u is None else jnp.einsum("kni,knoa->nioa", u, Rf)
            # in this order every slot of a group gets the same XLA kernel (docs/benchmarks.md)
            fK = _mix(Pf, e0, has_u) + kappa**K * f0 + fresh
            new_filt[k] = fK.reshape(filtered[k].shape).astype(filtered[k].dtype)
        new_eps[k] = eK.reshape(eps[k].shape).astype(eps[k].dtype)
    return ChunkParts(new_eps, new_filt if filtering else None, terms, fresh_grads)


def chunk_grads(parts: Sequence[tuple[Slot, ChunkParts]]) -> list[Trace]:
    """Each slot's gradient over its chunk, from `drtrl_chunk_parts`: the traces of
    the slots of one hidden group (with one batch size) are weighed in one
    `weigh_many` loop, not one loop per slot (a smaller program to compile). Each
    group keeps its own loop: one loop for the slots of every layer of a stack held
    all their chunk's temporaries at once (6 % more memory for 16 GRU layers)."""
    together: dict[tuple[int, int], list[int]] = {}
    for n, (slot, _) in enumerate(parts):
        together.setdefault((slot.group, slot.nb), []).append(n)
    weighed: dict[int, list[Array]] = {}
    for members in together.values():
        out = iter(weigh_many([t for n in members for t in parts[n][1].terms]))
        for n in members:
            weighed[n] = [next(out) for _ in parts[n][1].terms]
    return [
        {
            k: (carried + fresh).reshape(_weight_shape(slot, k))
            for k, carried, fresh in zip(slot.keys, weighed[n], p.fresh, strict=True)
        }
        for n, (slot, p) in enumerate(parts)
    ]
