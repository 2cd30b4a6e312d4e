"""`python -m etrax demo`: compile the bundled example models and show their graphs."""

import time

import brainstate
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from . import nn
from .compiler import compile_etrace_graph

__all__ = ["demo_models", "run_demo"]


class StackedGRU(brainstate.nn.Module):
    """Two GRU layers and a linear readout."""

    def __init__(self, n_in: int = 3, n_hidden: int = 8, n_out: int = 2) -> None:
        super().__init__()
        self.l1 = nn.GRUCell(n_in, n_hidden)
        self.l2 = nn.GRUCell(n_hidden, n_hidden)
        self.out = nn.Linear(n_hidden, n_out)

    def update(self, x: ArrayLike) -> Array:
        return self.out(self.l2(self.l1(x)))


class AdaptiveNeuron(brainstate.nn.Module):
    """A leaky neuron with an adaptation current (two hidden states, one group)."""

    def __init__(self, n_in: int = 3, n_out: int = 8) -> None:
        super().__init__()
        self.n_out = n_out
        self.fc = nn.Linear(n_in, n_out)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.n_out,) if batch_size is None else (batch_size, self.n_out)
        self.V = brainstate.HiddenState(jnp.zeros(shape))
        self.a = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: ArrayLike) -> Array:
        v = 0.9 * self.V.value - 0.2 * self.a.value + self.fc(x)
        a = 0.95 * self.a.value + 0.05 * jnp.tanh(v)
        self.V.value = v
        self.a.value = a
        return v


def demo_models() -> dict[str, brainstate.nn.Module]:
    """The bundled example models, by name."""
    return {
        "GRUCell(3, 8)": nn.GRUCell(3, 8),
        "LSTMCell(3, 8)": nn.LSTMCell(3, 8),
        "two GRU layers + Linear readout": StackedGRU(),
        "adaptive leaky neuron (V, a)": AdaptiveNeuron(),
    }


def run_demo() -> None:
    """Compile every bundled model and print its compilation report."""
    for name, model in demo_models().items():
        brainstate.nn.init_all_states(model)
        start = time.perf_counter()
        graph = compile_etrace_graph(model, jnp.zeros(3))
        elapsed = (time.perf_counter() - start) * 1e3
        print(f"\n### {name}  (compiled in {elapsed:.1f} ms)")
        print(graph.report().to_str(2), end="")
