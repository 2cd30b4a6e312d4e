"""A seeded generator of small brainstate models for property tests.

`generate(seed)` deterministically builds one initialised model: a stack of one
to three recurrent layers (`etrax.nn` cells, spiking neurons, or custom
multi-state neurons written directly on `etrax.matmul` / `etrax.element_wise`
and brainstate states), sometimes with a feed-forward layer between them or a
two-input first layer, and a readout; batched or not. Most seeds put one of the
structures that stress the compiler's per-use accounting into the stack:

- ``shared_bias``: one bias vector whose first slice feeds a gate that reaches
  hidden state only through another weight op and whose last slice feeds a
  directly traced op;
- ``tied_weight``: one weight used by a recurrent op and by a readout op;
- ``split_reach``: one op whose output reaches a hidden state element-wise and
  another hidden state of a different shape (through a slice or a sum);
- ``cross_shape``: hidden states of different shapes feeding each other within
  the step;
- ``reused_weight``: one weight used by two ops that feed two different hidden
  groups (one through the other's new value), or by two ops feeding groups of
  different shapes.

Weights come from a NumPy generator seeded by the seed (fast: no XLA compilation
per weight shape); brainstate's global generator is seeded too, for the few
initialisers inside `etrax.nn` layers that cannot be replaced.
"""

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

import etrax

__all__ = ["FAMILIES", "GeneratedCase", "generate"]

FAMILIES = ("shared_bias", "tied_weight", "split_reach", "cross_shape", "reused_weight")
"""The structure tags of the special families (every seed with a special layer gets
family ``FAMILIES[seed % 5]``, so the families are evenly spread)."""


@jax.custom_vjp
def _vjp_softplus(x: Array) -> Array:
    """``log(1 + eˣ)`` with its derivative given by `jax.custom_vjp`: ``σ(x)``."""
    return jnp.logaddexp(x, 0.0)


def _softplus_fwd(x: Array) -> tuple[Array, Array]:
    return _vjp_softplus(x), x


def _softplus_bwd(x: Array, g: Array) -> tuple[Array]:
    return (g * jax.nn.sigmoid(x),)


_vjp_softplus.defvjp(_softplus_fwd, _softplus_bwd)


@dataclass(frozen=True, eq=False)
class GeneratedCase:
    """One generated model.

    **Arguments:**

    - `seed`: the seed it was generated from.
    - `model`: the initialised model (states created, batched if `batched`).
    - `x`: an example input of one step: an array, or a tuple for several inputs.
    - `description`: the model's structure and sizes, for assertion messages.
    - `batched`: whether states and inputs carry a leading batch axis.
    - `tags`: the special structures the model contains (names from `FAMILIES`,
      plus ``plain_weight``, ``multi_input``, ``plain_brainstate`` (a brainstate
      cell with no etrax op) and ``fused_gates`` (gates cut from one plain matmul)
      where present).
    """

    seed: int
    model: brainstate.nn.Module
    x: Array | tuple[Array, ...]
    description: str
    batched: bool
    tags: frozenset[str]

    @property
    def args(self) -> tuple[Array, ...]:
        """The example input as the positional arguments of ``model.update``."""
        return self.x if isinstance(self.x, tuple) else (self.x,)


def _dtype() -> Any:
    return brainstate.environ.dftype()


class Normal:
    """A weight initialiser drawing from a NumPy generator: ``scale / sqrt(fan_in)``
    (or `scale` for vectors) times a standard normal."""

    def __init__(self, rng: np.random.Generator, scale: float) -> None:
        self.rng = rng
        self.scale = scale

    def __call__(self, shape: tuple[int, ...] | int, **kwargs: object) -> Array:
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        std = self.scale / math.sqrt(size[0]) if len(size) > 1 else self.scale
        values = np.asarray(std * self.rng.standard_normal(size), dtype=_dtype())
        placed: Array = jax.device_put(values)  # jnp.asarray would compile per shape
        return placed


class Zeros:
    """A zero initialiser built in NumPy: unlike brainstate's own initialisers, it
    compiles no XLA program for each new shape (model building stays cheap)."""

    def __call__(self, shape: tuple[int, ...] | int, **kwargs: object) -> Array:
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        placed: Array = jax.device_put(np.zeros(size, dtype=_dtype()))
        return placed


def _param(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> Array:
    return Normal(rng, scale)(shape)


def _linear(rng: np.random.Generator, n_in: int, n: int, bias: bool = True) -> etrax.nn.Linear:
    return etrax.nn.Linear(
        n_in, n, w_init=Normal(rng, 1.0), b_init=Normal(rng, 0.3) if bias else None
    )


def _zeros(shape: tuple[int, ...], batch: int | None) -> Array:
    return Zeros()(shape if batch is None else (batch, *shape))


def _sigmoid(w: Array) -> Array:
    return jax.nn.sigmoid(w)


class Layer(brainstate.nn.Module):
    """A generated layer: a module that records its output width `n_out`."""

    n_out: int


# --- custom neurons ---------------------------------------------------------------
# Each takes ``(n_in, n, rng, variant)``; `variant` (0–7) picks among small variations.


class LeakyTanh(Layer):
    """``h ← α ⊙ h + tanh(x W + b)`` with a fixed per-unit leak; odd variants also
    output the op's value ``x W + b`` directly (it reaches ``h`` and the output);
    variants 4–7 also keep the new ``h`` in a second hidden state ``m`` (one value,
    two states) that the next step reads: ``h ← α ⊙ h + 0.2 m + tanh(x W + b)``."""

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.n_out = n
        self.direct = variant % 2 == 1
        self.mirror = variant >= 4
        self.fc = _linear(rng, n_in, n)
        self.alpha = jnp.asarray(np.linspace(0.3, 0.75, n), dtype=_dtype())

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(_zeros((self.n,), batch_size))
        if self.mirror:
            self.m = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def update(self, x: ArrayLike) -> Array:
        pre = self.fc(x)
        h = self.alpha * self.h.value + jnp.tanh(pre)
        if self.mirror:
            h = h + 0.2 * self.m.value
            self.m.value = h
        self.h.value = h
        return h + 0.1 * pre if self.direct else h


class Adaptive(Layer):
    """``V ← 0.9 V − 0.2 a + x W``; ``a ← 0.8 a + 0.3 tanh(V)`` (new or old ``V``)."""

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.n_out = n
        self.new_v = variant % 2 == 0
        self.fc = _linear(rng, n_in, n, bias=variant % 4 < 2)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.V = brainstate.HiddenState(_zeros((self.n,), batch_size))
        self.a = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def update(self, x: ArrayLike) -> Array:
        v_old = self.V.value
        v = 0.9 * v_old - 0.2 * self.a.value + self.fc(x)
        a = 0.8 * self.a.value + 0.3 * jnp.tanh(v if self.new_v else v_old)
        self.V.value = v
        self.a.value = a
        return jnp.tanh(v) * (1.0 + 0.1 * a)


class LearnedDecay(Layer):
    """``h ← σ(τ) ⊙ h + tanh(x W + b)`` with a learnable decay: per unit through
    `element_wise` (the sigmoid inside the op or after it) in variants 0–3; in plain
    JAX, which the compiler reads as an element-wise op, in variants 4–7 (per unit in
    even ones, one scalar for every unit in odd ones); variants 2, 3, 6, 7 also read
    ``τ`` in plain JAX for the output ``h ⊙ τ`` (variant 5 leaves the per-unit ``τ``
    unread: reported as unused, and left out of the gradients)."""

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.n_out = n
        self.inside = variant % 2 == 0
        self.plain_out = (variant // 2) % 2 == 1
        self.plain = variant >= 4
        self.fc = _linear(rng, n_in, n)
        self.tau = brainstate.ParamState(_param(rng, (n,)))
        if self.plain and not self.inside:
            self.tau_scalar = brainstate.ParamState(_param(rng, ()))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def update(self, x: ArrayLike) -> Array:
        if self.plain:
            decay = jax.nn.sigmoid(self.tau.value if self.inside else self.tau_scalar.value)
        elif self.inside:
            decay = etrax.element_wise(self.tau.value, weight_fn=_sigmoid)
        else:
            decay = jax.nn.sigmoid(etrax.element_wise(self.tau.value))
        h = decay * self.h.value + jnp.tanh(self.fc(x))
        self.h.value = h
        return h * self.tau.value if self.plain_out else h


class PlainWeights(Layer):
    """Plain-JAX weight uses: ``h ← 0.5 h + tanh(x @ W_p + matmul(x, W) [+ h @ U])``.

    Variants 5 and 7 of width 4 write the recurrent product per head: two heads of two
    units, with ``U``'s diagonal blocks as their weights, each head's output merged
    back into the flat state right after the product (``einsum('...gi,gio->...go',
    h.reshape(..., 2, 2), blocks).reshape(..., 4)``).
    """

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.n_out = n
        self.recurrent = variant % 2 == 1
        self.headed = variant in (5, 7) and n == 4
        self.w_plain = brainstate.ParamState(_param(rng, (n_in, n)))
        self.w = brainstate.ParamState(_param(rng, (n_in, n)))
        self.u = brainstate.ParamState(_param(rng, (n, n)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        pre = x @ self.w_plain.value + etrax.matmul(x, self.w.value)
        if self.headed:
            u = self.u.value
            blocks = jnp.stack([u[:2, :2], u[2:, 2:]])  # (heads, in, out)
            lead = h.shape[:-1]
            heads = jnp.einsum("...gi,gio->...go", h.reshape(*lead, 2, 2), blocks)
            pre = pre + heads.reshape(*lead, 4)
        elif self.recurrent:
            pre = pre + h @ self.u.value
        new = 0.5 * h + jnp.tanh(pre)
        self.h.value = new
        return new


class SharedBias(Layer):
    """One bias ``b`` (2n,): ``b[:n]`` feeds a reset-like gate that reaches ``h`` only
    through the weight ``U``; ``b[n:]`` feeds a directly traced input op.

    ``r = σ(x W_r + b[:n])``; ``c = tanh((r ⊙ h) U)``, or ``tanh((r ⊙ x) U)``, or
    ``tanh(x U) ⊙ r``; ``z = x W_z + b[n:]``; then a GRU-style or additive update of
    ``h``. Variants pass the slices as the ops' bias operand or add them in plain JAX.
    """

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.n_out = n
        self.bias_in_op = variant % 2 == 0
        self.gru_style = (variant // 2) % 2 == 0
        self.gate_on_input = (variant // 4) % 2 == 1
        self.gate_x = self.gate_on_input and n_in == n
        self.wr = brainstate.ParamState(_param(rng, (n_in, n)))
        self.wz = brainstate.ParamState(_param(rng, (n_in, n)))
        self.u = brainstate.ParamState(_param(rng, (n_in, n) if self.gate_on_input else (n, n)))
        self.b = brainstate.ParamState(_param(rng, (2 * n,)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        n = self.n
        b = self.b.value
        h = self.h.value
        if self.bias_in_op:
            r = jax.nn.sigmoid(etrax.matmul(x, self.wr.value, b[:n]))
            z_pre = etrax.matmul(x, self.wz.value, b[n:])
        else:
            r = jax.nn.sigmoid(etrax.matmul(x, self.wr.value) + b[:n])
            z_pre = etrax.matmul(x, self.wz.value) + b[n:]
        if self.gate_x:
            c = jnp.tanh(etrax.matmul(r * x, self.u.value))
        elif self.gate_on_input:
            c = jnp.tanh(etrax.matmul(x, self.u.value)) * r
        else:
            c = jnp.tanh(etrax.matmul(r * h, self.u.value))
        if self.gru_style:
            z = jax.nn.sigmoid(z_pre)
            new = (1.0 - z) * h + z * c
        else:
            new = 0.6 * h + jnp.tanh(z_pre) + c
        self.h.value = new
        return new


class TiedWeight(Layer):
    """A square weight ``W`` used by the recurrent op and by a readout op.

    ``h ← 0.7 h + tanh(x W)`` (when the input width is ``n``) or
    ``h ← 0.7 h + tanh(h W + x W_in)``; then ``y = h W`` as an ETP op or in plain JAX,
    returned alone or concatenated with ``h``.
    """

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.recurrent = variant % 2 == 1 or n_in != n
        self.plain_readout = (variant // 2) % 2 == 1
        self.concat = (variant // 4) % 2 == 1
        self.w = brainstate.ParamState(_param(rng, (n, n)))
        self.w_in = brainstate.ParamState(_param(rng, (n_in, n)))
        self.n_out = 2 * n if self.concat else n

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        if self.recurrent:
            pre = etrax.matmul(h, self.w.value) + etrax.matmul(x, self.w_in.value)
        else:
            pre = etrax.matmul(x, self.w.value)
        new = 0.7 * h + jnp.tanh(pre)
        self.h.value = new
        y = new @ self.w.value if self.plain_readout else etrax.matmul(new, self.w.value)
        return jnp.concatenate([y, new], axis=-1) if self.concat else y


class SplitReach(Layer):
    """One op output ``y = x W + b`` reaches ``h1 (n,)`` element-wise and ``h2`` of
    another shape: ``h2 (k,) ← 0.8 h2 + tanh(y[:k])`` (``k`` up to ``n``: the same
    shape too) or ``h2 () ← 0.8 h2 + 0.3 Σ y``."""

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.use_sum = variant % 2 == 1
        self.k = 1 if self.use_sum else max(1, n - (variant // 2) % 3)
        self.fc = _linear(rng, n_in, n)
        self.n_out = n if self.use_sum else n + self.k

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h1 = brainstate.HiddenState(_zeros((self.n,), batch_size))
        self.h2 = brainstate.HiddenState(_zeros(() if self.use_sum else (self.k,), batch_size))

    def update(self, x: ArrayLike) -> Array:
        y = self.fc(x)
        h1 = 0.9 * self.h1.value + y
        if self.use_sum:
            h2 = 0.8 * self.h2.value + 0.3 * jnp.sum(y, axis=-1)
            out = jnp.tanh(h1) * (1.0 + 0.1 * h2[..., None])
        else:
            h2 = 0.8 * self.h2.value + jnp.tanh(y[..., : self.k])
            out = jnp.concatenate([jnp.tanh(h1), h2], axis=-1)
        self.h1.value = h1
        self.h2.value = h2
        return out


class CrossShape(Layer):
    """Hidden states of different shapes feeding each other within one step.

    Global inhibition (variants 0–3), ``v (n,)`` and ``c ()``:
    ``c ← 0.8 c + 0.2 Σ v`` and ``v ← 0.9 v + x W − c`` (old or new ``v`` / ``c``).
    Sliced chain (variants 4–7), ``a (n,)`` and ``b (n−1,)``:
    ``a ← 0.9 a + x W [− 0.1 pad(b)]`` and ``b ← 0.8 b + tanh(a[:n−1])``.
    """

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = max(n, 2)
        self.sliced = variant >= 4
        self.c_first = variant % 2 == 1
        self.feedback = (variant // 2) % 2 == 1
        self.fc = _linear(rng, n_in, self.n)
        self.m = self.n - 1
        self.n_out = self.n + self.m if self.sliced else self.n

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.v = brainstate.HiddenState(_zeros((self.n,), batch_size))
        self.c = brainstate.HiddenState(_zeros((self.m,) if self.sliced else (), batch_size))

    def update(self, x: ArrayLike) -> Array:
        drive = self.fc(x)
        v_old, c_old = self.v.value, self.c.value
        if self.sliced:
            v = 0.9 * v_old + drive
            if self.feedback:
                pad = [(0, 0)] * (c_old.ndim - 1) + [(0, 1)]
                v = v - 0.1 * jnp.pad(c_old, pad)
            c = 0.8 * c_old + jnp.tanh((v_old if self.c_first else v)[..., : self.m])
            out = jnp.concatenate([jnp.tanh(v), c], axis=-1)
        elif self.c_first:
            c = 0.8 * c_old + 0.2 * jnp.sum(v_old, axis=-1)
            v = 0.9 * v_old + drive - (c if self.feedback else c_old)[..., None]
            out = jnp.tanh(v)
        else:
            v = 0.9 * v_old + drive - c_old[..., None]
            c = 0.8 * c_old + 0.2 * jnp.sum(v if self.feedback else v_old, axis=-1)
            out = jnp.tanh(v) + 0.1 * c[..., None]
        self.v.value = v
        self.c.value = c
        return out


class ReusedWeight(Layer):
    """One square weight ``W`` in two ops feeding two hidden groups.

    Chained (even variants): ``h1 ← 0.9 h1 + (x W_in) W``, ``h2 ← 0.5 h2 + tanh(h1 W)``
    (``h1`` new), so ``W``'s first use also reaches ``h2`` through its second use.
    Parallel (odd variants): ``h1 ← 0.9 h1 + (x W_in) W`` and a global
    ``g () ← 0.8 g + 0.3 Σ tanh(−(x W_in) W)`` of another shape. Variants 2, 3, 6, 7
    keep ``h1`` as a `brainstate.HiddenGroupState` ``(n, 2)`` with an adaptation.
    """

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.chained = variant % 2 == 0
        self.grouped = (variant // 2) % 2 == 1
        self.fc = _linear(rng, n_in, n)
        self.w = brainstate.ParamState(_param(rng, (n, n)))
        self.n_out = n

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h1: brainstate.HiddenState[Array]
        if self.grouped:
            self.h1 = brainstate.HiddenGroupState(_zeros((self.n, 2), batch_size))
        else:
            self.h1 = brainstate.HiddenState(_zeros((self.n,), batch_size))
        self.h2 = brainstate.HiddenState(_zeros((self.n,) if self.chained else (), batch_size))

    def update(self, x: ArrayLike) -> Array:
        u = self.fc(x)
        w = self.w.value
        drive = etrax.matmul(u, w)
        if self.grouped:
            st = self.h1.value
            v_old, a_old = st[..., 0], st[..., 1]
            v = 0.9 * v_old - 0.2 * a_old + drive
            a = 0.8 * a_old + 0.3 * jnp.tanh(v)
            self.h1.value = jnp.stack([v, a], axis=-1)
        else:
            v = 0.9 * self.h1.value + drive
            self.h1.value = v
        if self.chained:
            h2 = 0.5 * self.h2.value + jnp.tanh(etrax.matmul(v, w))
            out = h2
        else:
            h2 = 0.8 * self.h2.value + 0.3 * jnp.sum(jnp.tanh(etrax.matmul(-u, w)), axis=-1)
            out = jnp.tanh(v) + 0.1 * h2[..., None]
        self.h2.value = h2
        return out


class TwoInputs(Layer):
    """``h ← 0.5 h + tanh(x₁ W₁ + b + x₂ W₂)``: a first layer taking two inputs."""

    def __init__(self, n_in: int, n_in2: int, n: int, rng: np.random.Generator) -> None:
        super().__init__()
        self.n = n
        self.n_out = n
        self.fc1 = _linear(rng, n_in, n)
        self.fc2 = _linear(rng, n_in2, n, bias=False)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def update(self, x1: ArrayLike, x2: ArrayLike) -> Array:
        new = 0.5 * self.h.value + jnp.tanh(self.fc1(x1) + self.fc2(x2))
        self.h.value = new
        return new


class Spiking(Layer):
    """``Linear → LIF`` or ``Linear → ALIF`` (spikes out)."""

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n_out = n
        self.fc = etrax.nn.Linear(n_in, n, w_init=Normal(rng, 4.0), b_init=None)
        self.neu: brainstate.nn.Module = (
            etrax.nn.ALIF(n, tau=10.0, tau_a=50.0, beta=0.5)
            if variant % 2
            else etrax.nn.LIF(n, tau=10.0, detach_reset=(variant // 2) % 2 == 1)
        )

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.neu(self.fc(x))
        return out


class Cell(Layer):
    """An `etrax.nn` recurrent cell (or LRU, or leaky rate readout) by name."""

    def __init__(self, kind: str, n_in: int, n: int, rng: np.random.Generator) -> None:
        super().__init__()
        w = Normal(rng, 1.0)
        bias = Normal(rng, 0.3)
        zeros = Zeros()
        seed = int(rng.integers(1 << 30))
        self.n_out = n
        cell: brainstate.nn.Module
        if kind == "GRUCell":
            cell = etrax.nn.GRUCell(n_in, n, w_init=w, b_init=bias, state_init=zeros)
        elif kind == "LSTMCell":
            cell = etrax.nn.LSTMCell(n_in, n, w_init=w, b_init=bias, state_init=zeros)
        elif kind == "MGUCell":
            cell = etrax.nn.MGUCell(n_in, n, w_init=w, b_init=bias, state_init=zeros)
        elif kind == "MiniGRU":
            cell = etrax.nn.MiniGRU(n_in, n, w_init=w, b_init=bias, state_init=zeros)
        elif kind == "VanillaRNNCell":
            cell = etrax.nn.VanillaRNNCell(
                n_in, n, activation="tanh", w_init=w, b_init=bias, state_init=zeros
            )
        elif kind == "MiniLSTM":
            cell = etrax.nn.MiniLSTM(n_in, n, w_init=w, b_init=bias, state_init=zeros)
        elif kind == "MinimalRNNCell":
            cell = etrax.nn.MinimalRNNCell(n_in, n, w_init=w, b_init=bias, state_init=zeros)
        elif kind == "CFNCell":
            cell = etrax.nn.CFNCell(n_in, n, w_init=w, b_init=bias, state_init=zeros)
        elif kind == "URLSTMCell":
            cell = etrax.nn.URLSTMCell(n_in, n, w_init=w, seed=seed)
        elif kind == "LRUCell":
            cell = etrax.nn.LRUCell(n_in, n, r_min=0.4, r_max=0.9, seed=seed)
            self.n_out = n_in
        elif kind == "LeakyRateReadout":
            cell = etrax.nn.LeakyRateReadout(n_in, n, w_init=w)
        elif kind.startswith("bs."):  # a plain brainstate cell: no etrax op at all
            same = Normal(rng, 1.0)
            cell = getattr(brainstate.nn, kind[3:])(
                n_in, n, w_init=same, b_init=same, state_init=zeros
            )
        else:
            raise ValueError(f"unknown cell kind {kind!r}")
        self.cell = cell

    def update(self, x: ArrayLike) -> Array:
        out: Array = self.cell(x)
        return out


class FusedGates(Layer):
    """Gates computed by one plain matmul and cut apart, as people write them.

    Even variants: a GRU with ``x @ Wx + b`` and ``h @ Wh`` each split in three;
    odd variants: an LSTM with one ``[x; h] @ W + b`` split in four (two states).
    ``variant // 2`` picks how the product is spelled (``@``, ``jnp.einsum``,
    ``jnp.dot`` with the weight stored transposed). Variants 6 and 7 cut the gates
    after a sum of products: an LSTM ``split(x @ Wx + h @ Wh + b, 4)``, and a GRU-like
    cell with ``split((x @ Wx + h @ Wh + b) * g, 3)`` (a learned gain after the sum).
    In about half the layers (drawn from `rng`), the value cut is also used whole: a
    small sum of it over the features joins the new ``h`` (which mixes positions).
    Variants 6 and 7 take one step or, in about half the layers, two sub-steps of a
    ``fori_loop`` that each cut ``gx + h @ Wh`` into the gates, with ``gx = x @ Wx + b``
    computed once before the loop. The other LSTMs, in about half the layers, take
    their three sigmoid gates as ``split(sigmoid(fused[..., :3n]), 3)``: a part cut
    again after a first cut. The one-step GRUs spelled with ``jnp.einsum`` (variant 2)
    or ``jnp.dot`` (variant 4) whose cut value is not used whole take an activation
    before the cut: ``split(relu(x @ Wx + b), 3)`` (`jax.nn.relu`, a ``custom_jvp``
    call), or a softplus written with ``jax.custom_vjp`` (`_vjp_softplus`, which the
    compiler makes a ``custom_jvp`` call of its transposed backward rule) (decided
    from the draws above, so the other layers are as they were). The one-step
    GRUs spelled with ``@`` (variant 0) add ``concatenate([h] * 3) * Wh[0]`` to
    ``h @ Wh`` before its cut: gates on the state joined to itself, with a row of
    ``Wh`` as one recurrent weight per unit and gate.
    """

    def __init__(self, n_in: int, n: int, rng: np.random.Generator, variant: int) -> None:
        super().__init__()
        self.n = n
        self.n_out = n
        self.lstm = variant % 2 == 1
        self.summed = variant >= 6
        self.spelling = (variant // 2) % 3
        k = 4 if self.lstm else 3
        fan_in = n_in + n if self.lstm and not self.summed else n_in
        shape = (k * n, fan_in) if self.spelling == 2 else (fan_in, k * n)
        self.wx = brainstate.ParamState(_param(rng, shape))
        self.wh = brainstate.ParamState(_param(rng, (n, k * n if self.summed else 3 * n)))
        self.b = brainstate.ParamState(_param(rng, (k * n,), 0.3))
        if self.summed and not self.lstm:
            self.g = brainstate.ParamState(1.0 + _param(rng, (k * n,), 0.2))
        self.whole = bool(rng.integers(2))
        self.sub_steps = int(rng.integers(1, 3)) if self.summed else 1
        self.nested = bool(rng.integers(2)) if self.lstm and not self.summed else False
        self.activated = not (self.lstm or self.summed or self.whole) and self.spelling > 0
        self.joined = not (self.lstm or self.summed) and self.spelling == 0

    def _whole(self, fused: Array) -> Array | float:
        """What the value cut adds to the new ``h`` when it is also used whole."""
        return 0.01 * jnp.sum(fused, axis=-1, keepdims=True) if self.whole else 0.0

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(_zeros((self.n,), batch_size))
        if self.lstm:
            self.c = brainstate.HiddenState(_zeros((self.n,), batch_size))

    def _product(self, x: Array) -> Array:
        w = self.wx.value
        if self.spelling == 1:
            out: Array = jnp.einsum("...i,io->...o", x, w)
        elif self.spelling == 2:
            out = jnp.dot(x, w.T)
        else:
            out = x @ w
        return out

    def _summed(self, gx: Array, h: Array, c: Array, bias: bool) -> tuple[Array, Array]:
        """One (sub-)step of variants 6 and 7 from ``gx = x @ Wx`` (``+ b`` after the sum
        with `bias`, or already in `gx`): the new ``h`` and ``c`` (a GRU-like cell
        passes its ``c`` through)."""
        pre = gx + h @ self.wh.value + self.b.value if bias else gx + h @ self.wh.value
        if self.lstm:
            i, f, o, g = jnp.split(pre, 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            return jax.nn.sigmoid(o) * jnp.tanh(c) + self._whole(pre), c
        gained = pre * self.g.value
        r, z, cand = jnp.split(gained, 3, axis=-1)
        z = jax.nn.sigmoid(z)
        return (1.0 - z) * jnp.tanh(cand) + z * jax.nn.sigmoid(r) * h + self._whole(gained), c

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        if self.summed:
            c = self.c.value if self.lstm else h
            if self.sub_steps == 1:
                new, c = self._summed(self._product(x), h, c, bias=True)
            else:
                gx = self._product(x) + self.b.value

                def sub_step(_: Array, hc: tuple[Array, Array]) -> tuple[Array, Array]:
                    return self._summed(gx, *hc, bias=False)

                new, c = jax.lax.fori_loop(0, self.sub_steps, sub_step, (h, c))
            if self.lstm:
                self.c.value = c
        elif self.lstm:
            xh = jnp.concatenate([x, h], axis=-1)
            fused = self._product(xh) + self.b.value
            if self.nested:  # the three sigmoid gates cut again after a first cut
                n = self.n
                si, sf, so = jnp.split(jax.nn.sigmoid(fused[..., : 3 * n]), 3, axis=-1)
                c = sf * self.c.value + si * jnp.tanh(fused[..., 3 * n :])
                new = so * jnp.tanh(c) + self._whole(fused)
            else:
                i, f, o, g = jnp.split(fused, 4, axis=-1)
                c = jax.nn.sigmoid(f) * self.c.value + jax.nn.sigmoid(i) * jnp.tanh(g)
                new = jax.nn.sigmoid(o) * jnp.tanh(c) + self._whole(fused)
            self.c.value = c
        else:
            fused = self._product(x) + self.b.value
            if self.activated:  # a custom_jvp / custom_vjp call before the cut
                fused = (jax.nn.relu if self.spelling == 1 else _vjp_softplus)(fused)
            xr, xz, xn = jnp.split(fused, 3, axis=-1)
            recurrent = h @ self.wh.value
            if self.joined:  # gates on the state joined to itself
                recurrent = recurrent + jnp.concatenate([h] * 3, axis=-1) * self.wh.value[0]
            hr, hz, hn = jnp.split(recurrent, 3, axis=-1)
            r = jax.nn.sigmoid(xr + hr)
            z = jax.nn.sigmoid(xz + hz)
            new = (1.0 - z) * jnp.tanh(xn + r * hn) + z * h + self._whole(fused)
        self.h.value = new
        return new


class FeedForward(Layer):
    """``tanh(x W + b)``: a layer with no hidden state between two recurrent ones."""

    def __init__(self, n_in: int, n: int, rng: np.random.Generator) -> None:
        super().__init__()
        self.n_out = n
        self.fc = _linear(rng, n_in, n)

    def update(self, x: ArrayLike) -> Array:
        return jnp.tanh(self.fc(x))


CELLS = (
    "GRUCell",
    "LSTMCell",
    "MGUCell",
    "MiniGRU",
    "VanillaRNNCell",
    "MiniLSTM",
    "MinimalRNNCell",
    "CFNCell",
    "URLSTMCell",
    "LRUCell",
    "LeakyRateReadout",
    "bs.GRUCell",
    "bs.LSTMCell",
    "bs.MGUCell",
    "bs.ValinaRNNCell",
)

_Make = Callable[[int, int, np.random.Generator, int], Layer]
CUSTOM: dict[str, _Make] = {
    "LeakyTanh": LeakyTanh,
    "Adaptive": Adaptive,
    "LearnedDecay": LearnedDecay,
    "PlainWeights": PlainWeights,
    "Spiking": Spiking,
    "FusedGates": FusedGates,
}
SPECIAL: dict[str, _Make] = {
    "shared_bias": SharedBias,
    "tied_weight": TiedWeight,
    "split_reach": SplitReach,
    "cross_shape": CrossShape,
    "reused_weight": ReusedWeight,
}
READOUTS = ("none", "linear", "linear", "plain", "tuple", "mean")
SIZES = (3, 4)
"""Layer widths. Few distinct shapes keep the test fast (it runs eagerly, and every
new operand shape costs one XLA compilation per primitive); none equals the batch
size 2, so a batch axis confused with a feature axis shows. Derived widths (slices,
concatenations, a global scalar state) add 1, 2, 6, 7 and 8."""


class Stack(brainstate.nn.Module):
    """An optional first layer, layers applied in order, then a readout.

    `readout` is ``"none"``, ``"linear"`` (`etrax.nn.Linear`), ``"plain"`` (``h @ W``),
    ``"tuple"`` (``(Linear(h), h)``: a pytree output) or ``"mean"`` (no weight).
    """

    def __init__(
        self,
        first: Layer | None,
        layers: list[Layer],
        readout: str,
        n_last: int,
        n_y: int,
        rng: np.random.Generator,
    ) -> None:
        super().__init__()
        self.first = first
        self.num_layers = len(layers)
        for i, layer in enumerate(layers):
            setattr(self, f"layer{i}", layer)
        self.readout_kind = readout
        if readout in ("linear", "tuple"):
            self.out = _linear(rng, n_last, n_y)
        elif readout == "plain":
            self.w_out = brainstate.ParamState(_param(rng, (n_last, n_y)))

    def update(self, *xs: ArrayLike) -> Any:
        h: Array = self.first(*xs) if self.first is not None else jnp.asarray(xs[0])
        for i in range(self.num_layers):
            h = getattr(self, f"layer{i}")(h)
        if self.readout_kind == "linear":
            return self.out(h)
        if self.readout_kind == "plain":
            return h @ self.w_out.value
        if self.readout_kind == "tuple":
            return self.out(h), h
        if self.readout_kind == "mean":
            return jnp.mean(h, axis=-1)
        return h


def generate(seed: int) -> GeneratedCase:
    """Build the model of `seed`: initialised, with an example input.

    The same seed always gives the same structure, sizes, weights and input.
    """
    choose = random.Random(seed)
    rng = np.random.default_rng(seed)
    brainstate.random.seed(seed)

    batch = choose.choice([None, 2])
    n_in = 3
    tags: set[str] = set()
    parts: list[str] = []

    first: Layer | None = None
    width = n_in
    in_widths = [n_in]
    if choose.random() < 0.12:
        n_in2 = 2
        n = choose.choice(SIZES)
        first = TwoInputs(n_in, n_in2, n, rng)
        in_widths.append(n_in2)
        width = n
        tags.add("multi_input")
        parts.append(f"TwoInputs({n_in}+{n_in2}→{n})")

    special = FAMILIES[seed % len(FAMILIES)] if choose.random() < 0.8 else None
    num_layers = choose.choice([1, 1, 2, 2, 3]) if first is None else choose.choice([1, 2])
    special_at = choose.randrange(num_layers)
    layers: list[Layer] = []
    for i in range(num_layers):
        n = choose.choice(SIZES)
        variant = choose.randrange(8)
        layer: Layer
        if special is not None and i == special_at:
            if special == "tied_weight" and variant % 2 == 0 and width <= 5:
                n = width
            layer = SPECIAL[special](width, n, rng, variant)
            tags.add(special)
            label = f"{type(layer).__name__}[v{variant}]"
        else:
            name = choose.choice([*CELLS, *CUSTOM])
            if name in CELLS:
                layer = Cell(name, width, n, rng)
                label = name
                if name.startswith("bs."):
                    tags.add("plain_brainstate")
            else:
                layer = CUSTOM[name](width, n, rng, variant)
                label = f"{name}[v{variant}]"
                if name == "PlainWeights":
                    tags.add("plain_weight")
                if name == "FusedGates":
                    tags.add("fused_gates")
        parts.append(f"{label}({width}→{layer.n_out})")
        layers.append(layer)
        width = layer.n_out
        if i + 1 < num_layers and choose.random() < 0.15:
            n_ff = choose.choice(SIZES)
            layers.append(FeedForward(width, n_ff, rng))
            parts.append(f"FeedForward({width}→{n_ff})")
            width = n_ff

    readout = choose.choice(READOUTS)
    n_y = 2
    if readout == "plain":
        tags.add("plain_weight")
    model = Stack(first, layers, readout, width, n_y, rng)
    brainstate.nn.init_all_states(model, batch_size=batch)

    args = tuple(
        jnp.asarray(rng.standard_normal((m,) if batch is None else (batch, m)), dtype=_dtype())
        for m in in_widths
    )
    x: Array | tuple[Array, ...] = args if len(args) > 1 else args[0]
    sizes = f"({width}→{n_y})" if readout in ("linear", "plain", "tuple") else ""
    desc = (
        f"seed={seed} batch={batch} in={'+'.join(map(str, in_widths))} "
        f"[{', '.join(parts)}] readout={readout}{sizes}"
    )
    return GeneratedCase(seed, model, x, desc, batch is not None, frozenset(tags))
