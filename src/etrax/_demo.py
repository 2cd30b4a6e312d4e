"""`python -m etrax demo`: train small networks online and show it.

Two tasks, each learned three ways (D-RTRL, pp-prop, and exact BPTT for
reference), with live progress bars, a summary table (final loss / accuracy,
time per step, compiled peak memory) and a PNG of the learning curves:

- **integrator** — a GRU must output the running sum of a noisy input over 100
  steps (long memory);
- **spike patterns** — LIF neurons classify three spatio-temporal Poisson spike
  patterns, read out by a leaky rate readout.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from . import nn
from .algorithms import DRTRL, OnlineAlgorithm, PPProp, bptt_grad, online_grad
from .compiler import compile_etrace_graph
from .executor import ModelState, multi_step, state_of

__all__ = ["run_demo"]


class IntegratorNet(brainstate.nn.Module):
    """``GRUCell(1, H) → Linear(H, 1)``."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.rnn = nn.GRUCell(1, hidden)
        self.out = nn.Linear(hidden, 1)

    def update(self, x: ArrayLike) -> Array:
        y: Array = self.out(self.rnn(x))
        return y


class SpikingNet(brainstate.nn.Module):
    """``Linear(n_in, H) → LIF(H) → LeakyRateReadout(H, C)``."""

    def __init__(self, n_in: int = 20, hidden: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, hidden, w_init=brainstate.nn.init.KaimingNormal(scale=10.0))
        self.lif = nn.LIF(hidden, tau=5.0, detach_reset=True)
        self.out = nn.LeakyRateReadout(hidden, classes, tau=5.0)

    def update(self, x: ArrayLike) -> Array:
        y: Array = self.out(self.lif(self.fc(x)))
        return y


@dataclass
class Task:
    name: str
    make: Callable[[], brainstate.nn.Module]
    example: Array
    batch: Callable[[Array], tuple[Array, Any]]
    loss: Callable[[Array, Any], Array]
    accuracy: Callable[[Array, Any], Array] | None
    iterations: int
    learning_rate: float


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)
    accuracy: float | None = None
    step_ms: float = 0.0
    peak_mib: float = 0.0


def _integrator(batch: int = 32, T: int = 100) -> Task:
    def make_batch(key: Array) -> tuple[Array, Array]:
        x = 0.5 * jax.random.normal(key, (T, batch, 1))
        return x, 0.1 * jnp.cumsum(x, axis=0)

    def loss(y: Array, t: Array) -> Array:
        return jnp.mean((y - t) ** 2)

    return Task(
        "integrator (GRU, 100 steps)",
        lambda: IntegratorNet(),
        jnp.zeros((batch, 1)),
        make_batch,
        loss,
        None,
        iterations=250,
        learning_rate=3e-3,
    )


def _spikes(batch: int = 32, T: int = 30, n_in: int = 20, classes: int = 3) -> Task:
    # each class drives its own block of input channels, with a class-specific rhythm
    block = jnp.arange(n_in) * classes // n_in
    phase = jnp.arange(T)[None, :, None] % (jnp.arange(classes)[:, None, None] + 2) == 0
    rates = jnp.where(
        block[None, None, :] == jnp.arange(classes)[:, None, None],
        jnp.where(phase, 0.6, 0.2),
        0.05,
    )
    # the readout is scored over the last third of the sequence
    weight = (jnp.arange(T) >= 2 * T // 3).astype(jnp.float32) * 3.0

    def make_batch(key: Array) -> tuple[Array, Any]:
        k1, k2 = jax.random.split(key)
        labels = jax.random.randint(k1, (batch,), 0, classes)
        p = rates[labels].transpose(1, 0, 2)  # (T, batch, n_in)
        spikes = jax.random.bernoulli(k2, p).astype(jnp.float32)
        return spikes, (jnp.broadcast_to(labels, (T, batch)), weight)

    def loss(y: Array, t: Any) -> Array:
        labels, w = t
        logp = jax.nn.log_softmax(y, axis=-1)
        value: Array = -w * jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))
        return value

    def accuracy(ys: Array, ts: Any) -> Array:
        labels, _ = ts
        return jnp.mean(jnp.argmax(ys[-1], axis=-1) == labels[-1])

    return Task(
        "spike patterns (LIF, 30 steps)",
        lambda: SpikingNet(n_in, 64, classes),
        jnp.zeros((batch, n_in)),
        make_batch,
        loss,
        accuracy,
        iterations=200,
        learning_rate=1e-2,
    )


def _train(task: Task, method: str, seed: int, progress: Any) -> Result:
    import optax

    brainstate.random.seed(seed)  # every method starts from the same weights
    model = task.make()
    brainstate.nn.init_all_states(model, batch_size=task.example.shape[0])
    graph = compile_etrace_graph(model, task.example)
    start = state_of(graph)
    rules: dict[str, OnlineAlgorithm[Any]] = {"D-RTRL": DRTRL(), "pp-prop": PPProp(0.9)}
    algo = rules.get(method)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(task.learning_rate))

    def iteration(params: Any, opt_state: Any, key: Array) -> Any:
        xs, ts = task.batch(key)
        state = ModelState(params, start.hidden, start.other)
        if algo is None:
            grads, aux = bptt_grad(graph, state, xs, ts, task.loss)
        else:
            traces = algo.init(graph, state)
            grads, aux = online_grad(graph, algo, state, traces, xs, ts, task.loss)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jnp.mean(aux["losses"])

    run = jax.jit(iteration)
    params = start.params
    opt_state = opt.init(params)
    key = jax.random.PRNGKey(seed)
    compiled = run.lower(params, opt_state, key).compile()
    memory = compiled.memory_analysis()
    result = Result()
    if memory is not None:
        peak = (
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
        )
        result.peak_mib = peak / 2**20
    T = task.batch(key)[0].shape[0]
    elapsed = 0.0
    for i in range(task.iterations):
        key, sub = jax.random.split(key)
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, sub)
        value = float(loss)
        if i > 0:
            elapsed += time.perf_counter() - t0
        result.losses.append(value)
        progress.set_postfix_str(f"{method}: loss {value:.4f}")
        progress.update(1)
    result.step_ms = 1e3 * elapsed / max(task.iterations - 1, 1) / T
    if task.accuracy is not None:
        accs = []
        for j in range(8):
            xs, ts = task.batch(jax.random.PRNGKey(10_000 + j))
            state = ModelState(params, start.hidden, start.other)
            ys, _, _ = multi_step(graph, state, xs)
            accs.append(float(task.accuracy(ys, ts)))
        result.accuracy = sum(accs) / len(accs)
    return result


def _plot(results: dict[str, dict[str, Result]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (task, by_method) in zip(axes, results.items(), strict=True):
        for method, res in by_method.items():
            k = 10
            smooth = [
                sum(res.losses[max(0, i - k + 1) : i + 1]) / min(i + 1, k)
                for i in range(len(res.losses))
            ]
            ax.plot(smooth, label=method)
        ax.set_title(task)
        ax.set_xlabel("training iteration")
        ax.set_ylabel("mean loss per step (running mean of 10)")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle("etrax: online learning (D-RTRL, pp-prop) vs BPTT")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(out_dir: str = ".", quick: bool = False) -> Path:
    """Train both tasks with every method, print a summary and write the plot."""
    try:
        import matplotlib  # noqa: F401
        import optax  # noqa: F401
        from tqdm import tqdm
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise SystemExit(
            f"the demo needs optax, matplotlib and tqdm ({err}); install them with "
            "pip install -e '.[demo]'"
        ) from err
    tasks = [_integrator(), _spikes()]
    if quick:
        for t in tasks:
            t.iterations = 5
    methods = ["D-RTRL", "pp-prop", "BPTT"]
    results: dict[str, dict[str, Result]] = {}
    begin = time.perf_counter()
    for n, task in enumerate(tasks):
        graph = compile_etrace_graph(_initialised(task), task.example)
        print(f"\n== {task.name}")
        print(graph.report().to_str(1), end="")
        results[task.name] = {}
        total = task.iterations * len(methods)
        with tqdm(
            total=total, ncols=90, desc="training", mininterval=0.5, miniters=max(1, total // 60)
        ) as bar:
            for method in methods:
                results[task.name][method] = _train(task, method, seed=n, progress=bar)
    print(
        f"\n{'task':32s} {'method':8s} {'first loss':>11s} {'final loss':>11s} "
        f"{'accuracy':>9s} {'ms/step':>8s} {'XLA MiB':>9s}"
    )
    for task_name, by_method in results.items():
        for method, res in by_method.items():
            acc = "" if res.accuracy is None else f"{100 * res.accuracy:.0f}%"
            final = sum(res.losses[-10:]) / len(res.losses[-10:])
            print(
                f"{task_name:32s} {method:8s} {res.losses[0]:11.4f} {final:11.4f} "
                f"{acc:>9s} {res.step_ms:8.3f} {res.peak_mib:9.2f}"
            )
    print()
    if quick:
        print("(--quick: too few iterations to judge learning; run without it to see training.)")
    for task_name, by_method in results.items():
        for method, r in by_method.items():
            if quick:
                break
            first = sum(r.losses[:5]) / len(r.losses[:5])
            final = sum(r.losses[-10:]) / len(r.losses[-10:])
            verdict = "learned" if final < 0.6 * first else "did NOT learn"
            print(
                f"{method:8s} {verdict} on {task_name}: final loss is {100 * final / first:.0f}% "
                "of the initial loss"
            )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "etrax_demo.png"
    _plot(results, path)
    print(f"Learning curves written to {path} ({time.perf_counter() - begin:.0f} s in total).")
    return path


def _initialised(task: Task) -> brainstate.nn.Module:
    model = task.make()
    brainstate.nn.init_all_states(model, batch_size=task.example.shape[0])
    return model
