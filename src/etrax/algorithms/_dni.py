"""Synthetic gradients (DNI): a linear synthesiser that predicts, from the hidden
state at a window's exit, the cotangent the rest of the sequence would send back.

Windowed learning (``online_grad(..., window=k)``) runs exact reverse mode inside
each window; the traces carry credit across windows for traced weights, but every
other parameter (readouts, plainly used weights, excluded weights) sees only its
window. A `SyntheticGradient` fills that gap (Jaderberg et al. 2017): its prediction
``ĝ(h_exit)`` is pushed back through the window as if it came from later steps,
and is added to the gradients of the parameters that no relation traces.

It trains itself by bootstrapping: at each window's entry, its prediction for the
entry state is moved towards the cotangent that actually arrived there (the
window's own losses plus the synthetic cotangent at its exit), by one step of
gradient descent on the squared error.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..compiler import ETraceGraph

__all__ = ["SyntheticGradient"]


def _features(graph: ETraceGraph, index: int) -> tuple[int, int]:
    group = graph.hidden_groups[index]
    width = group.varshape[-1] if group.varshape else 1
    return width, group.num_state


class SyntheticGradient(eqx.Module):
    """A linear synthetic-gradient model per hidden group:
    ``ĝ[..., h, a] = Σ_{h', b} s[..., h', b] A[h', b, h, a] + c[h, a]`` over the group's
    last varshape axis and its ``S`` states; leading axes (a batch axis) are shared.

    **Arguments:**

    - `A`: per group, ``(H, S, H, S)``.
    - `c`: per group, ``(H, S)``.
    """

    A: tuple[Array, ...]
    c: tuple[Array, ...]

    @staticmethod
    def zeros(graph: ETraceGraph, dtype: Any = None) -> "SyntheticGradient":
        """An untrained synthesiser (it predicts zero) for every group of `graph`, in
        `dtype` (default: JAX's default float)."""
        dt = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
        shapes = [_features(graph, g.index) for g in graph.hidden_groups]

        def zeros(shape: tuple[int, ...]) -> Array:
            # NumPy zeros placed on the device: eager `jnp.zeros` compiles a small XLA
            # program for every new shape
            placed: Array = jax.device_put(np.zeros(shape, dt))
            return placed

        return SyntheticGradient(
            tuple(zeros((h, s, h, s)) for h, s in shapes),
            tuple(zeros((h, s)) for h, s in shapes),
        )

    def predict(self, graph: ETraceGraph, slabs: Sequence[Array]) -> tuple[Array, ...]:
        """The predicted cotangent of each group's ``(*varshape, S)`` slab."""
        out = []
        for g, slab in zip(graph.hidden_groups, slabs, strict=True):
            h, s = _features(graph, g.index)
            x = slab.reshape(-1, h, s)
            pred = jnp.einsum("nhs,hskt->nkt", x, self.A[g.index]) + self.c[g.index]
            out.append(pred.reshape(slab.shape))
        return tuple(out)

    def step(
        self,
        graph: ETraceGraph,
        slabs: Sequence[Array],
        targets: Sequence[Array],
        learning_rate: float,
    ) -> "SyntheticGradient":
        """One gradient-descent step on ``½ mean ‖ĝ(slab) − target‖²`` (the mean over
        leading axes), per group."""
        A, c = [], []
        for g, slab, target, pred in zip(
            graph.hidden_groups, slabs, targets, self.predict(graph, slabs), strict=True
        ):
            h, s = _features(graph, g.index)
            x = slab.reshape(-1, h, s)
            err = (pred - target).reshape(-1, h, s)
            n = x.shape[0]
            A.append(self.A[g.index] - learning_rate * jnp.einsum("nhs,nkt->hskt", x, err) / n)
            c.append(self.c[g.index] - learning_rate * jnp.sum(err, axis=0) / n)
        return SyntheticGradient(tuple(A), tuple(c))
