"""Stage 5, `perturb`: add a zero perturbation per hidden state so that the
loss-to-hidden gradient ``∂L/∂h^t`` is one VJP away.

The perturbed step computes ``h^t = f(...) + p`` for every hidden state and
returns the same outputs as the rewritten step. Where a new hidden value feeds
another hidden value *within* the step through non-boundary computation, that
route is already inside the transitions and tails that traces follow, so the
perturbation does not travel along it (otherwise the same path would be counted
twice). Routes that cross a boundary (another weight operation) and routes to the
model's outputs do carry it. Equations downstream of a perturbed value are
evaluated twice: once with every perturbation (`full`) and once with only the
perturbations that crossed a boundary (`crossed`).

A second perturbation ``q`` per hidden state is added to its *old* value and
reaches the outputs only along routes that avoid every new hidden value: its
gradient is the part of ``∂L/∂h^{t-1}`` that the new hidden values do not carry
(e.g. an output computed from an intermediate before it is stored in a stacked
state). It is zero for most models (`direct_paths` is then empty).
"""

from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._compat import DropVar, Literal, Var, bind_equation, shape_struct, struct_of
from .._typing import Path, Shape
from ._analysis import analyse_step
from ._group import HiddenGroup
from ._jaxpr import Program
from ._module_info import ModuleInfo, StateKind, extract

__all__ = [
    "HiddenPerturbation",
    "add_hidden_perturbation_from_minfo",
    "add_hidden_perturbation_in_module",
]


class HiddenPerturbation(eqx.Module):
    """The perturbed step: inputs ``[flat args, flat states, p..., q...]``.

    **Arguments:**

    - `perturb_hidden_paths`: the hidden states perturbed, in compiled order (one
      perturbation ``p`` of the new value and one ``q`` of the old value each,
      shaped like the state).
    - `shapes`, `dtypes`: of each perturbation.
    - `program`: the perturbed step; its outputs are those of the rewritten step.
    - `direct_paths`: hidden states whose old value reaches the outputs other than
      through a new hidden value (``q`` matters only for these).
    """

    perturb_hidden_paths: tuple[Path, ...] = eqx.field(static=True)
    shapes: tuple[Shape, ...] = eqx.field(static=True)
    dtypes: tuple[np.dtype[Any], ...] = eqx.field(static=True)
    program: Program = eqx.field(static=True)
    direct_paths: tuple[Path, ...] = eqx.field(static=True, default=())

    @property
    def perturb_jaxpr(self) -> Any:
        return self.program.closed

    def init_perturb_data(self) -> list[Array]:
        """Zero perturbations."""
        return [jnp.zeros(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]

    def eval_jaxpr(
        self,
        flat_inputs: Sequence[Any],
        perturb_data: Sequence[Any],
        old_perturb_data: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Evaluate the perturbed step on flat inputs and perturbations (``q = 0``
        unless `old_perturb_data` is given)."""
        if len(perturb_data) != len(self.shapes):
            raise ValueError(
                f"expected {len(self.shapes)} perturbations (one per hidden state "
                f"{list(self.perturb_hidden_paths)}), got {len(perturb_data)}"
            )
        if old_perturb_data is None:
            old_perturb_data = [jnp.zeros_like(p) for p in perturb_data]
        return self.program(*flat_inputs, *perturb_data, *old_perturb_data)

    def perturb_data_to_hidden_group_data(
        self, data: Sequence[Array] | Mapping[Path, Array], groups: Sequence[HiddenGroup]
    ) -> list[Array]:
        """Arrange per-state perturbation gradients into one slab per group."""
        if isinstance(data, Mapping):
            by_path = dict(data)
        else:
            if len(data) != len(self.perturb_hidden_paths):
                raise ValueError(
                    f"expected {len(self.perturb_hidden_paths)} values, got {len(data)}"
                )
            by_path = dict(zip(self.perturb_hidden_paths, data, strict=True))
        out = []
        for g in groups:
            missing = [p for p in g.hidden_paths if p not in by_path]
            if missing:
                raise ValueError(f"no perturbation gradient for hidden state(s) {missing}")
            out.append(g.concat_hidden([by_path[p] for p in g.hidden_paths]))
        return out


def _build_program(minfo: ModuleInfo) -> tuple[Program, tuple[Path, ...], tuple[Path, ...]]:
    an = analyse_step(minfo)
    table = an.table
    jaxpr = minfo.jaxpr
    consts = minfo.closed_jaxpr.consts
    hidden = minfo.hidden_states
    paths = tuple(s.path for s in hidden)
    # hidden outvar Var -> indices of the hidden states it is the new value of
    node_of: dict[Var, list[int]] = {}
    passthrough: dict[int, int] = {}  # output position -> hidden index, for non-produced outvars
    for k, s in enumerate(hidden):
        vid = s.outvars[0]
        if vid is None:
            continue
        v = table.var(vid)
        if v in table.producer:
            node_of.setdefault(v, []).append(k)
    out_positions: dict[int, int] = {}
    pos = minfo.num_var_out
    for s in minfo.states:
        if s.kind is StateKind.HIDDEN:
            out_positions[pos] = paths.index(s.path)
        pos += len(s.invars)
    for p_, k in out_positions.items():
        atom = jaxpr.outvars[p_]
        if not (isinstance(atom, Var) and atom in node_of):
            passthrough[p_] = k
    model_out = set(range(minfo.num_var_out))
    # Equations on routes from old hidden values to the model's outputs that avoid
    # every new hidden value: those carry the "direct" perturbation q.
    needed = {v for v in jaxpr.outvars[: minfo.num_var_out] if isinstance(v, Var)}
    direct_eqns: set[int] = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in needed and v not in node_of for v in eqn.outvars if not isinstance(v, DropVar)):
            direct_eqns.add(i)
            needed.update(a for a in eqn.invars if isinstance(a, Var))
    hidden_in = {table.var(s.invars[0]): k for k, s in enumerate(hidden)}
    direct = sorted({k for v, k in hidden_in.items() if v in needed})
    state_out_kinds: dict[int, StateKind] = {}
    pos = minfo.num_var_out
    for s in minfo.states:
        for _ in s.invars:
            state_out_kinds[pos] = s.kind
            pos += 1

    def fn(*flat: Any) -> list[Any]:
        n = len(jaxpr.invars)
        h = len(hidden)
        inputs, perturbs, olds = flat[:n], flat[n : n + h], flat[n + h :]
        orig: dict[Var, Any] = {}
        full: dict[Var, Any] = {}
        crossed: dict[Var, Any] = {}
        blocked: dict[Var, Any] = {}

        def read(env: dict[Var, Any], atom: Any) -> Any:
            if isinstance(atom, Literal):
                return atom.val
            return env.get(atom, orig[atom])

        for v, val in zip(jaxpr.constvars, consts, strict=True):
            orig[v] = val
        for v, val in zip(jaxpr.invars, inputs, strict=True):
            orig[v] = val
        for v, k in hidden_in.items():
            if k in direct:
                blocked[v] = orig[v] + olds[k].astype(jnp.result_type(orig[v]))
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(orig, a) for a in eqn.invars]
            outs = bind_equation(eqn, ins)
            for v, val in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, DropVar):
                    orig[v] = val
            var_ins = [a for a in eqn.invars if isinstance(a, Var)]
            if i in direct_eqns and any(a in blocked for a in var_ins):
                b_outs = bind_equation(eqn, [read(blocked, a) for a in eqn.invars])
                for v, val in zip(eqn.outvars, b_outs, strict=True):
                    if not isinstance(v, DropVar) and v not in node_of:
                        blocked[v] = val
            has_full = any(a in full for a in var_ins)
            has_crossed = any(a in crossed for a in var_ins)
            if has_full and i in an.boundaries:
                sh = bind_equation(eqn, [read(full, a) for a in eqn.invars])
                for v, val in zip(eqn.outvars, sh, strict=True):
                    if not isinstance(v, DropVar):
                        full[v] = crossed[v] = val
            else:
                if has_full:
                    f_ins = [read(full, a) for a in eqn.invars]
                    f_outs = bind_equation(eqn, f_ins)
                    for v, val in zip(eqn.outvars, f_outs, strict=True):
                        if not isinstance(v, DropVar):
                            full[v] = val
                if has_crossed:
                    c_ins = [read(crossed, a) for a in eqn.invars]
                    c_outs = bind_equation(eqn, c_ins)
                    for v, val in zip(eqn.outvars, c_outs, strict=True):
                        if not isinstance(v, DropVar):
                            crossed[v] = val
            for v in eqn.outvars:
                if v in node_of:
                    c = crossed.get(v, orig[v])
                    total = c
                    for k in node_of[v]:
                        total = total + perturbs[k].astype(total.dtype)
                    full[v] = total
        results = []
        for p_, atom in enumerate(jaxpr.outvars):
            if p_ in passthrough:
                base = read(orig, atom)
                results.append(base + perturbs[passthrough[p_]].astype(jnp.result_type(base)))
            elif p_ in model_out:
                value = read(full, atom)
                if isinstance(atom, Var) and atom in blocked:
                    value = value + (blocked[atom] - orig[atom])
                results.append(value)
            elif state_out_kinds.get(p_, StateKind.WEIGHT) is not StateKind.WEIGHT:
                results.append(read(full, atom))
            else:
                results.append(read(orig, atom))
        return results

    avals = [struct_of(v) for v in jaxpr.invars]
    avals += [shape_struct(s.shapes[0], s.dtypes[0]) for s in hidden] * 2
    closed = jax.make_jaxpr(fn)(*avals)
    n_in = len(closed.jaxpr.invars)
    program = Program(closed, tuple(range(n_in)), tuple(range(len(closed.jaxpr.outvars))))
    return program, paths, tuple(paths[k] for k in direct)


def add_hidden_perturbation_from_minfo(minfo: ModuleInfo) -> HiddenPerturbation:
    """Build the `HiddenPerturbation` of a (rewritten) step."""
    program, paths, direct = _build_program(minfo)
    hidden = minfo.hidden_states
    return HiddenPerturbation(
        perturb_hidden_paths=paths,
        shapes=tuple(s.shapes[0] for s in hidden),
        dtypes=tuple(s.dtypes[0] for s in hidden),
        program=program,
        direct_paths=direct,
    )


def add_hidden_perturbation_in_module(model: Any, *args: Any) -> HiddenPerturbation:
    """Trace `model` on `args` and build its `HiddenPerturbation`."""
    return add_hidden_perturbation_from_minfo(extract(model, *args))
