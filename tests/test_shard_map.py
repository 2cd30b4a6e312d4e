"""Data parallelism over two (fake CPU) devices with `jax.shard_map` and `jax.pmap`."""

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import etrax

from .models import build

TOL = 1e-10


def P(*names: str) -> PartitionSpec:
    spec: PartitionSpec = PartitionSpec(*names)  # type: ignore[no-untyped-call]  # unannotated
    return spec


def test_two_devices_available() -> None:
    assert len(jax.devices()) >= 2, "conftest must set --xla_force_host_platform_device_count=2"


def _setup(
    cls: Any = etrax.nn.GRUCell,
) -> tuple[etrax.ETraceGraph, etrax.ETraceGraph, etrax.ModelState, etrax.ModelState, Any]:
    local, _ = build(cls, 3, 4, batch=2)
    full, _ = build(cls, 3, 4, batch=4)
    g_local = etrax.compile_etrace_graph(local, jnp.ones((2, 3)))
    g_full = etrax.compile_etrace_graph(full, jnp.ones((4, 3)))
    s_local = etrax.state_of(g_local)
    s_full = etrax.state_of(g_full).replace_params(s_local.params)
    h = jax.random.normal(jax.random.PRNGKey(0), (4, 4))
    s_full = s_full.replace_hidden({("h",): h})
    xs = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    return g_local, g_full, s_local, s_full, xs


@pytest.mark.parametrize(
    "cls",
    [etrax.nn.GRUCell, brainstate.nn.GRUCell],  # the second has no etrax op (recognised)
    ids=["etrax_gru", "brainstate_gru"],
)
def test_shard_map_equals_single_device(cls: Any) -> None:
    g_local, g_full, _s_local, s_full, xs = _setup(cls)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def shard(params: Any, h: Any, x: Any) -> Any:
        state = etrax.ModelState(params, h, etrax.PathDict())
        y, new, jac = etrax.step(g_local, state, x)
        return y, new.hidden, jac.D[0]

    f = jax.jit(
        jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P("data"), P("data"), P("data")),
        )
    )
    y, h, D = f(s_full.params, s_full.hidden, xs)
    y_ref, new_ref, jac_ref = etrax.step(g_full, s_full, xs)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(h[("h",)], new_ref.hidden[("h",)], rtol=0, atol=TOL)
    np.testing.assert_allclose(D, jac_ref.D[0], rtol=0, atol=TOL)


def test_pmap_equals_single_device() -> None:
    g_local, g_full, s_local, s_full, xs = _setup()

    def per_device(h: Any, x: Any) -> Any:
        state = s_local.replace_hidden(h)
        y, _new, jac = etrax.step(g_local, state, x)
        return y, jac.D[0]

    hs = {("h",): s_full.hidden[("h",)].reshape(2, 2, 4)}
    y, D = jax.pmap(per_device)(hs, xs.reshape(2, 2, 3))
    y_ref, _, jac_ref = etrax.step(g_full, s_full, xs)
    np.testing.assert_allclose(y.reshape(4, 4), y_ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(D.reshape(4, 4, 1, 1), jac_ref.D[0], rtol=0, atol=TOL)


def test_shard_map_pullback() -> None:
    g_local, g_full, _s_local, s_full, xs = _setup()
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def shard(params: Any, h: Any, x: Any) -> Any:
        state = etrax.ModelState(params, h, etrax.PathDict())
        y, _, _, pullback = etrax.step_vjp(g_local, state, x)
        return pullback(jnp.sin(y))[0]

    f = jax.jit(
        jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P("data"))
    )
    l_h = f(s_full.params, s_full.hidden, xs)
    y, _, _, pullback = etrax.step_vjp(g_full, s_full, xs)
    np.testing.assert_allclose(l_h, pullback(jnp.sin(y))[0], rtol=0, atol=TOL)
