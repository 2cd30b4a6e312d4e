"""`python -m etrax demo`: train small networks online and show it.

Two tasks, each learned online and, for reference, with exact BPTT, with live
progress bars, a summary table (loss, held-out accuracy, time per step, compiled
peak memory) and a PNG of what the table reports:

- **integrator** — a GRU must output the running sum of a noisy input over 100
  steps (long memory); D-RTRL, pp-prop and BPTT;
- **digits** — a recurrent network of LIF neurons with a leaky readout reads the
  8×8 handwritten digits that ship with scikit-learn row by row (8 steps) and names
  the digit; D-RTRL, pp-prop and BPTT, scored on 449 held-out images. The full
  version, with e-prop and ALIF neurons, is ``examples/digits.py``.

Every verdict printed is computed from the numbers that are plotted.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from . import nn
from .algorithms import DRTRL, OnlineAlgorithm, PPProp, bptt_grad, evaluate, online_grad
from .compiler import ETraceGraph, compile_etrace_graph
from .executor import ModelState, state_of

__all__ = ["run_demo"]

# The verdicts' thresholds, stated in the printed text.
LEARNED_RATIO = 0.5  # the integrator learned if its final loss is below half its initial loss
ROSE_RATIO = 1.2  # ... and it "rose again" if the final loss is 20 % above its lowest
SMOOTH = 25  # the plotted curves are running means over this many iterations


class IntegratorNet(brainstate.nn.Module):
    """``GRUCell(1, H) → Linear(H, 1)``."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.rnn = nn.GRUCell(1, hidden)
        self.out = nn.Linear(hidden, 1)

    def update(self, x: ArrayLike) -> Array:
        y: Array = self.out(self.rnn(x))
        return y


class DigitsNet(brainstate.nn.Module):
    """``x_t, s_{t−1} → LIF(H) → LeakyRateReadout(H, 10)``: a recurrent spiking network
    (the previous step's spikes ``s`` are a hidden state next to the membrane)."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.hidden = hidden
        self.inp = nn.Linear(8, hidden)
        self.rec = nn.Linear(
            hidden, hidden, w_init=brainstate.nn.init.KaimingNormal(scale=0.5), b_init=None
        )
        self.lif = nn.LIF(hidden, tau=5.0)
        self.out = nn.LeakyRateReadout(hidden, 10, tau=4.0)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.hidden,) if batch_size is None else (batch_size, self.hidden)
        self.s = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.init_state(batch_size)

    def update(self, x: ArrayLike) -> Array:
        spikes: Array = self.lif(self.inp(x) + self.rec(self.s.value))
        self.s.value = spikes
        logits: Array = self.out(spikes)
        return logits


Batch = tuple[Array, Any]


@dataclass
class Task:
    name: str
    make: Callable[[], brainstate.nn.Module]
    example: Array
    batch: Callable[[int], Batch]  # the i-th training batch, the same for every method
    loss: Callable[[Array, Any], Array]
    methods: tuple[str, ...]
    iterations: int
    learning_rate: float
    pp_decay: float  # pp-prop's trace decay: about 1 − 1/(the memory the task needs)
    test: Callable[[ETraceGraph, ModelState], float] | None = None  # held-out accuracy


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)
    accuracy: float | None = None
    step_ms: float = 0.0
    peak_mib: float = 0.0

    def curve(self) -> tuple[list[int], list[float]]:
        """The plotted curve: at each iteration from the `SMOOTH`-th on, the mean loss of
        the last `SMOOTH` iterations (of all of them, when there are fewer)."""
        w = min(SMOOTH, len(self.losses))
        its = list(range(w - 1, len(self.losses)))
        return its, [sum(self.losses[i - w + 1 : i + 1]) / w for i in its]

    def first_final_lowest(self) -> tuple[float, float, float]:
        """The curve's first and last points and its minimum, as plotted."""
        _, values = self.curve()
        return values[0], values[-1], min(values)


def _integrator(batch: int = 32, T: int = 100) -> Task:
    def make_batch(i: int) -> Batch:
        x = 0.5 * jax.random.normal(jax.random.PRNGKey(i), (T, batch, 1))
        return x, 0.1 * jnp.cumsum(x, axis=0)

    def loss(y: Array, t: Array) -> Array:
        return jnp.mean((y - t) ** 2)

    return Task(
        "integrator (GRU, 100 steps)",
        lambda: IntegratorNet(),
        jnp.zeros((batch, 1)),
        make_batch,
        loss,
        ("D-RTRL", "pp-prop", "BPTT"),
        iterations=300,
        learning_rate=1e-2,
        pp_decay=0.99,
    )


def _digits(batch: int = 64, epochs: int = 15) -> Task:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    xs = (images / 16.0).astype(np.float32).reshape(-1, 8, 8).transpose(1, 0, 2)
    order = np.random.default_rng(0).permutation(len(labels))
    n_test = round(0.25 * len(labels))  # a fixed split: the same as examples/digits.py
    test, train = order[:n_test], order[n_test:]
    per_epoch = len(train) // batch
    rng = np.random.default_rng(1)
    epochs_order = [rng.permutation(train) for _ in range(epochs)]
    # the readout's cross-entropy at every step, weighted up over the 8 rows
    weights = jnp.asarray(np.linspace(0.1, 1.0, 8, dtype=np.float32) / np.float32(8))

    def make_batch(i: int) -> Batch:
        epoch, b = divmod(i, per_epoch)
        idx = epochs_order[epoch % epochs][b * batch : (b + 1) * batch]
        y = jnp.asarray(labels[idx].astype(np.int32))
        return jnp.asarray(xs[:, idx]), (jnp.broadcast_to(y, (8, batch)), weights)

    def loss(y: Array, t: Any) -> Array:
        target, w = t
        logp = jax.nn.log_softmax(y, axis=-1)
        value: Array = -w * jnp.mean(jnp.take_along_axis(logp, target[:, None], axis=-1))
        return value

    def held_out(graph: ETraceGraph, state: ModelState) -> float:
        pad = (-n_test) % batch
        idx = np.concatenate([test, test[:pad]])
        correct = 0
        for i in range(0, len(idx), batch):
            ys, _ = evaluate(graph, state, jnp.asarray(xs[:, idx[i : i + batch]]))
            assert isinstance(ys, jax.Array)  # (T, B, 10): the readout at every step
            guess = np.asarray(jnp.argmax(ys[-1], axis=-1))
            keep = min(batch, n_test - i)
            correct += int(np.sum(guess[:keep] == labels[idx[i : i + keep]]))
        return correct / n_test

    return Task(
        f"digits (LIF, 8 rows, {epochs} epoch{'s' if epochs != 1 else ''})",
        lambda: DigitsNet(),
        jnp.zeros((batch, 8)),
        make_batch,
        loss,
        ("D-RTRL", "pp-prop", "BPTT"),
        iterations=epochs * per_epoch,
        learning_rate=1e-2,
        pp_decay=0.9,
        test=held_out,
    )


def _rule(method: str, task: Task) -> OnlineAlgorithm[Any] | None:
    rules: dict[str, OnlineAlgorithm[Any]] = {
        "D-RTRL": DRTRL(),
        "pp-prop": PPProp(task.pp_decay),
    }
    return rules.get(method)


def _schedule(learning_rate: float, iterations: int) -> Callable[[Array], Array]:
    """Cosine decay to 5 % of `learning_rate`: the loss settles instead of climbing back."""

    def schedule(count: Array) -> Array:
        frac = jnp.minimum(count / max(iterations, 1), 1.0)
        return learning_rate * (0.05 + 0.475 * (1.0 + jnp.cos(jnp.pi * frac)))

    return schedule


def _train(task: Task, graph: ETraceGraph, method: str, progress: Any) -> Result:
    import optax

    start = state_of(graph)  # every method starts from the same weights
    algo = _rule(method, task)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adam(_schedule(task.learning_rate, task.iterations)),
    )

    def iteration(params: Any, opt_state: Any, xs: Array, ts: Any) -> Any:
        state = ModelState(params, start.hidden, start.other)
        if algo is None:
            grads, aux = bptt_grad(graph, state, xs, ts, task.loss)
        else:
            traces = algo.init(graph, state)
            grads, aux = online_grad(graph, algo, state, traces, xs, ts, task.loss)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jnp.sum(aux["losses"]) / xs.shape[0]

    params = start.params
    opt_state = opt.init(params)
    xs, ts = task.batch(0)
    compiled = jax.jit(iteration).lower(params, opt_state, xs, ts).compile()
    memory = compiled.memory_analysis()
    result = Result()
    if memory is not None:
        peak = (
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
        )
        result.peak_mib = peak / 2**20
    elapsed = 0.0
    for i in range(task.iterations):
        xs, ts = task.batch(i)
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, xs, ts)
        value = float(loss)
        if i > 0:
            elapsed += time.perf_counter() - t0
        result.losses.append(value)
        progress.set_postfix_str(f"{method}: loss {value:.4f}")
        progress.update(1)
    result.step_ms = 1e3 * elapsed / max(task.iterations - 1, 1) / xs.shape[0]
    if task.test is not None:
        result.accuracy = task.test(graph, ModelState(params, start.hidden, start.other))
    return result


def _plot(results: dict[str, dict[str, Result]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = {t: r for t, r in results.items() if any(x.accuracy is not None for x in r.values())}
    panels = len(results) + len(scored)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    axes = np.atleast_1d(axes)
    for ax, (task, by_method) in zip(axes, results.items(), strict=False):
        for method, res in by_method.items():
            ax.plot(*res.curve(), label=method)
        ax.set_title(task)
        ax.set_xlabel("training iteration")
        ax.set_ylabel(f"mean loss per step (running mean of {SMOOTH})")
        ax.set_yscale("log")
        ax.legend()
    for ax, (task, by_method) in zip(axes[len(results) :], scored.items(), strict=True):
        names = list(by_method)
        accs = [100 * (by_method[m].accuracy or 0.0) for m in names]
        bars = ax.bar(names, accs, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, labels=[f"{a:.1f}%" for a in accs])
        ax.axhline(10.0, color="grey", linestyle=":", label="chance (10%)")
        ax.set_ylim(0, 105)
        ax.set_ylabel("held-out accuracy (%)")
        ax.set_title(f"{task}: held-out test set")
        ax.legend(loc="lower right")
    fig.suptitle("etrax: online learning vs BPTT")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _verdicts(results: dict[str, dict[str, Result]]) -> list[str]:
    """One line per task and method, computed from the plotted curves and bars."""
    lines = []
    for task_name, by_method in results.items():
        reference = by_method.get("BPTT")
        for method, r in by_method.items():
            first, final, lowest = r.first_final_lowest()
            if r.accuracy is not None:
                verdict = "learned" if r.accuracy >= 0.5 else "did NOT learn"
                text = f"held-out accuracy {100 * r.accuracy:.1f}% (chance 10%)"
                if reference is not None and reference.accuracy is not None and r is not reference:
                    gap = 100 * (reference.accuracy - r.accuracy)
                    text += f", {gap:.1f} points below BPTT" if gap > 0 else ", as good as BPTT"
            else:
                verdict = "learned" if final < LEARNED_RATIO * first else "did NOT learn"
                text = f"final loss is {100 * final / first:.0f}% of the initial loss"
            if final > ROSE_RATIO * lowest:
                text += f"; the loss rose again at the end ({final / lowest:.1f}× its lowest)"
            lines.append(f"{method:8s} {verdict} on {task_name}: {text}")
    return lines


def run_demo(out_dir: str = ".", quick: bool = False) -> Path:
    """Train both tasks with every method, print a summary and write the plot."""
    try:
        import matplotlib  # noqa: F401
        import optax  # noqa: F401
        import sklearn  # noqa: F401
        from tqdm import tqdm
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise SystemExit(
            f"the demo needs optax, matplotlib, tqdm and scikit-learn ({err}); install them "
            "with pip install -e '.[demo]'"
        ) from err
    tasks = [_integrator(), _digits(epochs=1 if quick else 15)]
    if quick:
        tasks[0].iterations = 20
        tasks[1].iterations = 5
        tasks[1].name = "digits (LIF, 8 rows, 5 batches)"
    results: dict[str, dict[str, Result]] = {}
    begin = time.perf_counter()
    for n, task in enumerate(tasks):
        brainstate.random.seed(n)
        model = task.make()
        brainstate.nn.init_all_states(model, batch_size=task.example.shape[0])
        graph = compile_etrace_graph(model, task.example)
        print(f"\n== {task.name}")
        print(graph.report().to_str(1), end="")
        results[task.name] = {}
        total = task.iterations * len(task.methods)
        with tqdm(
            total=total, ncols=90, desc="training", mininterval=0.5, miniters=max(1, total // 60)
        ) as bar:
            for method in task.methods:
                results[task.name][method] = _train(task, graph, method, progress=bar)
    print(
        f"\n{'task':36s} {'method':8s} {'first loss':>11s} {'final loss':>11s} "
        f"{'held-out':>9s} {'ms/step':>8s} {'XLA MiB':>9s}"
    )
    for task_name, by_method in results.items():
        for method, res in by_method.items():
            acc = "" if res.accuracy is None else f"{100 * res.accuracy:.1f}%"
            first, final, _ = res.first_final_lowest()
            print(
                f"{task_name:36s} {method:8s} {first:11.4f} {final:11.4f} {acc:>9s} "
                f"{res.step_ms:8.3f} {res.peak_mib:9.2f}"
            )
    print(
        f"\n(first / final loss: the mean loss of the first and of the last {SMOOTH} iterations, "
        "the first and last points of the plotted curves. A regression 'learned' if its final "
        f"loss is below {100 * LEARNED_RATIO:.0f}% of its first, and its loss 'rose again' if "
        f"the final value is over {100 * (ROSE_RATIO - 1):.0f}% above the curve's lowest; a "
        "classifier 'learned' if its held-out accuracy is at least 50%, five times chance.)"
    )
    if quick:
        print("(--quick: too few iterations to judge learning; run without it to see training.)")
    else:
        for line in _verdicts(results):
            print(line)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "etrax_demo.png"
    _plot(results, path)
    print(f"Plot written to {path} ({time.perf_counter() - begin:.0f} s in total).")
    return path
