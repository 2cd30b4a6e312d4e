"""brainstate-facing executors: seed behaviour, write-back, no tracer leaks."""

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import etrax

from .models import build


def test_seed_shapes_gru() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    ex = etrax.ETraceVjpGraphExecutor(model)
    with pytest.raises(ValueError, match="not compiled yet"):
        _ = ex.graph
    ex.compile_graph(x)
    assert set(ex.path_to_states) == {("h",), ("Wz", "weight"), ("Wr", "weight"), ("Wh", "weight")}
    out, hidden, other, jac = ex.solve_h2w_h2h_jacobian(x)
    assert out.shape == (4,) and set(hidden) == {("h",)} and other == {}
    assert [a.shape for a in jac.x if a is not None] == [(7,), (7,)]
    assert [d.shape for t in jac.df for d in t] == [(4, 1), (4, 1)]
    assert [d.shape for d in jac.D] == [(4, 1, 1)]
    out, hidden, other, jac, pullback = ex.solve_h2w_h2h_l2h_jacobian(x)
    assert pullback(jnp.ones(4))[0].shape == (4, 1)
    msg = ex.show_graph(verbose=False, return_msg=True)
    assert msg is not None and "('Wr', 'weight')" in msg
    with pytest.raises(etrax.StepInputError, match="single time step"):
        ex.solve_h2w_h2h_l2h_jacobian(etrax.MultiStepData(jnp.ones((5, 3))))


def test_seed_shapes_batched_and_multi_step() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4, batch=2)
    ex = etrax.ETraceGraphExecutor(model)
    ex.compile_graph(x)
    out, _, _, jac = ex.solve_h2w_h2h_jacobian(x)
    assert [a.shape for a in jac.x if a is not None] == [(2, 7), (2, 7)]
    assert [d.shape for t in jac.df for d in t] == [(2, 4, 1), (2, 4, 1)]
    assert [d.shape for d in jac.D] == [(2, 4, 1, 1)]
    model1, _x1 = build(etrax.nn.GRUCell, 3, 4)
    ex1 = etrax.ETraceGraphExecutor(model1)
    ex1.compile_graph(etrax.MultiStepData(jnp.ones((5, 3))))
    out, _, _, jac = ex1.solve_h2w_h2h_jacobian(etrax.MultiStepData(jnp.ones((5, 3))))
    assert out.shape == (5, 4)
    assert jac.x[0] is not None and jac.x[0].shape == (5, 7)
    assert jac.df[0][0].shape == (5, 4, 1) and jac.D[0].shape == (5, 4, 1, 1)


def test_write_back_and_no_tracer_leaks() -> None:
    model, x = build(etrax.nn.GRUCell, 3, 4)
    ex = etrax.ETraceGraphExecutor(model)
    ex.compile_graph(x)
    graph = ex.graph
    state = etrax.state_of(graph)
    _y_ref, new_ref, _ = etrax.step(graph, state, x)
    _out, _hidden, _, _ = ex.solve_h2w_h2h_jacobian(x)
    m = model
    assert isinstance(m, etrax.nn.GRUCell)
    np.testing.assert_allclose(m.h.value, new_ref.hidden[("h",)], rtol=0, atol=1e-12)
    assert not isinstance(m.h.value, jax.core.Tracer)

    # under brainstate's own jit the write-back is tracked, and nothing leaks
    @brainstate.transform.jit
    def run(v: jax.Array) -> jax.Array:
        o, _, _, _ = ex.solve_h2w_h2h_jacobian(v)
        out: jax.Array = o
        return out

    before = m.h.value
    run(x)
    after = m.h.value
    assert not isinstance(after, jax.core.Tracer)
    expected = etrax.step(graph, etrax.state_of(graph).replace_hidden({("h",): before}), x)[1]
    np.testing.assert_allclose(after, expected.hidden[("h",)], rtol=0, atol=1e-12)
    for s in model.states().values():
        assert not any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(s.value))


def test_executor_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match=r"brainstate\.nn\.Module"):
        etrax.ETraceGraphExecutor(object())  # type: ignore[arg-type]
