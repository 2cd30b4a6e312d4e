"""Every learning rule gives the same gradients batched in its state, per sample under
`jax.vmap`, and split over two devices with `jax.shard_map` (float64), and runs with
windows where its signal allows them."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array

import etrax

from .models import TanhRNN, build

TOL = 1e-10
B, T = 4, 3

# One rule per engine, scope, signal and filter (a recursion only replaces D, which every
# mode computes the same way).
RULES: dict[str, Callable[[], etrax.OnlineAlgorithm[Any]]] = {
    "drtrl-chunked": lambda: etrax.DRTRL(chunk_steps=2),
    "pp-prop-chunked": lambda: etrax.PPProp(0.8, chunk_steps=2),
    "eprop-kappa": lambda: etrax.EProp(kappa=0.5),
    "eprop-random": lambda: etrax.EProp(feedback="random", key=jax.random.key(2)),
    "ostl-recurrent": lambda: etrax.OSTLRecurrent(),
    "snap-2": lambda: etrax.SnAp(2),
    "uoro": lambda: etrax.UORO(jax.random.key(3)),
    "three-factor": lambda: etrax.ThreeFactor(),
}


def mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


def P(*names: str | None) -> PartitionSpec:
    spec: PartitionSpec = PartitionSpec(*names)  # type: ignore[no-untyped-call]  # unannotated
    return spec


def close(a: Any, b: Any) -> None:
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-9, atol=TOL)


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    single, x1 = build(TanhRNN, 3, 4)
    batched, _ = build(TanhRNN, 3, 4, batch=B)
    half, _ = build(TanhRNN, 3, 4, batch=B // 2)
    g1 = etrax.compile_etrace_graph(single, x1)
    gb = etrax.compile_etrace_graph(batched, jnp.ones((B, 3)))
    gh = etrax.compile_etrace_graph(half, jnp.ones((B // 2, 3)))
    s1 = etrax.state_of(g1)
    h = jax.random.normal(jax.random.key(0), (B, 4))
    sb = etrax.state_of(gb).replace_params(s1.params).replace_hidden({("h",): h})
    xs = jax.random.normal(jax.random.key(1), (T, B, 3))
    ts = jax.random.normal(jax.random.key(2), (T, B, 4))
    ms = jax.random.normal(jax.random.key(3), (T, B, 4, 1))
    return {"g1": g1, "gb": gb, "gh": gh, "s1": s1, "sb": sb, "xs": xs, "ts": ts, "ms": ms}


def sharded_grads(setup: dict[str, Any], grads_of: Callable[..., Any], *sequences: Array) -> Any:
    """``psum`` over two devices of ``grads_of(half_graph, state, *sequences)``, each
    device holding half of the batch (`sequences` are ``(T, B, …)``)."""
    gh, sb = setup["gh"], setup["sb"]
    other = etrax.state_of(gh).other
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def shard(params: Any, h: Any, *seqs: Array) -> Any:
        state = etrax.ModelState(params, h, other)
        return jax.lax.psum(grads_of(gh, state, *seqs), "data")  # type: ignore[no-untyped-call]  # unannotated in JAX

    specs = (P(), P("data"), *(P(None, "data") for _ in sequences))
    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=P()))
    return f(sb.params, sb.hidden, *sequences)


def _kw(rule: etrax.OnlineAlgorithm[Any], ms: Array) -> dict[str, Any]:
    return {"modulators": ms} if rule.needs_modulator else {}


@pytest.mark.parametrize("name", list(RULES))
def test_rule_batched_vmapped_and_sharded_agree(setup: dict[str, Any], name: str) -> None:
    rule = RULES[name]()
    g1, gb, s1, sb = setup["g1"], setup["gb"], setup["s1"], setup["sb"]
    # UORO draws its noise over the whole (batched) group, so only its exact first step
    # is the same in every mode
    steps = 1 if name == "uoro" else T
    xs, ts, ms = setup["xs"][:steps], setup["ts"][:steps], setup["ms"][:steps]

    def run(graph: etrax.ETraceGraph, state: etrax.ModelState, x: Array, t: Array, m: Array) -> Any:
        grads, _ = etrax.online_grad(
            graph, rule, state, rule.init(graph, state), x, t, mse, **_kw(rule, m)
        )
        return dict(grads)

    batched = run(gb, sb, xs, ts, ms)

    def per_sample(h: Array, x: Array, t: Array, m: Array) -> Any:
        return run(g1, s1.replace_hidden({("h",): h}), x, t, m)

    mapped = jax.vmap(per_sample, in_axes=(0, 1, 1, 1))(sb.hidden[("h",)], xs, ts, ms)
    close({p: jax.tree.map(lambda g: g.sum(0), v) for p, v in mapped.items()}, batched)

    if name == "uoro":  # the noise is drawn per device
        return
    close(sharded_grads(setup, run, xs, ts, ms), batched)


@pytest.mark.parametrize("name", [n for n in RULES if RULES[n]().symmetric])
def test_symmetric_rules_run_with_windows(setup: dict[str, Any], name: str) -> None:
    """With one window over the whole sequence every rule with the true signal equals
    BPTT; shorter windows give the same gradients batched and split over two devices."""
    rule = RULES[name]()
    gb, sb, xs, ts = setup["gb"], setup["sb"], setup["xs"], setup["ts"]
    ref, _ = etrax.bptt_grad(gb, sb, xs, ts, mse)
    full, _ = etrax.online_grad(gb, rule, sb, rule.init(gb, sb), xs, ts, mse, window=T)
    close(dict(full), dict(ref))
    short, _ = etrax.online_grad(gb, rule, sb, rule.init(gb, sb), xs, ts, mse, window=2)
    assert set(short) == set(ref)
    if name not in ("drtrl-chunked", "pp-prop-chunked", "ostl-recurrent"):
        return  # one rule per factorisation engine and scope kind (UORO: noise per device)

    # the same windows split over two devices
    def windowed(graph: etrax.ETraceGraph, state: etrax.ModelState, x: Array, t: Array) -> Any:
        result = etrax.online_grad(graph, rule, state, rule.init(graph, state), x, t, mse, window=2)
        return dict(result.grads)

    close(sharded_grads(setup, windowed, xs, ts), dict(short))


def test_dni_runs_batched_mapped_and_sharded(setup: dict[str, Any]) -> None:
    """DNI's synthesiser learns from the batch it sees (a batch mean per step), so the
    modes differ once it has learned; each mode runs, and with a synthesiser that
    cannot learn yet (the first window) they agree."""
    rule = etrax.DNI()
    g1, gb, s1, sb = setup["g1"], setup["gb"], setup["s1"], setup["sb"]
    xs, ts = setup["xs"], setup["ts"]

    def run(graph: etrax.ETraceGraph, state: etrax.ModelState, x: Array, t: Array) -> Any:
        result = etrax.online_grad(graph, rule, state, rule.init(graph, state), x, t, mse, window=T)
        return dict(result.grads)

    batched = run(gb, sb, xs, ts)
    mapped = jax.vmap(
        lambda h, x, t: run(g1, s1.replace_hidden({("h",): h}), x, t), in_axes=(0, 1, 1)
    )(sb.hidden[("h",)], xs, ts)
    close({p: jax.tree.map(lambda g: g.sum(0), v) for p, v in mapped.items()}, batched)
    close(sharded_grads(setup, run, xs, ts), batched)
    two = etrax.online_grad(gb, rule, sb, rule.init(gb, sb), xs, ts, mse, window=1)
    assert two.synthesiser is not None and set(two.grads) == set(batched)
