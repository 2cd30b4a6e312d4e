"""Independent oracles for the tests.

The step is re-evaluated from brainstate's *own* jaxpr of ``model.update`` (not
etrax's sliced programs), and differentiated with `jax.jacrev` / `jax.grad`.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
from jaxtyping import Array

import etrax
from etrax._typing import Path, VarId

__all__ = [
    "BrainstateStep",
    "block_diagonal",
    "bptt_grads",
    "graph_env",
    "random_state_values",
    "tail_diagonal",
]


def random_state_values(graph: etrax.ETraceGraph, seed: int = 1) -> dict[Path, Any]:
    """Current weight values and random hidden/other values for every compiled state."""
    mi = graph.module_info
    key = jax.random.PRNGKey(seed)
    out: dict[Path, Any] = {}
    for info, ref in zip(mi.states, mi.state_refs.states, strict=True):
        value = ref.value
        if info.kind is etrax.compiler.StateKind.HIDDEN:
            key, sub = jax.random.split(key)
            value = jax.random.normal(sub, info.shapes[0], info.dtypes[0])
        out[info.path] = value
    return out


def graph_env(
    graph: etrax.ETraceGraph, args: Sequence[Any], state_vals: Mapping[Path, Any]
) -> dict[VarId, Any]:
    """Every value the graph's programs can ask for, keyed by `VarId`."""
    mi = graph.module_info
    _, hidden, _, hoisted = mi.jaxpr_call(*args, old_state_vals=state_vals)
    jaxpr = mi.jaxpr
    flat = mi.flatten_inputs(tuple(args), state_vals)
    env: dict[VarId, Any] = {}
    ids = {v: i for i, v in enumerate([*jaxpr.constvars, *jaxpr.invars])}
    for v, c in zip(jaxpr.constvars, mi.closed_jaxpr.consts, strict=True):
        env[ids[v]] = c
    for v, a in zip(jaxpr.invars, flat, strict=True):
        env[ids[v]] = a
    env.update(hoisted)
    for s in mi.hidden_states:
        if s.outvars[0] is not None:
            env[s.outvars[0]] = hidden[s.path]
    return env


def _eval(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    freeze_weights: bool,
    inject: tuple[int, Array] | None,
) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, c in zip(jaxpr.invars, args, strict=True):
        env[v] = c
    for i, eqn in enumerate(jaxpr.eqns):
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*[read(a) for a in eqn.invars], **params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        spec = etrax.etp_spec(eqn.primitive)
        if freeze_weights and spec is not None and not spec.gradient_enabled:
            outs = [jax.lax.stop_gradient(o) for o in outs]
        if inject is not None and i == inject[0]:
            outs = [outs[0] + inject[1], *outs[1:]]
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(a) for a in jaxpr.outvars]


class BrainstateStep:
    """``model.update`` as a pure function of hidden values, from brainstate's jaxpr.

    `freeze_weights=True` holds every trainable ETP op's output constant (the
    semantics of a transition: recurrent weights are boundaries).
    """

    def __init__(self, model: brainstate.nn.Module, args: Sequence[Any]) -> None:
        self.args = tuple(args)
        fn = brainstate.transform.StatefulFunction(model.update, return_only_write=False)
        self.closed = fn.get_jaxpr(*self.args)
        self.states = tuple(fn.get_states(*self.args))
        path_of = {st: p for p, st in model.states().items()}
        self.paths: tuple[Path, ...] = tuple(path_of[st] for st in self.states)
        out_shapes = fn.get_out_shapes(*self.args)[0]
        self.num_out = len(jax.tree.leaves(out_shapes))
        self.out_tree = jax.tree.structure(out_shapes)
        self.etp_equations = [
            i
            for i, e in enumerate(self.closed.jaxpr.eqns)
            if etrax.etp_spec(e.primitive) is not None
        ]

    def __call__(
        self,
        state_vals: Mapping[Path, Any],
        *,
        freeze_weights: bool = False,
        inject: tuple[int, Array] | None = None,
        args: Sequence[Any] | None = None,
    ) -> tuple[Any, dict[Path, Any]]:
        flat = list(jax.tree.leaves(self.args if args is None else tuple(args)))
        for p in self.paths:
            flat.extend(jax.tree.leaves(state_vals[p]))
        outs = _eval(self.closed.jaxpr, self.closed.consts, flat, freeze_weights, inject)
        out = jax.tree.unflatten(self.out_tree, outs[: self.num_out])
        new: dict[Path, Any] = {}
        pos = self.num_out
        for p, st in zip(self.paths, self.states, strict=True):
            n = len(jax.tree.leaves(st.value))
            new[p] = jax.tree.unflatten(jax.tree.structure(st.value), outs[pos : pos + n])
            pos += n
        return out, new


def bptt_grads(
    model: brainstate.nn.Module,
    state: etrax.ModelState,
    xs: Array,
    targets: Any,
    loss_fn: Any,
) -> dict[Path, Any]:
    """``∂ Σ_t loss_t / ∂ params`` by `jax.grad` over a `lax.scan` of brainstate's own
    jaxpr of ``model.update`` (one input per step), from `state`."""
    step = BrainstateStep(model, (xs[0],))
    carried = {**dict(state.hidden), **dict(state.other)}

    def total(params: dict[Path, Any]) -> Array:
        def body(vals: dict[Path, Any], xt: tuple[Array, Any]) -> tuple[dict[Path, Any], Array]:
            x, target = xt
            out, new = step({**vals, **params}, args=(x,))
            return {p: new[p] for p in vals}, loss_fn(out, target)

        _, losses = jax.lax.scan(body, carried, (xs, targets))
        return jnp.sum(losses)

    grads: dict[Path, Any] = jax.jit(jax.grad(total))(dict(state.params))
    return grads


def block_diagonal(
    jac: Mapping[Path, Mapping[Path, Array]], group: etrax.HiddenGroup
) -> np.ndarray[Any, Any]:
    """The per-position ``(S, S)`` blocks of a member-by-member Jacobian dict."""
    V = group.varshape
    P = int(np.prod(V, dtype=np.int64))
    S = group.num_state
    blocks = np.zeros((P, S, P, S))
    ra = 0
    for a_path, ka in zip(group.hidden_paths, group.num_states, strict=True):
        rb = 0
        for b_path, kb in zip(group.hidden_paths, group.num_states, strict=True):
            blocks[:, ra : ra + ka, :, rb : rb + kb] = np.asarray(jac[a_path][b_path]).reshape(
                P, ka, P, kb
            )
            rb += kb
        ra += ka
    return blocks


def tail_diagonal(
    jac_y: Mapping[Path, Array], group: etrax.HiddenGroup, y_shape: tuple[int, ...]
) -> tuple[np.ndarray[Any, Any], float]:
    """``df`` read off a full ``∂h/∂y`` and the largest off-diagonal magnitude."""
    V = group.varshape
    P = int(np.prod(V, dtype=np.int64))
    PY = int(np.prod(y_shape, dtype=np.int64))
    parts = [
        np.asarray(jac_y[p]).reshape(P, k, PY)
        for p, k in zip(group.hidden_paths, group.num_states, strict=True)
    ]
    full = np.concatenate(parts, axis=1)  # (P, S, PY)
    rows = np.arange(P)
    diag = full[rows, :, rows % PY].reshape(*V, group.num_state)
    off = full.copy()
    off[rows, :, rows % PY] = 0.0
    return diag, float(np.max(np.abs(off))) if off.size else 0.0


def flat_hidden(graph: etrax.ETraceGraph, values: Mapping[Path, Any]) -> list[Array]:
    return [jnp.asarray(values[p]) for p in graph.module_info.hidden_paths]


def pure_call(
    model: brainstate.nn.Module,
    fn: Any,
    values: Mapping[Path, Any],
    example: Any,
) -> Any:
    """``fn(arg)`` (which may read and write `model`'s states) as a pure function of
    `arg`, evaluated with the states set to `values` (others keep their values)."""
    sf = brainstate.transform.StatefulFunction(fn, return_only_write=False)
    sf.make_jaxpr(example)
    states = sf.get_states(example)
    path_of = {st: p for p, st in model.states().items()}
    vals = [values.get(path_of[st], st.value) for st in states]

    def call(arg: Any) -> Any:
        return sf.jaxpr_call(vals, arg)[1]

    return call


class OracleJacobians:
    """``D`` per group, and ``x`` / ``df`` per relation and tail, from `jax.jacrev` of
    brainstate's own step (weights' outputs held fixed unless `diagonal`)."""

    def __init__(
        self,
        graph: etrax.ETraceGraph,
        model: brainstate.nn.Module,
        x: Any,
        values: Mapping[Path, Any],
        diagonal: bool,
    ) -> None:
        step = BrainstateStep(model, (x,))
        hidden_paths = graph.module_info.hidden_paths

        def new_hidden(*hs: Array) -> dict[Path, Array]:
            vals = dict(values)
            vals.update(zip(hidden_paths, hs, strict=True))
            _, new = step(vals, freeze_weights=not diagonal)
            return {p: new[p] for p in hidden_paths}

        h0 = [values[p] for p in hidden_paths]
        # one XLA program per oracle instead of one per eager op and shape
        jac = jax.jit(jax.jacrev(new_hidden, argnums=tuple(range(len(h0)))))(*h0)
        by_path = {a: dict(zip(hidden_paths, jac[a], strict=True)) for a in hidden_paths}
        self.D: list[np.ndarray[Any, Any]] = []
        self.off_diagonal: list[float] = []
        for grp in graph.hidden_groups:
            blocks = block_diagonal(by_path, grp)
            rows = np.arange(blocks.shape[0])
            self.D.append(
                blocks[rows, :, rows, :].reshape(*grp.varshape, grp.num_state, grp.num_state)
            )
            off = blocks.copy()
            off[rows, :, rows, :] = 0.0
            self.off_diagonal.append(float(np.max(np.abs(off))) if off.size else 0.0)
        etp_mine = [
            i
            for i, e in enumerate(graph.module_info.jaxpr.eqns)
            if etrax.etp_spec(e.primitive) is not None
        ]
        operands = _etp_operands(step, values)
        self.x: list[Any] = []
        self.df: list[list[np.ndarray[Any, Any]]] = []
        self.tail_off: list[list[float]] = []
        for rel in graph.hidden_param_op_relations:
            k = step.etp_equations[etp_mine.index(rel.eqn_index)]
            x_in, y = operands[k]
            spec = rel.spec
            self.x.append(None if spec.x_index is None else x_in)

            def inject(delta: Array, _k: int = k) -> dict[Path, Array]:
                _, new = step(values, freeze_weights=True, inject=(_k, delta))
                return new

            jac_y = jax.jit(jax.jacrev(inject))(jnp.zeros_like(y))
            dfs: list[np.ndarray[Any, Any]] = []
            offs: list[float] = []
            for tail in rel.tails:
                grp = graph.hidden_groups[tail.group_index]
                d, t_off = tail_diagonal({p: jac_y[p] for p in grp.hidden_paths}, grp, rel.y_shape)
                dfs.append(d)
                offs.append(t_off)
            self.df.append(dfs)
            self.tail_off.append(offs)


def _etp_operands(step: BrainstateStep, values: Mapping[Path, Any]) -> dict[int, tuple[Any, Any]]:
    """For each ETP equation of brainstate's jaxpr: (its x operand, its output)."""
    flat = list(jax.tree.leaves(step.args))
    for p in step.paths:
        flat.extend(jax.tree.leaves(values[p]))
    jaxpr = step.closed.jaxpr
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for v, c in zip(jaxpr.constvars, step.closed.consts, strict=True):
        env[v] = c
    for v, c in zip(jaxpr.invars, flat, strict=True):
        env[v] = c
    found: dict[int, tuple[Any, Any]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        params = eqn.primitive.get_bind_params(eqn.params)
        ins = [read(a) for a in eqn.invars]
        outs = eqn.primitive.bind(*ins, **params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        spec = etrax.etp_spec(eqn.primitive)
        if spec is not None:
            found[i] = (None if spec.x_index is None else ins[spec.x_index], outs[0])
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return found
