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

Run it with ``python examples/memory.py`` (writes ``etrax_memory.png``; about a
minute on two CPU cores) or ``python examples/memory.py --short``.
"""

import argparse
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


def plot(results: Sequence[Measurement], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
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
    parser.add_argument("--out", default=".", help="folder for etrax_memory.png")
    args = parser.parse_args(argv)
    results = run(SHORT_LENGTHS if args.short else LENGTHS)
    print(
        "Scratch MiB (peak MiB in brackets, with the input and target sequences), from XLA's "
        "compiled memory analysis:\n"
    )
    print(table(results))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "etrax_memory.png"
    plot(results, path)
    print(f"\nPlot written to {path}")
    return results


if __name__ == "__main__":
    main()
