"""Shared helpers for the benchmarks (models, timing, tables)."""

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

import etrax

RESULTS = Path(__file__).parent / "results"


class GRUNet(brainstate.nn.Module):
    """``GRUCell(n_in, H) → Linear(H, 1)`` (the model of reference/performance.md)."""

    def __init__(self, n_in: int, hidden: int) -> None:
        super().__init__()
        self.rnn = etrax.nn.GRUCell(n_in, hidden)
        self.out = etrax.nn.Linear(hidden, 1)

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.out(self.rnn(x))
        return out


class SpikingLayer(brainstate.nn.Module):
    """``Linear(n_in, H) → LIF(H) → Linear(H, 1)``."""

    def __init__(self, n_in: int, hidden: int) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(n_in, hidden, w_init=brainstate.nn.init.KaimingNormal(scale=4.0))
        self.lif = etrax.nn.LIF(hidden, tau=10.0)
        self.out = etrax.nn.Linear(hidden, 1)

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.out(self.lif(self.fc(x)))
        return out


MODELS: dict[str, Callable[[int, int], brainstate.nn.Module]] = {
    "GRU": GRUNet,
    "LIF": SpikingLayer,
}


def build(name: str, hidden: int, batch: int, n_in: int = 10) -> tuple[etrax.ETraceGraph, Any]:
    """Compile a benchmark model; returns the graph and an example input."""
    model = MODELS[name](n_in, hidden)
    brainstate.nn.init_all_states(model, batch_size=None if batch == 1 else batch)
    x = jnp.ones((n_in,) if batch == 1 else (batch, n_in), jnp.float32)
    return etrax.compile_etrace_graph(model, x), x


def block(value: Any) -> Any:
    """`jax.block_until_ready` (unannotated in JAX)."""
    return jax.block_until_ready(value)  # type: ignore[no-untyped-call]


def time_fn(fn: Callable[[], Any], repeats: int = 5, min_time: float = 0.2) -> float:
    """Median wall time of `fn()` (blocking on its result), after one warm-up call."""
    block(fn())
    samples = []
    for _ in range(repeats):
        n = 0
        start = time.perf_counter()
        while True:
            block(fn())
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def write_device_report(
    out: Path, stem: str, title: str, preamble: str, header: list[str], rows: list[list[str]]
) -> str:
    """``# title (platform: device kind)``, `preamble` and the table of `rows`, written to
    ``out/<stem>_<platform>.md``; returns the text."""
    device = jax.devices()[0]
    tag = device.platform
    text = f"# {title} ({tag}: {device.device_kind})\n\n{preamble}\n\n{table(header, rows)}\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}_{tag}.md").write_text(text)
    return text


def write(name: str, text: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    return path
