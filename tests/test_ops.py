"""The ETP primitive protocol: JAX rules of the primitives and the rule records
(`weight_grad` must equal `jax.vjp` of the op; `instant`, `scale`, `solve` agree)."""

from collections.abc import Callable
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax
from etrax.ops import element_wise_p, matmul_p

TOL = 1e-10


def _rand(key: int, shape: tuple[int, ...]) -> Array:
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float64)


def _struct(a: Array) -> jax.ShapeDtypeStruct:
    out: jax.ShapeDtypeStruct = jax.eval_shape(lambda: a)
    return out


def _bind(prim: Any, *args: Any, **params: Any) -> Array:
    out: Array = prim.bind(*args, **params)
    return out


def _mask(w: Array) -> Array:
    return jnp.abs(w) * 2.0


MATMUL_CASES = [
    pytest.param((3,), True, None, None, id="mv+bias"),
    pytest.param((2, 3), True, None, None, id="mm+bias"),
    pytest.param((2, 3), False, None, None, id="mm"),
    pytest.param((3,), True, _mask, jnp.tanh, id="mv+fns"),
    pytest.param((5, 3), True, jnp.sin, None, id="mm+weight_fn"),
]


@pytest.mark.parametrize(("x_shape", "bias", "weight_fn", "bias_fn"), MATMUL_CASES)
def test_matmul_rules_against_vjp(
    x_shape: tuple[int, ...],
    bias: bool,
    weight_fn: Callable[[Array], Array] | None,
    bias_fn: Callable[[Array], Array] | None,
) -> None:
    x = _rand(0, x_shape)
    weights = {"weight": _rand(1, (3, 4))}
    if bias:
        weights["bias"] = _rand(2, (4,))
    params = {"has_bias": bias, "weight_fn": weight_fn, "bias_fn": bias_fn}
    spec = etrax.etp_spec(matmul_p)
    assert spec is not None and spec.rules is not None
    rules = spec.rules

    def op(w: dict[str, Array]) -> Array:
        return etrax.matmul(x, w["weight"], w.get("bias"), weight_fn=weight_fn, bias_fn=bias_fn)

    y, vjp = jax.vjp(op, weights)
    cot = _rand(3, y.shape)
    (expected,) = vjp(cot)
    got = rules.weight_grad(x, cot, weights, params)
    assert got.keys() == expected.keys()
    for k in got:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=TOL)

    # solve(L, instant(x, df)) == weight_grad(x, L * df): the trace contraction is exact
    df = _rand(4, y.shape)
    sig = _rand(5, y.shape)
    trace = rules.instant(x, df, weights, params)
    shapes = rules.param_trace_shapes(
        _struct(x), _struct(y), {k: _struct(v) for k, v in weights.items()}, params
    )
    assert {k: v.shape for k, v in trace.items()} == shapes
    solved = rules.chain(rules.solve(sig, trace, weights, params), weights, params)
    direct = rules.weight_grad(x, sig * df, weights, params)
    for k in solved:
        np.testing.assert_allclose(solved[k], direct[k], rtol=0, atol=TOL)
    # the factorisation describes instant as an outer product
    assert rules.factor is not None
    fac = rules.factor(x, params)
    assert fac.batch_ndim == len(x_shape) - 1
    for k, u in fac.inputs.items():
        expected_k = df if u is None else u[..., :, None] * df[..., None, :]
        np.testing.assert_allclose(trace[k], expected_k, rtol=0, atol=TOL)
    # the default contract (through solve and instant) agrees with the fast one
    default = etrax.ETPRules(
        instant=rules.instant, scale=rules.scale, param_trace_shapes=rules.param_trace_shapes
    )
    for k, v in default.contract(x, sig, weights, params).items():
        np.testing.assert_allclose(v, rules.contract(x, sig, weights, params)[k], rtol=0, atol=TOL)
    # scale multiplies along the output link
    h = _rand(6, y.shape)
    scaled = rules.scale(h, trace, params)
    again = rules.instant(x, df * h, weights, params)
    for k in scaled:
        np.testing.assert_allclose(scaled[k], again[k], rtol=0, atol=TOL)


@pytest.mark.parametrize("weight_fn", [None, jax.nn.sigmoid])
def test_element_wise_rules_against_vjp(weight_fn: Callable[[Array], Array] | None) -> None:
    w = _rand(0, (4,))
    spec = etrax.etp_spec(element_wise_p)
    assert spec is not None and spec.rules is not None and spec.gradient_enabled
    rules = spec.rules
    params = {"weight_fn": weight_fn}
    y, vjp = jax.vjp(lambda v: etrax.element_wise(v, weight_fn=weight_fn), w)
    cot = _rand(1, y.shape)
    (expected,) = vjp(cot)
    got = rules.weight_grad(None, cot, {"weight": w}, params)
    np.testing.assert_allclose(got["weight"], expected, rtol=0, atol=TOL)
    trace = rules.instant(None, cot, {"weight": w}, params)
    sig = _rand(2, y.shape)
    solved = rules.chain(rules.solve(sig, trace, {"weight": w}, params), {"weight": w}, params)
    direct = rules.weight_grad(None, sig * cot, {"weight": w}, params)
    np.testing.assert_allclose(solved["weight"], direct["weight"], rtol=0, atol=TOL)


def test_matmul_primitive_under_transformations() -> None:
    x = _rand(0, (3,))
    w = _rand(1, (3, 4))
    b = _rand(2, (4,))
    ref = x @ w + b
    np.testing.assert_allclose(etrax.matmul(x, w, b), ref, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(etrax.matmul)(x, w, b), ref, rtol=1e-12)
    # reverse mode through the primitive
    g = jax.grad(lambda w_: jnp.sum(jnp.sin(etrax.matmul(x, w_, b))))(w)
    g_ref = jax.grad(lambda w_: jnp.sum(jnp.sin(x @ w_ + b)))(w)
    np.testing.assert_allclose(g, g_ref, rtol=1e-12)
    # vmap over x only keeps the ETP primitive (now batched)
    xs = _rand(3, (5, 3))
    jaxpr = jax.make_jaxpr(jax.vmap(lambda v: etrax.matmul(v, w, b)))(xs)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is matmul_p]
    assert eqn.invars[0].aval.shape == (5, 3)
    np.testing.assert_allclose(
        jax.vmap(lambda v: etrax.matmul(v, w, b))(xs), xs @ w + b, rtol=1e-12
    )
    # nested vmap folds the batch axes
    xss = _rand(4, (2, 5, 3))
    out = jax.vmap(jax.vmap(lambda v: etrax.matmul(v, w, b)))(xss)
    np.testing.assert_allclose(out, xss @ w + b, rtol=1e-12)
    # vmap over the weights falls back to the implementation (values still right)
    ws = _rand(5, (2, 3, 4))
    out = jax.vmap(lambda w_: etrax.matmul(x, w_))(ws)
    np.testing.assert_allclose(out, jnp.einsum("i,bio->bo", x, ws), rtol=1e-12)


class VmappedInside(brainstate.nn.Module):
    """A per-sample matmul mapped with `jax.vmap` inside `update`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(_rand(1, (3, 4)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((2, 4)))

    def update(self, x: ArrayLike) -> Array:
        y = jax.vmap(lambda v: etrax.matmul(v, self.w.value))(jnp.asarray(x))
        h = 0.5 * self.h.value + y
        self.h.value = h
        return h


def test_vmap_inside_update_compiles_like_a_batched_op() -> None:
    model = VmappedInside()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones((2, 3)))
    (rel,) = graph.hidden_param_op_relations
    assert rel.x_shape == (2, 3) and rel.y_shape == (2, 4)


def _scaled_impl(x: Array, w: Array, *, scale: float) -> Array:
    return scale * (x @ w)


def _scaled_instant(x: Array | None, cot: Array, weights: Any, params: Any) -> dict[str, Array]:
    assert x is not None
    return {"weight": params["scale"] * x[:, None] * cot[None, :]}


def _scaled_scale(h: Array, trace: Any, params: Any) -> dict[str, Array]:
    return {"weight": trace["weight"] * h[None, :]}


def _scaled_shapes(x: Any, y: Any, weights: Any, params: Any) -> dict[str, tuple[int, ...]]:
    return {"weight": tuple(weights["weight"].shape)}


SCALED = etrax.register_primitive(
    "test_scaled_matmul",
    _scaled_impl,
    rules=etrax.ETPRules(
        instant=_scaled_instant, scale=_scaled_scale, param_trace_shapes=_scaled_shapes
    ),
)


class UsesCustomOp(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(_rand(1, (3, 4)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        h = 0.5 * self.h.value + _bind(SCALED, jnp.asarray(x), self.w.value, scale=2.0)
        self.h.value = h
        return h


def test_user_registered_primitive_is_recognised() -> None:
    assert etrax.is_etp_primitive(SCALED)
    model = UsesCustomOp()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3))
    (rel,) = graph.hidden_param_op_relations
    assert rel.primitive is SCALED and rel.weight_path == ("w",)
    x = _rand(2, (3,))
    w = _rand(3, (3, 4))
    cot = _rand(4, (4,))
    _, vjp = jax.vjp(lambda v: _bind(SCALED, x, v, scale=2.0), w)
    rules = rel.spec.rules
    assert rules is not None
    np.testing.assert_allclose(
        rules.weight_grad(x, cot, {"weight": w}, rel.params)["weight"], vjp(cot)[0], rtol=1e-12
    )


def test_register_rules_replaces_rules() -> None:
    prim = etrax.register_primitive("test_ruleless", _scaled_impl)
    spec = etrax.etp_spec(prim)
    assert spec is not None and spec.rules is None
    rules = etrax.etp_spec(SCALED)
    assert rules is not None and rules.rules is not None
    etrax.register_rules(prim, rules.rules)
    spec = etrax.etp_spec(prim)
    assert spec is not None and spec.rules is rules.rules
    with pytest.raises(ValueError, match="not an ETP primitive"):
        etrax.register_rules(jax.lax.add_p, rules.rules)
