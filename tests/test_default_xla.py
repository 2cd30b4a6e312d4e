"""etrax's programs compiled with XLA's own optimisations, not the suite's.

The suite compiles every program with fast-compiling XLA flags (`conftest.py`: LLVM
optimisation level 0 and XLA:CPU's older element-wise emitters), which users do not
set. With XLA's defaults, jax 0.10.2 on the CPU miscompiles some programs: ``jax.jit(
jax.grad(...))`` over a `lax.scan` whose float64 step cuts ``x @ W + b`` in two gave a
gradient 40 % off, where either of the suite's flags gave the right one. So here the
online rules' programs are compiled with the defaults restored (per program, through
``jax.jit``'s ``compiler_options``) and checked against the oracle, which stays
compiled with the suite's flags: brainstate's own ``update`` through `jax.grad`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax

from .models import CATALOGUE, ModelCase
from .oracles import bptt_grads, random_state_values

XLA_DEFAULTS: etrax.CompilerOptions = {
    "xla_backend_optimization_level": 3,
    "xla_cpu_use_fusion_emitters": True,
}
"""XLA's own values of the options `conftest.py` changes."""
CASES = ("two_state_b2", "alif_ff_b2", "gru_b2", "lstm", "stacked_gru")
T = 5


def mse(y: Any, t: Any) -> Array:
    return jnp.sum((y - t) ** 2)


def _close(got: Any, want: Any) -> None:
    scale = max(1.0, *(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want)))
    assert set(got) == set(want)
    for path in want:
        for g, w in zip(jax.tree.leaves(got[path]), jax.tree.leaves(want[path]), strict=True):
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=0, atol=1e-10 * scale, err_msg=str(path)
            )


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CATALOGUE if c.name in CASES], ids=lambda c: c.name)
def test_online_rules_with_xla_defaults_equal_the_oracle(case: ModelCase) -> None:
    """At T = 1 from a random hidden state every rule equals BPTT for every parameter
    leaf; on a model whose recurrence is diagonal, D-RTRL equals it over `T` steps
    (chunked, with a remainder) as well."""
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    values = random_state_values(graph, seed=3)
    state = etrax.state_of(graph)
    state = state.replace_hidden({p: values[p] for p in state.hidden})
    xs = jax.random.normal(jax.random.PRNGKey(4), (T, *jnp.shape(x)))
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(5), (T, *jnp.shape(y0)))
    runs: list[tuple[etrax.OnlineAlgorithm[Any], int]] = [
        (etrax.DRTRL(), 1),
        (etrax.PPProp(0.9), 1),
        (etrax.EProp(), 1),
    ]
    if case.exact_online:
        runs.append((etrax.DRTRL(chunk_steps=2), T))
    for algo, steps in runs:

        def online(
            st: etrax.ModelState, xs: Array, ts: Array, algo: etrax.OnlineAlgorithm[Any] = algo
        ) -> Any:
            return etrax.online_grad(graph, algo, st, algo.init(graph, st), xs, ts, mse).grads

        program = jax.jit(online, compiler_options=dict(XLA_DEFAULTS))
        got = dict(program(state, xs[:steps], ts[:steps]))
        _close(got, bptt_grads(model, state, xs[:steps], ts[:steps], mse))
