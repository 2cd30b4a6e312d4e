"""The random-projection trace factorisation (UORO): a rank-1 unbiased estimate of the
full within-group RTRL trace.

Per hidden group ``g`` the trace ``∂h_g/∂θ`` is estimated by ``s̃_g θ̃_gᵀ``. Each
step draws Rademacher noise ``ν`` and sets

- ``s̃ ← ρ₀ J s̃ + ρ₁ ν``, where ``J s̃`` is one JVP of the group's whole transition
  (the ``(P·S)²`` Jacobian is never formed);
- ``θ̃ ← θ̃ / ρ₀ + (νᵀ ∂h/∂θ) / ρ₁``, where ``νᵀ ∂h/∂θ`` is the traced ops' immediate
  effect contracted with ``ν``;

with ``ρ₀ = √(‖θ̃‖/‖J s̃‖)`` and ``ρ₁ = √(‖νᵀ∂h/∂θ‖/‖ν‖)`` (Tallec & Ollivier 2018).
``E[s̃ θ̃ᵀ]`` is the true trace. The gradient uses the estimate only for the past: at
step ``t`` it is ``(L · J s̃_{t-1}) θ̃_{t-1}`` plus the step's exact instantaneous
traced gradient, so the estimate stays unbiased and the first step is exact.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from ..compiler import ETraceGraph
from ..executor import StepJacobians
from ._axes import Coupled, NoFilter, check_key
from ._base import EffGrads, Weights, add_into, scan_chunk
from ._kernels import instant_contribution
from ._plan import plan_of
from ._rule import LearningRule, TraceFactorisation

__all__ = ["ProjectionTraces", "RandomProjection"]

_EPS = 1e-7


class ProjectionTraces(eqx.Module):
    """UORO's rank-1 traces.

    **Arguments:**

    - `s`: per group, ``s̃`` shaped ``(*varshape, S)``.
    - `theta`: per (relation, group) slot, ``θ̃`` shaped like the effective operands.
    - `carried`: per group, ``J s̃`` of the step before the last (the past, carried).
    - `carried_theta`: per slot, ``θ̃`` of the step before the last.
    - `x`, `df`: the last step's op inputs (per relation) and ``∂h/∂y`` (per slot), for
      its exact instantaneous term.
    - `count`: steps taken (the noise of step ``n`` is drawn from ``fold_in(key, n)``).
    - `key`: the typed PRNG key of this stream of noise (the rule's `key` from ``init``;
      `etrax.compile`'s learner gives every sample and every sequence after a
      ``reset`` its own).
    """

    s: tuple[Array, ...]
    theta: tuple[dict[str, Array], ...]
    carried: tuple[Array, ...]
    carried_theta: tuple[dict[str, Array], ...]
    x: tuple[Array | None, ...]
    df: tuple[Array, ...]
    count: Int[Array, ""]
    key: PRNGKeyArray


def _stored(own: Any, dtype: Any) -> Any:
    """The dtype a trace keeps a value of dtype `own` in: `dtype` for floats."""
    return dtype if jnp.issubdtype(own, jnp.floating) else own


def _norm(tree: Any) -> Array:
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(leaf * leaf) for leaf in leaves))


class RandomProjection(TraceFactorisation[ProjectionTraces]):
    """Rank-1 random-projection traces (UORO): ``O(P·S + |θ|)`` memory per group and one
    JVP of the step per group and step; unbiased for the within-group recursion of
    the whole transition (needs the `Coupled` scope's view of it).

    **Arguments:**

    - `key`: the PRNG key the per-step Rademacher noise is drawn from.
    """

    key: PRNGKeyArray

    def __check_init__(self) -> None:
        check_key("UORO", self.key)

    @property
    def label(self) -> str:
        return "random projection"

    @property
    def reads_transition(self) -> bool:
        return False

    @property
    def needs_point(self) -> bool:
        return True

    def validate(self, rule: LearningRule[ProjectionTraces]) -> None:
        if not isinstance(rule.scope, Coupled):
            raise ValueError(
                f"{rule.name}: random-projection traces follow the whole transition; use "
                "scope=Coupled() (axes factorisation and scope)"
            )
        if not isinstance(rule.filter, NoFilter):
            raise ValueError(f"{rule.name}: a trace filter needs per-parameter traces")

    def init(
        self, graph: ETraceGraph, dtype: Any, rule: LearningRule[ProjectionTraces]
    ) -> ProjectionTraces:
        plan = plan_of(graph)
        s = tuple(jnp.zeros(g.slab_shape, dtype) for g in graph.hidden_groups)
        theta = tuple({k: jnp.zeros(sl.eff_shapes[k], dtype) for k in sl.keys} for sl in plan.slots)
        xs = tuple(  # an op's input keeps an integer dtype (an embedding's indices)
            None if st is None else jnp.zeros(st.shape, _stored(st.dtype, dtype))
            for st in plan.x_structs
        )
        df = tuple(jnp.zeros((*sl.varshape, sl.num_state), dtype) for sl in plan.slots)
        key = self.key
        if not jnp.issubdtype(key.dtype, jax.dtypes.extended):
            key = jax.random.wrap_key_data(key)  # typed, so that key leaves can be found
        return ProjectionTraces(s, theta, s, theta, xs, df, jnp.zeros((), jnp.int32), key)

    def update(
        self, graph: ETraceGraph, traces: ProjectionTraces, jac: StepJacobians,
        weights: Weights, rule: LearningRule[ProjectionTraces],
    ) -> ProjectionTraces:  # fmt: skip
        if jac.point is None:
            raise ValueError("UORO needs StepJacobians.point (the drivers attach it)")
        plan = plan_of(graph)
        step_key = jax.random.fold_in(traces.key, traces.count)
        new_s: list[Array] = []
        carried: list[Array] = []
        new_theta: list[dict[str, Array]] = [{} for _ in plan.slots]
        for g in graph.hidden_groups:
            s_old = traces.s[g.index]
            Js = jac.point.transition_jvp(graph, g.index, s_old)
            nu = jax.random.rademacher(jax.random.fold_in(step_key, g.index), s_old.shape)
            nu = nu.astype(s_old.dtype)
            mine = [k for k, sl in enumerate(plan.slots) if sl.group == g.index]
            imm = {
                k: instant_contribution(
                    plan.slots[k], jac.x[plan.slots[k].relation],
                    jac.df[plan.slots[k].relation][plan.slots[k].tail], nu,
                    weights[plan.slots[k].relation],
                )
                for k in mine
            }  # fmt: skip
            theta_old = {k: traces.theta[k] for k in mine}
            rho0 = jnp.sqrt((_norm(theta_old) + _EPS) / (_norm(Js) + _EPS))
            rho1 = jnp.sqrt((_norm(imm) + _EPS) / (_norm(nu) + _EPS))
            new_s.append(rho0 * Js + rho1 * nu)
            carried.append(Js)
            for k in mine:
                new_theta[k] = {
                    key: theta_old[k][key] / rho0 + imm[k][key] / rho1 for key in theta_old[k]
                }
        df = tuple(jac.df[sl.relation][sl.tail] for sl in plan.slots)
        return ProjectionTraces(
            tuple(new_s), tuple(new_theta), tuple(carried), traces.theta, jac.x, df,
            traces.count + 1, traces.key,
        )  # fmt: skip

    def eff_grads(
        self, graph: ETraceGraph, traces: ProjectionTraces, signals: Sequence[Array],
        weights: Weights, rule: LearningRule[ProjectionTraces],
    ) -> EffGrads:  # fmt: skip
        plan = plan_of(graph)
        out: list[dict[str, Array]] = [{} for _ in graph.hidden_param_op_relations]
        for k, sl in enumerate(plan.slots):
            L = signals[sl.group]
            scale = jnp.sum(L * traces.carried[sl.group])
            past = {key: scale * v for key, v in traces.carried_theta[k].items()}
            now = instant_contribution(
                sl, traces.x[sl.relation], traces.df[k], L, weights[sl.relation]
            )
            add_into(out[sl.relation], {key: past[key] + now[key] for key in sl.keys})
        return tuple(out)

    def chunk(
        self, graph: ETraceGraph, traces: ProjectionTraces, jacs: StepJacobians,
        signals: Sequence[Array], weights: Weights, olds: Sequence[Array] | None,
        rule: LearningRule[ProjectionTraces],
    ) -> tuple[ProjectionTraces, EffGrads]:  # fmt: skip
        dtype = traces.s[0].dtype
        return scan_chunk(
            lambda tr, jac: self.update(graph, tr, jac, weights, rule),
            lambda tr, sig: self.eff_grads(graph, tr, sig, weights, rule),
            graph, traces, jacs, signals, dtype, olds,
        )  # fmt: skip
