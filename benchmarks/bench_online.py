"""Online learning cost: per-step time and compiled memory of `online_grad`
(D-RTRL, pp-prop) against the forward-only step and against `bptt_grad`.

Per-step times are measured in one run (ratios are what counts: timings on
these machines vary by ±50%). Memory is XLA's compiled buffer assignment
(arguments + outputs + scratch) of each jitted driver, for growing T.
"""

import functools
from typing import Any

import jax
import jax.monitoring
import jax.numpy as jnp

import etrax
from etrax.algorithms._drivers import _bptt_jit, _online_jit

from ._common import block, build, table, time_fn, write
from ._floor import handwritten_times


def _mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def _data(graph: etrax.ETraceGraph, x: jax.Array, T: int) -> tuple[jax.Array, jax.Array]:
    state = etrax.state_of(graph)
    scale = jnp.linspace(0.5, 1.5, T, dtype=x.dtype)[(slice(None),) + (None,) * x.ndim]
    xs = jnp.broadcast_to(x, (T, *x.shape)) * scale
    y0, _ = etrax.forward(graph, state, x)
    return xs, jnp.zeros((T, *y0.shape), y0.dtype)


def _forward_scan(graph: etrax.ETraceGraph, state: etrax.ModelState, xs: jax.Array) -> jax.Array:
    def body(c: Any, x: jax.Array) -> Any:
        s, acc = c
        y, s = etrax.forward(graph, s, x)
        return (s, acc + jnp.sum(y)), None

    (_, acc), _ = jax.lax.scan(body, (state, jnp.zeros((), xs.dtype)), xs)
    return acc


def _methods() -> dict[str, etrax.OnlineAlgorithm[Any]]:
    return {
        "D-RTRL (per step)": etrax.DRTRL(chunk_steps=1),
        "D-RTRL (chunk 32)": etrax.DRTRL(chunk_steps=32),
        "pp-prop (0.9)": etrax.PPProp(0.9),
        "pp-prop (0.9, chunk 32)": etrax.PPProp(0.9, chunk_steps=32),
    }


def per_step(sizes: list[tuple[int, int]], T: int = 64) -> str:
    rows = []
    for hidden, batch in sizes:
        graph, x = build("GRU", hidden, batch)
        state = etrax.state_of(graph)
        xs, ts = _data(graph, x, T)
        fwd = jax.jit(functools.partial(_forward_scan, graph))
        t_fwd = time_fn(functools.partial(fwd, state, xs)) / T
        t_bptt = time_fn(functools.partial(etrax.bptt_grad, graph, state, xs, ts, _mse)) / T
        timings: dict[str, float] = {"forward": t_fwd, "BPTT": t_bptt}
        for name, algo in _methods().items():
            traces = algo.init(graph, state)
            run = functools.partial(etrax.online_grad, graph, algo, state, traces, xs, ts, _mse)
            timings[name] = time_fn(run) / T
        for name, t in timings.items():
            rows.append(
                [
                    str(hidden),
                    str(batch),
                    name,
                    f"{t * 1e6:.1f}",
                    f"{t / t_fwd:.2f}",
                    f"{t / t_bptt:.2f}",
                ]
            )
            print(f"  H={hidden} B={batch} {name}: {t / t_fwd:.2f}x forward", flush=True)
        hw_fwd, hw_pp = handwritten_times(hidden, batch, time_fn, T=T)
        for name, t in (("hand-written forward", hw_fwd), ("hand-written pp-prop", hw_pp)):
            rows.append(
                [
                    str(hidden),
                    str(batch),
                    name,
                    f"{t * 1e6:.1f}",
                    f"{t / t_fwd:.2f}",
                    f"{t / t_bptt:.2f}",
                ]
            )
        print(
            f"  H={hidden} B={batch} hand-written pp-prop: {hw_pp / hw_fwd:.2f}x its forward",
            flush=True,
        )
    return table(["H", "B", "method", "µs / step", "× forward", "× BPTT"], rows)


def _compiled_mib(fn: Any, *args: Any) -> tuple[float, float]:
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    total = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    return total / 2**20, mem.temp_size_in_bytes / 2**20


def memory(
    hidden: int = 256, batch: int = 8, lengths: tuple[int, ...] = (100, 1000, 10_000)
) -> str:
    graph, x = build("GRU", hidden, batch)
    state = etrax.state_of(graph)
    rows = []
    for T in lengths:
        xs, ts = _data(graph, x, T)
        cells = [str(T)]
        for algo in (etrax.DRTRL(), etrax.PPProp(0.9)):
            total, temp = _compiled_mib(
                _online_jit, graph, _mse, None, algo, state, algo.init(graph, state), xs, ts
            )
            cells += [f"{total:.1f}", f"{temp:.1f}"]
        total, temp = _compiled_mib(_bptt_jit, graph, _mse, state, xs, ts)
        cells += [f"{total:.1f}", f"{temp:.1f}"]
        rows.append(cells)
        print(f"  T={T}: " + " ".join(cells[1:]), flush=True)
    return table(
        [
            "T",
            "D-RTRL total MiB",
            "D-RTRL scratch",
            "pp-prop total MiB",
            "pp-prop scratch",
            "BPTT total MiB",
            "BPTT scratch",
        ],
        rows,
    )


def compile_once() -> str:
    graph, x = build("GRU", 64, 4)
    state = etrax.state_of(graph)
    xs, ts = _data(graph, x, 20)
    algo = etrax.DRTRL()
    grads, aux = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, _mse)
    xs2, ts2 = xs * 2.0, ts + 1.0
    events: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event.endswith("jaxpr_trace_duration"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        grads, aux = etrax.online_grad(graph, algo, aux["state"], aux["traces"], xs2, ts2, _mse)
        block(grads)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return f"Second `online_grad` call with new values: {len(events)} retrace(s)."


def run(quick: bool = False) -> str:
    sizes = [(128, 1), (512, 32)] if quick else [(128, 1), (128, 32), (512, 1), (512, 32)]
    lengths: tuple[int, ...] = (100, 1000) if quick else (100, 1000, 10_000)
    print("per-step time", flush=True)
    speed = per_step(sizes)
    print("compiled memory", flush=True)
    mem = memory(lengths=lengths)
    once = compile_once()
    text = (
        "# Online learning: `online_grad` vs forward-only and BPTT\n\n"
        "Model `GRUCell(10, H) → Linear(H, 1)`, per-step MSE, float32, "
        f"device `{jax.devices()[0].platform}`. Times are per step inside the fused "
        "scan (T = 64), measured in one run. The *hand-written* rows are the same "
        "math for one GRU written directly in JAX (benchmarks/_floor.py, no biases): "
        "their ratio to each other is the pp-prop cost floor on this machine.\n\n"
        + speed
        + "\n\n## Compiled memory (H = 256, B = 8)\n\n"
        "XLA's buffer assignment of the jitted driver: arguments (including the inputs "
        "`xs`, which grow with T) + outputs + scratch. Online drivers keep scratch flat; "
        "BPTT's grows with T.\n\n" + mem + "\n\n## Compiling once\n\n" + once + "\n"
    )
    path = write("online", text)
    print(f"wrote {path}")
    return text
