"""Scale sweeps: how the online rules and BPTT grow with the hidden size and the depth
(`python benchmarks/run.py scale [options]`, or `nox -s bench -- scale`).

Two sweeps of stacked `etrax.nn.GRUCell`s → ``Linear(H, 1)`` at batch 32 (float32):
the hidden size ``H`` from 128 to 4096 at one layer, and the depth ``L`` from 1 to 16
layers at ``H = 256``. For each configuration and each method (forward: the model's
own brainstate ``update`` in a `lax.scan`; BPTT: `jax.grad` over it; etrax's
``DRTRL()``, ``PPProp(0.9)`` and ``EProp(0.9)`` through ``online_grad``):

- **Memory at T = 1,000** (``--memory-steps``): XLA's buffer assignment of the
  compiled T-step program (`compiled.memory_analysis()`: arguments + outputs −
  aliased + scratch), the memory the program needs while it runs. Nothing runs, so
  configurations that do not fit this machine are still measured. BPTT's grows
  with T; for it the sweep also compiles ``T/2`` steps and reports the length at
  which it would fill this machine's memory (a straight line through the two).
- **Per-step time**: the compiled program of ``--time-steps`` steps (default 32:
  one chunk of the chunked rules), run on this machine if its memory fits (with a
  margin), divided by the steps: the median of ``--repeats`` calls, or the first
  call alone if it took over ``--max-call`` seconds; shown in milliseconds and as a
  multiple of the forward step.

Results go to ``<out>/scale_<device>.md`` and ``.png``. braintrace is not involved.
"""

import argparse
import dataclasses
import functools
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import brainstate
import jax
import numpy as np
from jaxtyping import Array

import etrax

from ._common import RESULTS, block, table
from .bench_peer import Config, Data, PureStep, etrax_rule, make_data, make_model, mse

METHODS = ("forward", "BPTT", "D-RTRL", "pp-prop", "e-prop")
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    axis: str  # the configuration field that grows: "hidden" or "layers"
    configs: tuple[Config, ...]


def _sweeps(batch: int, sizes: Sequence[int], depths: Sequence[int], width: int) -> list[Sweep]:
    return [
        Sweep("hidden size", "hidden", tuple(Config("GRU", 1, h, batch) for h in sizes)),
        Sweep("layers", "layers", tuple(Config("GRU", n, width, batch) for n in depths)),
    ]


def _initialised(cfg: Config) -> brainstate.nn.Module:
    model = make_model("etrax", cfg)
    brainstate.nn.init_all_states(model, batch_size=cfg.batch_size)
    return model


def _lowered(method: str, cfg: Config, data: Data, *, run: bool) -> tuple[Any, tuple[Any, ...]]:
    """The jitted program of `method` over `data`'s sequence, with its arguments: the
    traces are only shapes unless the program will `run` (D-RTRL's may not fit)."""
    model = _initialised(cfg)
    if method in ("forward", "BPTT"):
        step = PureStep(model, data.x0)
        if method == "forward":
            return jax.jit(step.forward), (step.values, data.xs)
        return jax.jit(step.bptt), (step.values, data.xs, data.targets)
    graph = etrax.compile_etrace_graph(model, data.x0)
    algo = etrax_rule(method)
    state = etrax.state_of(graph)

    def online(state: etrax.ModelState, traces: Any, xs: Array, targets: Array) -> Any:
        grads, aux = etrax.online_grad(graph, algo, state, traces, xs, targets, mse)
        # what changed: returning the unchanged weights would copy them at every call
        return grads, aux["state"].hidden, aux["state"].other, aux["traces"]

    traces = algo.init(graph, state) if run else jax.eval_shape(lambda: algo.init(graph, state))
    return jax.jit(online), (state, traces, data.xs, data.targets)


def _footprint(compiled: Any) -> float:
    """Bytes the compiled program holds while it runs (XLA's buffer assignment)."""
    mem = compiled.memory_analysis()
    if mem is None:
        return math.nan
    total: int = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    return float(total)


def _memory(method: str, cfg: Config, steps: int) -> float:
    fn, args = _lowered(method, cfg, make_data(cfg, steps), run=False)
    return _footprint(fn.lower(*args).compile())


@dataclasses.dataclass(frozen=True)
class Point:
    """One (configuration, method): memory at the long length, per-step time (NaN when
    not run) and, for BPTT, the length at which it would fill the machine."""

    memory: float
    step_s: float
    skipped: str = ""
    fills_at: float = math.nan


Results = dict[Config, dict[str, Point]]
"""Per configuration of one sweep, per method."""
Sweeps = dict[str, tuple[Sweep, Results]]
"""Per sweep name, the sweep and its results so far."""


def _machine_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _time(method: str, cfg: Config, steps: int, max_call: float, repeats: int) -> float:
    """Median seconds per step of the compiled `steps`-step program (NaN if a first
    call takes longer than `max_call`; that one call is then the only sample)."""
    fn, args = _lowered(method, cfg, make_data(cfg, steps), run=True)
    run = functools.partial(fn.lower(*args).compile(), *args)
    start = time.perf_counter()
    block(run())
    first = time.perf_counter() - start
    if first > max_call:
        return first / steps
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(run())
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) / steps


def measure(
    cfg: Config, memory_steps: int, time_steps: int, max_call: float, repeats: int, ram: float
) -> dict[str, Point]:
    points: dict[str, Point] = {}
    for method in METHODS:
        memory = _memory(method, cfg, memory_steps)
        fills_at = math.nan
        if method == "BPTT":  # a straight line through T/2 and T
            half = _memory(method, cfg, memory_steps // 2)
            slope = (memory - half) / (memory_steps - memory_steps // 2)
            fills_at = memory_steps + (ram - memory) / slope if slope > 0 else math.inf
        # the timed program is shorter; its own footprint decides whether it runs
        short = memory if method != "BPTT" else _memory(method, cfg, time_steps)
        if short > 0.8 * ram:
            points[method] = Point(memory, math.nan, f"needs {short / GiB:.1f} GiB", fills_at)
        else:
            step_s = _time(method, cfg, time_steps, max_call, repeats)
            points[method] = Point(memory, step_s, "", fills_at)
        jax.clear_caches()  # type: ignore[no-untyped-call]  # unannotated in JAX
    return points


# --- report ------------------------------------------------------------------------


def _gib(nbytes: float) -> str:
    if not math.isfinite(nbytes):
        return "–"
    return f"{nbytes / GiB:.2f}" if nbytes >= 0.01 * GiB else f"{nbytes / 2**20:.1f} MiB"


def _rows(sweep: Sweep, results: Results, ram: float) -> list[list[str]]:
    rows = []
    for cfg, points in results.items():
        fwd = points["forward"].step_s
        for method, p in points.items():
            time_ms = "–" if not math.isfinite(p.step_s) else f"{p.step_s * 1e3:,.2f}"
            ratio = "–" if not (math.isfinite(p.step_s) and fwd > 0) else f"{p.step_s / fwd:.1f}"
            fits = "yes" if p.memory <= ram else f"no ({p.memory / ram:.1f}× RAM)"
            fill = "–"
            if method == "BPTT":
                fill = "never" if math.isinf(p.fills_at) else f"{p.fills_at:,.0f}"
            rows.append(
                [
                    str(getattr(cfg, sweep.axis)),
                    method,
                    _gib(p.memory),
                    fits,
                    fill,
                    time_ms + (f" ({p.skipped})" if p.skipped else ""),
                    ratio,
                ]
            )
    return rows


def _summary(sweeps: Sweeps, ram: float) -> str:
    lines = []
    for sweep, results in sweeps.values():
        for method in METHODS[1:]:
            fit = [getattr(c, sweep.axis) for c, p in results.items() if p[method].memory <= ram]
            out = [getattr(c, sweep.axis) for c, p in results.items() if p[method].memory > ram]
            where = f"fits up to {sweep.axis} = {max(fit)}" if fit else "fits nowhere in the sweep"
            if out:
                where += f"; does not fit from {sweep.axis} = {min(out)}"
            lines.append(f"- {sweep.name}, {method}: {where}.")
    return "\n".join(lines)


def report(
    sweeps: Sweeps,
    memory_steps: int,
    time_steps: int,
    ram: float,
) -> str:
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    header = [
        "size",
        "method",
        f"GiB at T = {memory_steps:,}",
        "fits",
        "BPTT fills RAM at T",
        "ms/step",
        "× fwd",
    ]
    parts = [
        f"""# Scale sweeps ({dev.platform}: {kind})

`python benchmarks/run.py scale`: jax {jax.__version__}, brainstate
{brainstate.__version__}, etrax {etrax.__version__}; float32; this machine's memory
{ram / GiB:.1f} GiB. Memory: XLA's buffer assignment of the compiled T = {memory_steps:,}-step
program (arguments + outputs − aliased + scratch; nothing is run). Time: the compiled
{time_steps}-step program, median of a few calls, per step. BPTT's "fills RAM at T":
where a straight line through its T/2 and T footprints reaches this machine's memory.
Timings on shared machines are noisy; compare within a table.

{_summary(sweeps, ram)}
"""
    ]
    for sweep, results in sweeps.values():
        first = next(iter(results))
        fixed = "H = " + str(first.hidden) if sweep.axis == "layers" else f"{first.layers} layer"
        parts.append(
            f"## {sweep.name.capitalize()} (GRU, {fixed}, batch {first.batch})\n\n"
            + table(header, _rows(sweep, results, ram))
            + "\n"
        )
    return "\n".join(parts)


def plot(
    sweeps: Sweeps,
    path: Path,
    memory_steps: int,
    ram: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(METHODS, ["k", "tab:gray", "tab:red", "tab:blue", "tab:green"], strict=True))
    fig, axes = plt.subplots(2, len(sweeps), figsize=(6 * len(sweeps), 8), squeeze=False)
    for col, (sweep, results) in enumerate(sweeps.values()):
        xs = [getattr(c, sweep.axis) for c in results]
        top, bottom = axes[0][col], axes[1][col]
        for method, color in colors.items():
            mem = [p[method].memory / GiB for p in results.values()]
            top.plot(xs, mem, marker="o", color=color, label=method)
            step = [p[method].step_s * 1e3 for p in results.values()]
            bottom.plot(xs, step, marker="o", color=color, label=method)
        top.axhline(ram / GiB, color="k", ls="--", lw=0.8, label="this machine's memory")
        top.set_ylabel(f"GiB at T = {memory_steps:,}")
        bottom.set_ylabel("ms per step")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("hidden size H" if sweep.axis == "hidden" else "layers L")
            ax.grid(True, which="both", alpha=0.3)
        top.set_title(f"memory vs {sweep.name}")
        bottom.set_title(f"per-step time vs {sweep.name}")
        top.legend(fontsize=8)
    dev = jax.devices()[0]
    fig.suptitle(f"etrax scale sweeps, GRU, batch 32 ({dev.platform})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- entry point -------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run.py scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_ints, default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--depths", type=_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument("--width", type=int, default=256, help="H of the depth sweep")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--memory-steps", type=int, default=1000)
    parser.add_argument("--time-steps", type=int, default=32, help="steps per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per program")
    parser.add_argument(
        "--max-call", type=float, default=30.0, help="time a program once if a call takes longer"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    return parser.parse_args(list(argv))


def run(argv: Sequence[str] = ()) -> str:
    args = _arguments(argv)
    ram = _machine_memory()
    platform = jax.devices()[0].platform
    args.out.mkdir(parents=True, exist_ok=True)
    md, png = args.out / f"scale_{platform}.md", args.out / f"scale_{platform}.png"
    done: Sweeps = {}
    start = time.perf_counter()
    text = ""
    for sweep in _sweeps(args.batch, args.sizes, args.depths, args.width):
        results: Results = {}
        done[sweep.name] = (sweep, results)
        for cfg in sweep.configs:
            print(f"  {cfg.label}", flush=True)
            results[cfg] = measure(
                cfg, args.memory_steps, args.time_steps, args.max_call, args.repeats, ram
            )
            text = report(done, args.memory_steps, args.time_steps, ram)
            md.write_text(text)  # after every configuration: a cut-off run keeps its rows
            plot(done, png, args.memory_steps, ram)
    print(f"wrote {md} and {png} ({time.perf_counter() - start:.0f} s)")
    return text
