"""Per-sample models under `jax.vmap` equal natively batched models."""

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import etrax

from .models import LeakyTanh, TwoStateNeuron, build

TOL = 1e-10
B = 3


@pytest.mark.parametrize(
    ("cls", "args"),
    [
        (etrax.nn.GRUCell, (3, 4)),
        (brainstate.nn.GRUCell, (3, 4)),  # no etrax op: its matmuls are recognised
        (TwoStateNeuron, (3, 4)),
        (LeakyTanh, (3, 4)),
    ],
    ids=["gru", "brainstate_gru", "two_state", "leaky_tanh"],
)
def test_vmap_step_equals_batched_model(cls: Any, args: tuple[int, int]) -> None:
    single, x1 = build(cls, *args)
    batched, _ = build(cls, *args, batch=B)
    g1 = etrax.compile_etrace_graph(single, x1)
    gb = etrax.compile_etrace_graph(batched, jnp.ones((B, 3)))
    s1 = etrax.state_of(g1)
    sb = etrax.state_of(gb)
    sb = sb.replace_params(s1.params)  # same weights
    key = jax.random.PRNGKey(2)
    hidden = {
        p: jax.random.normal(jax.random.fold_in(key, i), v.shape)
        for i, (p, v) in enumerate(sb.hidden.items())
    }
    sb = sb.replace_hidden(hidden)
    xs = jax.random.normal(jax.random.PRNGKey(3), (B, 3))

    def per_sample(h: Any, x: Any) -> Any:
        y, new, jac, pb = etrax.step_vjp(g1, s1.replace_hidden(h), x)
        return y, new.hidden, jac, pb(jnp.ones_like(y))

    y_v, h_v, jac_v, l_v = jax.jit(jax.vmap(per_sample))(dict(hidden), xs)
    y_b, new_b, jac_b, pb_b = etrax.step_vjp(gb, sb, xs)
    np.testing.assert_allclose(y_v, y_b, rtol=0, atol=TOL)
    for p in hidden:
        np.testing.assert_allclose(h_v[p], new_b.hidden[p], rtol=0, atol=TOL)
    for a, b in zip(jax.tree.leaves(jac_v), jax.tree.leaves(jac_b), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    for a, b in zip(l_v, pb_b(jnp.ones_like(y_b)), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)


def test_a_vmap_learner_names_a_batch_that_does_not_fit() -> None:
    """A vmap learner's sequences must carry its batch on their second axis: another
    batch, targets of another batch and batch-major sequences are `StepInputError`s
    that say what to pass (not `jax.vmap`'s own error)."""
    learner = etrax.compile(
        etrax.nn.GRUCell(3, 4), etrax.DRTRL(), jnp.zeros((3, 3)), batch_size=3, vmap=True
    )

    def mse(y: Any, t: Any) -> Any:
        return jnp.sum((y - t) ** 2)

    cases = [
        (jnp.ones((5, 4, 3)), jnp.ones((5, 4, 4)), "xs: .*reset"),
        (jnp.ones((5, 3, 3)), jnp.ones((5, 2, 4)), "targets"),
        (jnp.ones((3, 5, 3)), jnp.ones((3, 5, 4)), "batch-major"),
    ]
    for xs, ts, match in cases:
        with pytest.raises(etrax.StepInputError, match=match):
            learner.etrace_grad(xs, ts, mse)
    with pytest.raises(etrax.StepInputError, match="batch-major"):
        learner.etrace_evolve(jnp.ones((3, 5, 3)))
    with pytest.raises(etrax.StepInputError, match=r"\(B, \.\.\.\)"):
        learner(jnp.ones((2, 3)))
    learner.etrace_grad(jnp.ones((5, 3, 3)), jnp.ones((5, 3, 4)), mse)  # the right batch
