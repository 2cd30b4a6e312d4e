"""Data parallelism over two (fake CPU) devices with `jax.shard_map` and `jax.pmap`."""

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import etrax

from .compiles import scan_outputs
from .models import build

TOL = 1e-10


def P(*names: str | None) -> PartitionSpec:
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


class GRUReadout(brainstate.nn.Module):
    """A GRU with a readout: its reset gate `Wr` is an untraced weight, whose
    instantaneous gradient a chunked driver forms once per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = etrax.nn.GRUCell(3, 4)
        self.out = etrax.nn.Linear(4, 2)

    def update(self, x: Any) -> Any:
        return self.out(self.rnn(x))


def _mse(y: Any, t: Any) -> Any:
    return jnp.sum((y - t) ** 2)


ONLINE_RULES: dict[str, etrax.OnlineAlgorithm[Any]] = {
    "drtrl": etrax.DRTRL(chunk_steps=4),
    "pp_prop": etrax.PPProp(0.9, chunk_steps=4),
    "e_prop": etrax.EProp(0.5, chunk_steps=4),
    "drtrl_per_step": etrax.DRTRL(chunk_steps=1),
}


SHARD_CASES = [
    pytest.param(rule, region, packed, id=f"{rule}-{'region' if region else 'no_region'}-{pk}")
    for rule in ONLINE_RULES
    for region in (False, True)
    for packed, pk in ((True, "packed"), (False, "unpacked"))
    if packed or rule != "drtrl_per_step"  # a per-step run packs nothing
]


@pytest.mark.parametrize(("rule", "region", "packed"), SHARD_CASES)
def test_online_grad_under_shard_map_is_each_devices_own(
    rule: str, region: bool, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented data-parallel recipe (`online_grad` under `jax.shard_map`,
    then `psum`) equals the single-device gradient of the whole batch for every
    parameter, the untraced reset gate included, in chunks (packed or not, with or
    without a region) and per step. Each device's gradient is its own: the zero
    perturbations a step differentiates vary like its inputs, so no cotangent comes
    back already summed over the devices."""
    if region:
        monkeypatch.setattr(etrax.compiler._perturb, "REGION_MIN_MACS", 0)
    if not packed:
        monkeypatch.setattr(etrax.algorithms._drivers, "PACK_MAX_BYTES", 0)

    def loss(y: Any, t: Any) -> Any:  # a new static argument: traced afresh, not cached
        return _mse(y, t)

    algo = ONLINE_RULES[rule]
    full_model, _ = build(GRUReadout, batch=4)
    local_model, _ = build(GRUReadout, batch=2)
    full = etrax.compile_etrace_graph(full_model, jnp.zeros((4, 3)))
    local = etrax.compile_etrace_graph(local_model, jnp.zeros((2, 3)))
    assert bool(etrax.algorithms._drivers.regions_of(local)) == region
    state = etrax.state_of(full)
    xs = jax.random.normal(jax.random.PRNGKey(0), (6, 4, 3))
    targets = jax.random.normal(jax.random.PRNGKey(1), (6, 4, 2))
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def shard(params: Any, hidden: Any, other: Any, xs: Any, targets: Any) -> Any:
        st = etrax.ModelState(params, hidden, other)
        online, _ = etrax.online_grad(local, algo, st, algo.init(local, st), xs, targets, loss)
        exact, _ = etrax.bptt_grad(local, st, xs, targets, _mse)
        return jax.lax.psum((online, exact), "data")  # type: ignore[no-untyped-call]

    spec = (P(), P("data"), P("data"), P(None, "data"), P(None, "data"))
    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=spec, out_specs=P()))
    online, exact = f(state.params, state.hidden, state.other, xs, targets)

    def reference() -> Any:
        return etrax.online_grad(full, algo, state, algo.init(full, state), xs, targets, loss)

    if rule != "drtrl_per_step":  # packing on or off as set: fewer stacked outputs packed

        def stacked(limit: int) -> int:
            def fresh(y: Any, t: Any) -> Any:  # a new static argument: traced afresh
                return _mse(y, t)

            def run() -> Any:
                traces = algo.init(full, state)
                return etrax.online_grad(full, algo, state, traces, xs, targets, fresh)

            with monkeypatch.context() as patch:
                patch.setattr(etrax.algorithms._drivers, "PACK_MAX_BYTES", limit)
                return len(scan_outputs(jax.make_jaxpr(run)().jaxpr, 3))

        assert (stacked(etrax.algorithms._drivers.PACK_MAX_BYTES) < stacked(0)) == packed
    online_ref, _ = reference()
    exact_ref, _ = etrax.bptt_grad(full, state, xs, targets, _mse)
    for got, want in ((online, online_ref), (exact, exact_ref)):
        for path in want:
            for a, b in zip(jax.tree.leaves(got[path]), jax.tree.leaves(want[path]), strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg=str(path))


class LoopedLeak(brainstate.nn.Module):
    """A leaky unit and a readout, whose transition is a loop or a branch the compiler
    keeps whole (a 20-step `fori_loop`, a `while_loop`, a `cond` under
    ``if_convert=False``), with literals in the bodies, or calls `jax.nn.relu`, a
    `custom_jvp` whose jaxpr (a nested `jit` of ``max(x, 0.0)``) was traced outside
    the map."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = etrax.nn.Linear(3, 4)
        self.out = etrax.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (4,) if batch_size is None else (batch_size, 4)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: Any) -> Any:
        i, h = self.fc(x), self.h.value
        if self.kind == "relu":
            h = 0.9 * h + jax.nn.relu(i)
        elif self.kind == "fori":
            h = jax.lax.fori_loop(0, 20, lambda k, v: 0.95 * v + 0.05 * jnp.tanh(i), h)
        elif self.kind == "while":
            _, h = jax.lax.while_loop(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, 0.9 * c[1] + 0.1), (0, h)
            )
            h = h + i
        else:
            h = jax.lax.cond(jnp.sum(x) > 0, lambda v: 0.9 * v + i, lambda v: 0.5 * v - i, h)
        self.h.value = h
        return self.out(h)


class SpikingReadout(brainstate.nn.Module):
    """``Linear → ALIF → Linear``: the spike's surrogate gradient is a `custom_jvp`
    comparing the membrane with a literal threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4, w_init=brainstate.nn.init.KaimingNormal(scale=8.0))
        self.neu = etrax.nn.ALIF(4, tau=10.0, tau_a=50.0, beta=0.5)
        self.out = etrax.nn.Linear(4, 2)

    def update(self, x: Any) -> Any:
        return self.out(self.neu(self.fc(x)))


class ReluGates(brainstate.nn.Module):
    """``a, b = split(relu(x @ W + h @ U), 2)``: `jax.nn.relu` evaluated on each gate's
    part of the products (`etrax.compiler`'s fused gates), and a readout."""

    def __init__(
        self, w_shape: tuple[int, ...] = (3, 8), u_shape: tuple[int, ...] = (4, 8), seed: int = 5
    ) -> None:
        super().__init__()
        key = jax.random.PRNGKey(seed)
        self.w = brainstate.ParamState(0.5 * jax.random.normal(key, w_shape))
        self.u = brainstate.ParamState(0.3 * jax.random.normal(jax.random.fold_in(key, 1), u_shape))
        self.out = etrax.nn.Linear(4, 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        shape = (4,) if batch_size is None else (batch_size, 4)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def update(self, x: Any) -> Any:
        h = self.h.value
        a, b = jnp.split(jax.nn.relu(x @ self.w.value + h @ self.u.value), 2, axis=-1)
        self.h.value = 0.5 * jnp.tanh(a) * h + jnp.tanh(b)
        return self.out(self.h.value)


class FlatHeads(ReluGates):
    """Two heads of two units on a flat ``(batch, 4)`` state: ``h ← h/2 + tanh((x_heads +
    h_heads).reshape(batch, 4))`` with ``x_heads = einsum('bi,gio->bgo', x, W)`` and
    ``h_heads = einsum('bgi,gio->bgo', h.reshape(batch, 2, 2), U)`` (each product and
    the merge of its heads one `etrax.grouped_matmul(..., merge_groups=True)`), and a
    readout."""

    def __init__(self) -> None:
        super().__init__(w_shape=(2, 3, 2), u_shape=(2, 2, 2), seed=6)

    def update(self, x: Any) -> Any:
        h = self.h.value
        lead = h.shape[:-1]
        a = jnp.einsum("...i,gio->...go", x, self.w.value)
        b = jnp.einsum("...gi,gio->...go", h.reshape(*lead, 2, 2), self.u.value)
        self.h.value = 0.5 * h + jnp.tanh((a + b).reshape(*lead, 4))
        return self.out(self.h.value)


@jax.custom_vjp
def _vjp_relu(x: Any) -> Any:
    return jnp.maximum(x, 0.0)


_vjp_relu.defvjp(lambda x: (_vjp_relu(x), x), lambda x, g: (g * (x > 0.0).astype(g.dtype),))


class VJPGates(ReluGates):
    """`ReluGates` with a ReLU written with `jax.custom_vjp`: the compiler makes it a
    `custom_jvp` call of its transposed backward rule, cut gate by gate."""

    def update(self, x: Any) -> Any:
        h = self.h.value
        a, b = jnp.split(_vjp_relu(x @ self.w.value + h @ self.u.value), 2, axis=-1)
        self.h.value = 0.5 * jnp.tanh(a) * h + jnp.tanh(b)
        return self.out(self.h.value)


@pytest.mark.parametrize("kind", ["relu", "alif", "relu_gates", "flat_heads", "vjp_gates"])
def test_custom_jvp_models_under_shard_map_and_pmap(kind: str) -> None:
    """Models whose step calls a `custom_jvp` function (a spike's surrogate, ReLU,
    ReLU evaluated gate by gate on the parts of a product, or a ReLU written with
    `jax.custom_vjp`, which the compiler makes one), and one whose per-head
    products are merged into a flat state: the step, `bptt_grad` and every online rule
    under `jax.shard_map` (then under `jax.pmap`, in the same process) equal the
    single-device results. Re-binding the call's jaxpr, made outside the map, mixed
    varying values with invariant literals (a raw JAX error), and the rule's JVP
    jaxpr, traced once, must not keep the mesh of the first map it ran under."""
    cls: dict[str, tuple[Any, ...]] = {
        "alif": (SpikingReadout,), "relu": (LoopedLeak, "relu"), "relu_gates": (ReluGates,),
        "flat_heads": (FlatHeads,), "vjp_gates": (VJPGates,),
    }  # fmt: skip
    args = cls[kind]
    full_model, _ = build(*args, batch=4)
    local_model, _ = build(*args, batch=2)
    full = etrax.compile_etrace_graph(full_model, jnp.zeros((4, 3)))
    local = etrax.compile_etrace_graph(local_model, jnp.zeros((2, 3)))
    if kind in ("relu_gates", "flat_heads", "vjp_gates"):  # cut into gates / heads merged
        rules_of = local.weight_rules()
        assert all(rules_of[p].rule is etrax.WeightRule.TRACED for p in (("w",), ("u",)))
    state = etrax.state_of(full)
    state = state.replace_hidden(
        {p: 0.5 * jax.random.normal(jax.random.PRNGKey(n), jnp.shape(v), jnp.result_type(v))
         for n, (p, v) in enumerate(state.hidden.items())}
    )  # fmt: skip
    xs = jax.random.normal(jax.random.PRNGKey(0), (5, 4, 3))
    targets = jax.random.normal(jax.random.PRNGKey(1), (5, 4, 2))
    rules: list[etrax.OnlineAlgorithm[Any]] = [
        etrax.DRTRL(chunk_steps=2),
        etrax.PPProp(0.9),
        etrax.EProp(0.5, chunk_steps=1),
    ]

    def grads(graph: etrax.ETraceGraph, st: etrax.ModelState, xs: Any, targets: Any) -> Any:
        online = [
            etrax.online_grad(graph, a, st, a.init(graph, st), xs, targets, _mse)[0] for a in rules
        ]
        exact, _ = etrax.bptt_grad(graph, st, xs, targets, _mse)
        y, _, jac = etrax.step(graph, st, xs[0])
        return online, exact, y, jac.D

    def shard(params: Any, hidden: Any, other: Any, xs: Any, targets: Any) -> Any:
        online, exact, y, D = grads(local, etrax.ModelState(params, hidden, other), xs, targets)
        return jax.lax.psum((online, exact), "data"), y, D  # type: ignore[no-untyped-call]

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    spec = (P(), P("data"), P("data"), P(None, "data"), P(None, "data"))
    f = jax.jit(
        jax.shard_map(shard, mesh=mesh, in_specs=spec, out_specs=(P(), P("data"), P("data")))
    )
    summed, y, D = f(state.params, state.hidden, state.other, xs, targets)
    online_ref, exact_ref, y_ref, D_ref = grads(full, state, xs, targets)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=TOL)
    for a, b in zip(jax.tree.leaves(D), jax.tree.leaves(D_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)

    def split(a: Any, axis: int) -> Any:
        return jnp.stack(jnp.split(a, 2, axis=axis))

    def per_device(params: Any, hidden: Any, other: Any, xs: Any, targets: Any) -> Any:
        online, exact, _, _ = grads(local, etrax.ModelState(params, hidden, other), xs, targets)
        return jax.lax.psum((online, exact), "d")  # type: ignore[no-untyped-call]

    mapped = jax.pmap(per_device, axis_name="d", in_axes=(None, 0, 0, 0, 0))(
        state.params,
        jax.tree.map(lambda a: split(a, 0), state.hidden),
        jax.tree.map(lambda a: split(a, 0), state.other),
        split(xs, 1),
        split(targets, 1),
    )
    pmapped = jax.tree.map(lambda a: a[0], mapped)
    want = jax.tree.leaves((online_ref, exact_ref))
    for got in (summed, pmapped):
        for a, b in zip(jax.tree.leaves(got), want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=TOL)


@pytest.mark.parametrize("kind", ["fori", "while", "cond"])
def test_loops_kept_whole_under_shard_map(kind: str) -> None:
    """A loop or branch that stays whole in the step (its body a jaxpr traced outside
    the map, literals and all) is re-traced under `jax.shard_map`: online and BPTT
    gradients equal the single-device ones (the while loop's step is differentiated
    only where the online rules need it, after the loop)."""
    policy = etrax.CompilePolicy(if_convert=False)

    def graph(batch: int) -> etrax.ETraceGraph:
        model, _ = build(LoopedLeak, kind, batch=batch)
        return etrax.compile_etrace_graph(model, jnp.zeros((batch, 3)), policy=policy)

    full, local = graph(4), graph(2)
    kept = {e.primitive.name for e in full.module_info.jaxpr.eqns}
    assert {"fori": "scan", "while": "while", "cond": "cond"}[kind] in kept
    state = etrax.state_of(full)
    xs = jax.random.normal(jax.random.PRNGKey(0), (4, 4, 3))
    targets = jax.random.normal(jax.random.PRNGKey(1), (4, 4, 2))
    algo = etrax.DRTRL(chunk_steps=2)

    def grads(g: etrax.ETraceGraph, st: etrax.ModelState, xs: Any, targets: Any) -> Any:
        online, _ = etrax.online_grad(g, algo, st, algo.init(g, st), xs, targets, _mse)
        if kind == "while":  # JAX cannot reverse-differentiate a while loop: no BPTT
            return online
        return online, etrax.bptt_grad(g, st, xs, targets, _mse)[0]

    def shard(params: Any, hidden: Any, other: Any, xs: Any, targets: Any) -> Any:
        out = grads(local, etrax.ModelState(params, hidden, other), xs, targets)
        return jax.lax.psum(out, "data")  # type: ignore[no-untyped-call]

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    spec = (P(), P("data"), P("data"), P(None, "data"), P(None, "data"))
    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=spec, out_specs=P()))
    got = f(state.params, state.hidden, state.other, xs, targets)
    want = grads(full, state, xs, targets)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=TOL)
