"""Memory of online learning vs BPTT as the sequence grows.

The reason etrax exists: backpropagation through time keeps every step's
activations for the backward pass, so its memory grows linearly with the sequence
length ``T``; the online rules (D-RTRL, pp-prop, e-prop) carry traces forward and
need the same memory at ``T = 100`` as at ``T = 30,000``.

For each method and each ``T`` the script compiles the gradient computation of a
``GRUCell(8, 128) → Linear(128, 8)`` network (batch 8) with `jax.jit` and reads
XLA's own accounting of the compiled program (``compiled.memory_analysis()``):

- **scratch**: the temporary buffers the program allocates (activations kept for
  the backward pass, traces, per-chunk Jacobians): the memory the learning rule
  itself needs;
- **peak**: scratch + arguments + outputs. The arguments include the input and
  target sequences ``(T, B, 8)``, which every method is handed whole here, so every
  peak grows by their size (a streaming run feeds them a chunk at a time).

Nothing is drawn from a formula: every number is XLA's, measured per compiled program.
The programs are compiled, not run, so even the long sequences take seconds.

With ``--rss`` the script also *runs* each method in a fresh process and reports the
process's peak resident memory (``ru_maxrss``). There the online rules learn from a
stream: the sequence arrives in chunks of 100 steps, each generated when it is
needed, and the state and traces of one chunk start the next, so the gradient is
that of the whole sequence while only one chunk is ever held. BPTT needs the whole
sequence at once.

Run it with ``python examples/memory.py`` (writes ``etrax_memory.png``; about a
minute on two CPU cores), ``python examples/memory.py --rss`` (a few minutes more) or
``python examples/memory.py --short``.
"""

import argparse
import resource
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

import etrax

BATCH, INPUTS, HIDDEN = 8, 8, 128
METHODS = ("D-RTRL", "pp-prop", "e-prop", "BPTT")
LENGTHS = (100, 300, 1_000, 3_000, 10_000, 30_000)
SHORT_LENGTHS = (10, 100)
RSS_LENGTHS = (100, 1_000, 10_000)
CHUNK = 100  # steps per chunk of the online stream (--rss)
MiB = 2**20


class Net(brainstate.nn.Module):
    """``GRUCell(8, 128) → Linear(128, 8)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = etrax.nn.GRUCell(INPUTS, HIDDEN)
        self.out = etrax.nn.Linear(HIDDEN, INPUTS)

    def update(self, x: ArrayLike) -> Array:
        y: Array = self.out(self.rnn(x))
        return y


def mse(y: Array, target: Array) -> Array:
    return jnp.mean((y - target) ** 2)


@dataclass(frozen=True)
class Measurement:
    method: str
    T: int
    scratch_mib: float
    peak_mib: float
    data_mib: float  # the input and target sequences (part of the peak)


def rule_for(method: str) -> etrax.OnlineAlgorithm[Any] | None:
    rules: dict[str, etrax.OnlineAlgorithm[Any]] = {
        "D-RTRL": etrax.DRTRL(),
        "pp-prop": etrax.PPProp(decay=0.9),
        "e-prop": etrax.EProp(kappa=0.5),
    }
    return rules.get(method)


def measure(graph: etrax.ETraceGraph, method: str, T: int) -> Measurement:
    """Compile the whole-sequence gradient for `T` steps; read XLA's memory accounting."""
    state = etrax.state_of(graph)
    algo = rule_for(method)

    def gradient(state: etrax.ModelState, xs: Array, targets: Array) -> Any:
        if algo is None:
            return etrax.bptt_grad(graph, state, xs, targets, mse).grads
        traces = algo.init(graph, state)
        return etrax.online_grad(graph, algo, state, traces, xs, targets, mse).grads

    dtype = jax.tree.leaves(state.params)[0].dtype
    seq = jnp.zeros((T, BATCH, INPUTS), dtype)  # only its shape and dtype matter
    compiled = jax.jit(gradient).lower(state, seq, seq).compile()
    memory = compiled.memory_analysis()
    if memory is None:  # pragma: no cover - every XLA backend etrax runs on reports it
        raise RuntimeError("this JAX backend reports no memory analysis")
    scratch = memory.temp_size_in_bytes
    peak = scratch + memory.argument_size_in_bytes + memory.output_size_in_bytes
    return Measurement(method, T, scratch / MiB, peak / MiB, 2 * seq.nbytes / MiB)


def build() -> etrax.ETraceGraph:
    brainstate.random.seed(0)
    net = Net()
    brainstate.nn.init_all_states(net, batch_size=BATCH)
    return etrax.compile_etrace_graph(net, jnp.zeros((BATCH, INPUTS)))


def run(lengths: Sequence[int], methods: Sequence[str] = METHODS) -> list[Measurement]:
    """Measure every method at every length."""
    graph = build()
    return [measure(graph, method, T) for method in methods for T in lengths]


def _data(key: Array, steps: int, dtype: Any) -> tuple[Array, Array]:
    """Inputs and targets of `steps` steps: noise and its scaled running sum."""
    xs = jax.random.normal(key, (steps, BATCH, INPUTS), dtype)
    return xs, 0.1 * jnp.cumsum(xs, axis=0)


def run_and_measure_rss(method: str, T: int) -> float:
    """Compute the gradient over `T` steps in this process; its peak RSS in MiB.

    The online rules stream the sequence in chunks of `CHUNK` steps, carrying the
    state and traces from chunk to chunk (the sum of the chunks' gradients is the
    gradient of the whole sequence); BPTT takes the whole sequence at once.
    """
    graph = build()
    start = etrax.state_of(graph)
    dtype = jax.tree.leaves(start.params)[0].dtype
    key = jax.random.key(0)
    algo = rule_for(method)
    if algo is None:

        @jax.jit
        def whole(state: etrax.ModelState, key: Array) -> Any:
            xs, targets = _data(key, T, dtype)
            return etrax.bptt_grad(graph, state, xs, targets, mse).grads

        total: Any = whole(start, key)
    else:
        rule = algo

        @jax.jit
        def chunk(state: etrax.ModelState, traces: Any, key: Array) -> Any:
            xs, targets = _data(key, CHUNK, dtype)
            result = etrax.online_grad(graph, rule, state, traces, xs, targets, mse)
            return result.grads, result.state, result.traces

        state, traces = start, rule.init(graph, start)
        total = None
        for i in range(T // CHUNK):
            grads, state, traces = chunk(state, traces, jax.random.fold_in(key, i))
            total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    for leaf in jax.tree.leaves(total):
        leaf.block_until_ready()
    return _peak_rss_mib()


def _peak_rss_mib() -> float:
    """This process's peak resident memory in MiB. On Linux, from ``VmHWM`` in
    ``/proc/self/status``: ``ru_maxrss`` would also count the parent's memory at the
    fork that started this process."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (MiB if sys.platform == "darwin" else 1024)


def peak_rss(
    lengths: Sequence[int], methods: Sequence[str] = METHODS
) -> dict[tuple[str, int], float]:
    """Peak RSS (MiB) of a fresh process per method and length (see `run_and_measure_rss`)."""
    out = {}
    for method in methods:
        for T in lengths:
            if T % CHUNK:
                raise ValueError(f"--rss lengths must be multiples of {CHUNK}, got {T}")
            done = subprocess.run(
                [sys.executable, __file__, "--rss-worker", method, str(T)],
                capture_output=True,
                text=True,
                check=True,
            )
            out[method, T] = float(done.stdout.split()[-1])
    return out


def rss_table(rss: dict[tuple[str, int], float]) -> str:
    """A markdown table of peak RSS (MiB) per method and length."""
    lengths = sorted({T for _, T in rss})
    methods = list(dict.fromkeys(m for m, _ in rss))
    head = "| method | " + " | ".join(f"T = {T:,}" for T in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    rows = [f"| {m} | " + " | ".join(f"{rss[m, T]:.0f}" for T in lengths) + " |" for m in methods]
    return "\n".join([head, rule, *rows])


def table(results: Sequence[Measurement]) -> str:
    """A markdown table: scratch MiB (peak MiB) per method and length."""
    lengths = sorted({r.T for r in results})
    methods = list(dict.fromkeys(r.method for r in results))
    by = {(r.method, r.T): r for r in results}
    head = "| method | " + " | ".join(f"T = {T:,}" for T in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    rows = [
        f"| {m} | "
        + " | ".join(
            f"{by[m, T].scratch_mib:.2f} ({by[m, T].peak_mib:.2f})" if (m, T) in by else ""
            for T in lengths
        )
        + " |"
        for m in methods
    ]
    data = {r.T: r.data_mib for r in results}
    rows.append("| *xs + targets* | " + " | ".join(f"*{data[T]:.2f}*" for T in lengths) + " |")
    return "\n".join([head, rule, *rows])


def plot(
    results: Sequence[Measurement], path: Path, rss: dict[tuple[str, int], float] | None = None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if rss else 2, figsize=(16.5 if rss else 11, 4))
    for ax, field, title in (
        (axes[0], "scratch_mib", "scratch: what the learning rule allocates"),
        (axes[1], "peak_mib", "peak: scratch + arguments (incl. the sequences) + outputs"),
    ):
        for method in dict.fromkeys(r.method for r in results):
            points = sorted((r.T, getattr(r, field)) for r in results if r.method == method)
            ax.plot(*zip(*points, strict=True), marker="o", label=method)
        if field == "peak_mib":
            data = sorted({(r.T, r.data_mib) for r in results})
            ax.plot(*zip(*data, strict=True), "k:", label="xs + targets alone")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("MiB (XLA memory analysis)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if rss:
        ax = axes[2]
        for method in dict.fromkeys(m for m, _ in rss):
            points = sorted((T, v) for (m, T), v in rss.items() if m == method)
            ax.plot(*zip(*points, strict=True), marker="o", label=method)
        ax.set_xscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("MiB (peak RSS of the process)")
        ax.set_title(f"run: peak RSS (online: a stream of {CHUNK}-step chunks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"Gradient of a GRUCell({INPUTS}, {HIDDEN}) network over T steps, batch {BATCH}: "
        "online rules vs BPTT"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Measurement]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="two short lengths (smoke test)")
    parser.add_argument("--rss", action="store_true", help="also run each method: peak RSS")
    parser.add_argument("--out", default=".", help="folder for etrax_memory.png")
    parser.add_argument("--rss-worker", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_worker:
        method, T = args.rss_worker
        print(run_and_measure_rss(method, int(T)))
        return []
    results = run(SHORT_LENGTHS if args.short else LENGTHS)
    print(
        "Scratch MiB (peak MiB in brackets, with the input and target sequences), from XLA's "
        "compiled memory analysis:\n"
    )
    print(table(results))
    rss = None
    if args.rss:
        rss = peak_rss((100, 200) if args.short else RSS_LENGTHS)
        print("\nPeak RSS MiB of a process that runs the gradient (online rules streaming):\n")
        print(rss_table(rss))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "etrax_memory.png"
    plot(results, path, rss)
    print(f"\nPlot written to {path}")
    return results


if __name__ == "__main__":
    main()
