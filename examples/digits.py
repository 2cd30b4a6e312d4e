"""Sequential digits: a spiking network reads 8×8 handwritten digits row by row.

The 1,797 digits that ship with scikit-learn (``sklearn.datasets.load_digits``) are
fed one image row per step (8 steps of 8 pixels) into a recurrent network of LIF or
ALIF neurons with a leaky readout, which must name the digit after the last row.
The network learns online with e-prop and D-RTRL (memory independent of the
sequence length) and, for reference, with exact BPTT; each method starts from the
same weights and sees the same batches, and the script reports the held-out accuracy
on a fixed 25 % test split.

Run it with ``python examples/digits.py`` (a few minutes on two CPU cores) or
``python examples/digits.py --short`` (a few seconds: a smoke test). It needs
scikit-learn and optax (``pip install -e ".[demo]"``).
"""

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, Int

import etrax

CLASSES = 10
ROWS = 8  # time steps: one image row per step
PIXELS = 8  # inputs per step

# --- 1. The data: images as sequences of rows ------------------------------------------


@dataclass(frozen=True)
class Split:
    """Images as time-major sequences ``(T, N, 8)`` in ``[0, 1]`` and their labels ``(N,)``."""

    xs: Float[np.ndarray, "T N F"]
    labels: Int[np.ndarray, " N"]


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> tuple[Split, Split]:
    """The scikit-learn digits as row sequences, split once into train and test sets."""
    from sklearn.datasets import load_digits as sklearn_digits

    images, labels = sklearn_digits(return_X_y=True)
    xs = (images / 16.0).astype(np.float32).reshape(-1, ROWS, PIXELS).transpose(1, 0, 2)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = round(test_fraction * len(labels))
    test, train = order[:n_test], order[n_test:]
    return (
        Split(xs[:, train], labels[train].astype(np.int32)),
        Split(xs[:, test], labels[test].astype(np.int32)),
    )


# --- 2. The network ----------------------------------------------------------------------


class SpikingClassifier(brainstate.nn.Module):
    """``x_t, s_{t−1} → LIF/ALIF → leaky readout``: a recurrent spiking network.

    The input and recurrent weights drive the neurons; the previous step's spikes
    are kept as a hidden state ``s`` (element-wise in the membrane, so it joins the
    neurons' hidden group). The leaky readout integrates the spikes over time.
    """

    def __init__(self, hidden: int = 128, adaptive: bool = False) -> None:
        super().__init__()
        self.hidden = hidden
        self.inp = etrax.nn.Linear(PIXELS, hidden)
        self.rec = etrax.nn.Linear(
            hidden, hidden, w_init=brainstate.nn.init.KaimingNormal(scale=0.5), b_init=None
        )
        self.neurons: brainstate.nn.Module = (
            etrax.nn.ALIF(hidden, tau=5.0, tau_a=20.0, beta=0.2)
            if adaptive
            else etrax.nn.LIF(hidden, tau=5.0)
        )
        self.out = etrax.nn.LeakyRateReadout(hidden, CLASSES, tau=4.0)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.hidden,) if batch_size is None else (batch_size, self.hidden)
        self.s = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.init_state(batch_size)

    def update(self, x: ArrayLike) -> Array:
        spikes: Array = self.neurons(self.inp(x) + self.rec(self.s.value))
        self.s.value = spikes
        logits: Array = self.out(spikes)
        return logits


# --- 3. The loss: cross-entropy of the readout at every step, later steps weighted more --

# The readout integrates the spikes, so its value at step t is a running summary of the
# rows seen so far. Online rules learn from per-step losses: every step's readout is
# asked for the label, with weights growing over the sequence (the first rows say little).
STEP_WEIGHTS = np.linspace(0.1, 1.0, ROWS, dtype=np.float32) / np.float32(ROWS)


def loss_fn(logits: Array, target: tuple[Array, Array]) -> Array:
    """Weighted cross-entropy of one step; ``target`` is ``(labels (B,), weight ())``."""
    labels, weight = target
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=-1)
    value: Array = weight * jnp.mean(nll)
    return value


# --- 4. Training ---------------------------------------------------------------------------

Method = str  # "e-prop", "D-RTRL", "pp-prop" or "BPTT"


def rule_for(method: Method) -> etrax.OnlineAlgorithm[Any] | None:
    """The learning rule of a method (`None` for BPTT)."""
    if method == "e-prop":
        # e-prop's low-pass filter follows the leaky readout's decay (Bellec et al. 2020)
        return etrax.EProp(kappa=float(np.exp(-1.0 / 4.0)))
    if method == "D-RTRL":
        return etrax.DRTRL()
    if method == "pp-prop":
        return etrax.PPProp(decay=0.9)
    if method == "BPTT":
        return None
    raise ValueError(f"unknown method {method!r}; pick e-prop, D-RTRL, pp-prop or BPTT")


@dataclass
class Result:
    method: Method
    neuron: str
    losses: list[float]
    train_accuracy: float
    test_accuracy: float
    seconds: float


def build(batch: int, adaptive: bool, seed: int) -> tuple[etrax.ETraceGraph, etrax.ModelState]:
    """Compile the network for batches of `batch` sequences; the same weights per seed."""
    brainstate.random.seed(seed)
    net = SpikingClassifier(adaptive=adaptive)
    brainstate.nn.init_all_states(net, batch_size=batch)
    graph = etrax.compile_etrace_graph(net, jnp.zeros((batch, PIXELS)))
    return graph, etrax.state_of(graph)


def accuracy(
    graph: etrax.ETraceGraph, start: etrax.ModelState, params: Any, data: Split, batch: int
) -> float:
    """Held-out accuracy: the readout's class after the last row, forward only."""
    state = etrax.ModelState(params, start.hidden, start.other)
    n = int(data.labels.shape[0])
    pad = (-n) % batch
    xs = np.concatenate([data.xs, np.zeros((ROWS, pad, PIXELS), data.xs.dtype)], axis=1)
    correct = 0
    for i in range(0, n + pad, batch):
        ys, _ = etrax.evaluate(graph, state, jnp.asarray(xs[:, i : i + batch]))
        assert isinstance(ys, jax.Array)  # (T, B, 10): the readout at every step
        guess = np.asarray(jnp.argmax(ys[-1], axis=-1))
        correct += int(np.sum(guess[: max(0, min(batch, n - i))] == data.labels[i : i + batch]))
    return correct / n


def train(
    method: Method,
    train_set: Split,
    test_set: Split,
    *,
    adaptive: bool = False,
    epochs: int = 30,
    batch: int = 64,
    learning_rate: float = 3e-3,
    seed: int = 0,
    max_batches: int | None = None,
    log: Callable[[str], None] | None = print,
) -> Result:
    """Train one network with `method` and measure its accuracy on both splits."""
    graph, start = build(batch, adaptive, seed)
    algo = rule_for(method)
    n_batches = train_set.labels.shape[0] // batch
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    total = epochs * n_batches

    def schedule(count: Array) -> Array:
        # cosine decay to 5 %: the loss settles instead of bouncing at the end
        frac = jnp.minimum(count / total, 1.0)
        return learning_rate * (0.05 + 0.95 * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))

    opt = optax.adam(schedule)
    weights = jnp.asarray(STEP_WEIGHTS)

    @jax.jit
    def update(params: Any, opt_state: Any, xs: Array, labels: Array) -> Any:
        state = etrax.ModelState(params, start.hidden, start.other)
        targets = (jnp.broadcast_to(labels, (ROWS, batch)), weights)
        if algo is None:
            grads, aux = etrax.bptt_grad(graph, state, xs, targets, loss_fn)
        else:
            grads, aux = etrax.online_grad(
                graph, algo, state, algo.init(graph, state), xs, targets, loss_fn
            )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.sum(aux["losses"])

    params = start.params
    opt_state = opt.init(params)
    rng = np.random.default_rng(seed)
    losses: list[float] = []
    begin = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(train_set.labels.shape[0])
        epoch_losses = []
        for b in range(n_batches):
            idx = order[b * batch : (b + 1) * batch]
            params, opt_state, loss = update(
                params,
                opt_state,
                jnp.asarray(train_set.xs[:, idx]),
                jnp.asarray(train_set.labels[idx]),
            )
            epoch_losses.append(float(loss))
        losses.append(sum(epoch_losses) / len(epoch_losses))
        if log is not None and (epoch + 1) % max(1, epochs // 5) == 0:
            log(f"  {method:7s} epoch {epoch + 1:3d}: loss {losses[-1]:.3f}")
    seconds = time.perf_counter() - begin
    return Result(
        method,
        "ALIF" if adaptive else "LIF",
        losses,
        accuracy(graph, start, params, train_set, batch),
        accuracy(graph, start, params, test_set, batch),
        seconds,
    )


def main(argv: Sequence[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a few batches only (smoke test)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["e-prop", "D-RTRL", "BPTT"],
        help="e-prop D-RTRL pp-prop BPTT",
    )
    parser.add_argument("--neurons", nargs="+", default=["LIF", "ALIF"], choices=["LIF", "ALIF"])
    args = parser.parse_args(argv)
    train_set, test_set = load_digits()
    epochs, max_batches = (1, 4) if args.short else (args.epochs, None)
    results = []
    for neuron in args.neurons:
        for method in args.methods:
            print(f"{neuron} network, {method}:")
            results.append(
                train(
                    method,
                    train_set,
                    test_set,
                    adaptive=neuron == "ALIF",
                    epochs=epochs,
                    max_batches=max_batches,
                    log=None if args.short else print,
                )
            )
    print(f"\n{'neurons':8s} {'method':8s} {'train acc':>9s} {'test acc':>9s} {'time':>7s}")
    for r in results:
        print(
            f"{r.neuron:8s} {r.method:8s} {100 * r.train_accuracy:8.1f}% "
            f"{100 * r.test_accuracy:8.1f}% {r.seconds:6.1f}s"
        )
    return results


if __name__ == "__main__":
    main()
