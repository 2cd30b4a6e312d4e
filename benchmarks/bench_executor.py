"""Executor cost: the jitted `etrax.step` against the jitted forward-only step.

Both run inside one `lax.scan` over T steps (no Python dispatch in the loop); the
Jacobians are reduced into the carry so that XLA cannot drop them. Ratios are
measured in one run on one machine.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

import etrax

from ._common import build, table, time_fn, write

T = 100


def _scan_forward(graph: etrax.ETraceGraph, state: etrax.ModelState, xs: Any) -> Any:
    def body(carry: Any, x: Any) -> Any:
        s, acc = carry
        y, s = etrax.forward(graph, s, x)
        return (s, acc + jnp.sum(y)), None

    (_, acc), _ = jax.lax.scan(body, (state, jnp.zeros((), jnp.float32)), xs)
    return acc


def _scan_step(graph: etrax.ETraceGraph, state: etrax.ModelState, xs: Any) -> Any:
    def body(carry: Any, x: Any) -> Any:
        s, acc = carry
        y, s, jac = etrax.step(graph, s, x)
        used = sum(jnp.sum(a) for a in jax.tree.leaves(jac))
        return (s, acc + jnp.sum(y) + used), None

    (_, acc), _ = jax.lax.scan(body, (state, jnp.zeros((), jnp.float32)), xs)
    return acc


def run(sizes: list[tuple[int, int]] | None = None) -> str:
    sizes = sizes or [(128, 1), (128, 32), (512, 1), (512, 32)]
    rows = []
    for name in ("GRU", "LIF"):
        for hidden, batch in sizes:
            graph, x = build(name, hidden, batch)
            state = etrax.state_of(graph)
            xs = (
                jnp.broadcast_to(x, (T, *x.shape))
                * jnp.linspace(0.5, 1.5, T)[(slice(None),) + (None,) * x.ndim]
            )
            fwd = jax.jit(functools.partial(_scan_forward, graph))
            stp = jax.jit(functools.partial(_scan_step, graph))
            t_fwd = time_fn(functools.partial(fwd, state, xs)) / T
            t_step = time_fn(functools.partial(stp, state, xs)) / T
            rows.append(
                [
                    name,
                    str(hidden),
                    str(batch),
                    f"{t_fwd * 1e6:.1f}",
                    f"{t_step * 1e6:.1f}",
                    f"{t_step / t_fwd:.2f}",
                ]
            )
            print(f"  {name} H={hidden} B={batch}: step/forward = {t_step / t_fwd:.2f}", flush=True)
    text = (
        "# Executor: `etrax.step` vs forward-only step\n\n"
        f"Per-step time inside one `lax.scan` of {T} steps, float32, device "
        f"`{jax.devices()[0].platform}`; the ratio is what counts (timings vary ±50%).\n\n"
        + table(["model", "H", "B", "forward µs", "step µs", "step / forward"], rows)
        + "\n"
    )
    path = write("executor", text)
    print(f"wrote {path}")
    return text
