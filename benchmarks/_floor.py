"""A hand-written pp-prop for one GRU layer in plain JAX: the cost floor.

It computes the same quantities `online_grad(graph, PPProp(...))` does for
``GRUCell(I, H) → Linear(H, 1)`` (rank-one traces ``x̄ ⊗ f̄`` for ``W_z`` and
``W_h``, the exact instantaneous gradient of ``W_r``, gradient contractions
batched over chunks of K steps), with none of etrax's generality. Its time
relative to its own forward-only scan is what this CPU allows; etrax's ratio is
compared with it.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["handwritten_times"]


def _weights(n_in: int, hidden: int) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    scale = (n_in + hidden) ** -0.5
    return {
        "z": scale * jax.random.normal(keys[0], (n_in + hidden, hidden)),
        "r": scale * jax.random.normal(keys[1], (n_in + hidden, hidden)),
        "h": scale * jax.random.normal(keys[2], (n_in + hidden, hidden)),
        "out": hidden**-0.5 * jax.random.normal(keys[3], (hidden, 1)),
    }


def _forward(w: dict[str, jax.Array], xs: jax.Array) -> jax.Array:
    def body(carry: Any, x: jax.Array) -> Any:
        h, acc = carry
        xh = jnp.concatenate([x, h], -1)
        z = jax.nn.sigmoid(xh @ w["z"])
        r = jax.nn.sigmoid(xh @ w["r"])
        c = jnp.tanh(jnp.concatenate([x, r * h], -1) @ w["h"])
        h = (1 - z) * h + z * c
        return (h, acc + jnp.sum(h @ w["out"])), None

    h0 = jnp.zeros((xs.shape[1], w["z"].shape[1]), xs.dtype)
    (_, acc), _ = jax.lax.scan(body, (h0, jnp.zeros((), xs.dtype)), xs)
    return acc


def _pp_prop(
    w: dict[str, jax.Array], xs: jax.Array, decay: float, chunk: int
) -> tuple[jax.Array, ...]:
    n_in = xs.shape[-1]

    def step(carry: Any, x: jax.Array) -> Any:
        h, xz, xc, fz, fc = carry
        xh = jnp.concatenate([x, h], -1)
        z = jax.nn.sigmoid(xh @ w["z"])
        r = jax.nn.sigmoid(xh @ w["r"])
        xrh = jnp.concatenate([x, r * h], -1)
        c = jnp.tanh(xrh @ w["h"])
        h_new = (1 - z) * h + z * c
        y = h_new @ w["out"]
        signal = (2 * y / y.size) @ w["out"].T  # ∂(mean squared y)/∂h
        d = 1 - z  # the GRU's diagonal transition (its r-route is an instantaneous weight)
        xz, xc = decay * xz + xh, decay * xc + xrh
        fz = d * fz + (c - h) * z * (1 - z)
        fc = d * fc + z * (1 - c**2)
        cot_r = ((signal * z * (1 - c**2)) @ w["h"].T)[:, n_in:] * h * r * (1 - r)
        rows = (xz, fz * signal, xc, fc * signal, xh, cot_r)
        return (h_new, xz, xc, fz, fc), rows

    def block(carry: Any, xk: jax.Array) -> Any:
        state, gz, gc, gr = carry
        state, (a1, b1, a2, b2, a3, b3) = jax.lax.scan(step, state, xk)

        def outer(u: jax.Array, v: jax.Array) -> jax.Array:
            return u.reshape(-1, u.shape[-1]).T @ v.reshape(-1, v.shape[-1])

        return (state, gz + outer(a1, b1), gc + outer(a2, b2), gr + outer(a3, b3)), None

    T, B = xs.shape[:2]
    H = w["z"].shape[1]
    zh = jnp.zeros((B, H), xs.dtype)
    zx = jnp.zeros((B, n_in + H), xs.dtype)
    zw = jnp.zeros((n_in + H, H), xs.dtype)
    blocks = xs.reshape(T // chunk, chunk, *xs.shape[1:])
    carry, _ = jax.lax.scan(block, ((zh, zx, zx, zh, zh), zw, zw, zw), blocks)
    return tuple(carry[1:])


def handwritten_times(
    hidden: int, batch: int, time_fn: Any, T: int = 64, n_in: int = 10
) -> tuple[float, float]:
    """Per-step times of the hand-written forward-only scan and pp-prop."""
    w = _weights(n_in, hidden)
    xs = jax.random.normal(jax.random.PRNGKey(1), (T, batch, n_in))
    fwd = jax.jit(_forward)
    pp = jax.jit(functools.partial(_pp_prop, decay=0.9, chunk=min(16, T)))
    t_fwd = time_fn(functools.partial(fwd, w, xs))
    t_pp = time_fn(functools.partial(pp, w, xs))
    return float(t_fwd / T), float(t_pp / T)
