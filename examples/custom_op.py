"""A user-defined weight op, end to end.

We define ``scaled_matmul``: ``y = s · (x @ W)`` with a fixed scale ``s`` (a
"fan-in scaled" dense layer), register it as an ETP primitive with the rules online
algorithms need, build a small leaky RNN around it, and train the RNN on a
running-sum task with D-RTRL and with pp-prop.

Run it with ``python examples/custom_op.py``.
"""

import math
from collections.abc import Mapping
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

import etrax

# --- 1. The op's implementation --------------------------------------------------
#
# `impl(*operands, **params)`: operands are arrays, params are hashable statics.
# etrax derives evaluation, lowering, JVP/VJP and batching from it.


# --8<-- [start:impl]
def scaled_matmul_impl(x: Array, w: Array, *, scale: float) -> Array:
    return scale * jnp.matmul(x, w)


# --8<-- [end:impl]


# --- 2. Its rules ------------------------------------------------------------------
#
# `x` may carry leading batch axes: x is (..., I), W is (I, O), y is (..., O).
# `cot` is ∂h/∂y for one hidden-state slot, shaped like y.


# --8<-- [start:rules]
def instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Mapping[str, Any]
) -> dict[str, Array]:
    """The instantaneous eligibility ∂h/∂W = s · x ⊗ cot, shaped (..., I, O)."""
    assert x is not None
    return {"weight": params["scale"] * x[..., :, None] * cot[..., None, :]}


def scale_rule(
    hvec: Array, trace: Mapping[str, Array], params: Mapping[str, Any]
) -> dict[str, Array]:
    """Multiply a weight-shaped trace by an output-shaped vector: W[i, o] feeds y[o]."""
    return {"weight": trace["weight"] * hvec[..., None, :]}


def trace_shapes(
    x: jax.ShapeDtypeStruct | None,
    y: jax.ShapeDtypeStruct,
    weights: Mapping[str, jax.ShapeDtypeStruct],
    params: Mapping[str, Any],
) -> dict[str, tuple[int, ...]]:
    """One state slot of the weight trace: the op's batch axes, then W's shape."""
    assert x is not None
    return {"weight": (*x.shape[:-1], *weights["weight"].shape)}


SCALED_MATMUL_RULES = etrax.ETPRules(
    instant=instant, scale=scale_rule, param_trace_shapes=trace_shapes
)


def check_rules(seed: int = 0) -> float:
    """Largest gap between the rules' weight gradient and `jax.vjp` of the op.

    Every op's rules must reproduce the op's own VJP: ``weight_grad(x, cot)``
    (``chain ∘ contract``, derived here from `instant` and `scale`) for a batch
    of inputs and output cotangents.
    """
    kx, kw, kc = jax.random.split(jax.random.PRNGKey(seed), 3)
    dtype = brainstate.environ.dftype()
    x = jax.random.normal(kx, (3, 4), dtype)
    w = jax.random.normal(kw, (4, 5), dtype)
    cot = jax.random.normal(kc, (3, 5), dtype)
    params = {"scale": 0.5}
    _, vjp = jax.vjp(lambda w: scaled_matmul_impl(x, w, scale=0.5), w)
    (expected,) = vjp(cot)
    got = SCALED_MATMUL_RULES.weight_grad(x, cot, {"weight": w}, params)["weight"]
    return float(jnp.max(jnp.abs(got - expected)))


# --8<-- [end:rules]


# --8<-- [start:register]
# `trainable` maps the trainable operands to their positions: W is operand 1;
# `x_index` says which operand is the data input.
scaled_matmul_p = etrax.register_primitive(
    "scaled_matmul",
    scaled_matmul_impl,
    trainable={"weight": 1},
    x_index=0,
    rules=SCALED_MATMUL_RULES,
)
# --8<-- [end:register]


# --- 3. A layer and a model that use it --------------------------------------------


# --8<-- [start:model]
class ScaledLinear(brainstate.nn.Module):
    """``y = x @ W / √n_in`` with ``W`` standard normal at initialisation."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(n_in)
        self.weight = brainstate.ParamState(
            brainstate.random.normal(size=(n_in, n_out)).astype(brainstate.environ.dftype())
        )

    def update(self, x: ArrayLike) -> Array:
        return etrax.ops.bind(scaled_matmul_p, x, self.weight.value, scale=self.scale)


class LeakyRNN(brainstate.nn.Module):
    """``h ← 0.8·h + 0.2·tanh(ScaledLinear([x, h]))``, read out by ``etrax.nn.Linear``."""

    def __init__(self, n_in: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.cell = ScaledLinear(n_in + hidden, hidden)
        self.readout = etrax.nn.Linear(hidden, 1)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.hidden,) if batch_size is None else (batch_size, self.hidden)
        self.h = brainstate.HiddenState(jnp.zeros(shape, brainstate.environ.dftype()))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.hidden,) if batch_size is None else (batch_size, self.hidden)
        self.h.value = jnp.zeros(shape, brainstate.environ.dftype())

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        h = 0.8 * h + 0.2 * jnp.tanh(self.cell(jnp.concatenate([jnp.asarray(x), h], axis=-1)))
        self.h.value = h
        y: Array = self.readout(h)
        return y


# --8<-- [end:model]


# --- 4. Train it online ----------------------------------------------------------


# --8<-- [start:train]
def running_sum_batch(key: Array, T: int, batch: int) -> tuple[Array, Array]:
    """Inputs ``x_t ~ N(0, 0.5²)``; the target is ``0.1 · Σ_{s≤t} x_s``."""
    x = 0.5 * jax.random.normal(key, (T, batch, 1), brainstate.environ.dftype())
    return x, 0.1 * jnp.cumsum(x, axis=0)


def mse(y: Array, target: Array) -> Array:
    return jnp.mean((y - target) ** 2)


def train(
    algorithm: etrax.OnlineAlgorithm[Any],
    *,
    iterations: int = 150,
    T: int = 40,
    batch: int = 16,
    hidden: int = 16,
    learning_rate: float = 0.05,
    seed: int = 0,
) -> list[float]:
    """Train a fresh `LeakyRNN` online; returns the mean loss of every iteration."""
    brainstate.random.seed(seed)
    model = LeakyRNN(1, hidden)
    learner = etrax.compile(
        model, algorithm, jnp.zeros((batch, 1), brainstate.environ.dftype()), batch_size=batch
    )
    # The custom op's weight is learned through eligibility traces, not dropped:
    rule = learner.weight_rules()[("cell", "weight")]
    assert rule.rule is etrax.WeightRule.TRACED, rule

    # Adam, written out to keep the example dependency-free (optax works too).
    params = learner.params
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    key = jax.random.PRNGKey(seed)
    losses = []
    for i in range(1, iterations + 1):
        key, sub = jax.random.split(key)
        xs, targets = running_sum_batch(sub, T, batch)
        learner.reset()  # fresh hidden states and traces for each sequence
        grads, step_losses = learner.etrace_grad(xs, targets, mse, return_value=True)
        m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        v = jax.tree.map(lambda a, g: 0.999 * a + 0.001 * g * g, v, grads)
        lr = learning_rate * math.sqrt(1 - 0.999**i) / (1 - 0.9**i)
        params = jax.tree.map(
            lambda p, a, b, lr=lr: p - lr * a / (jnp.sqrt(b) + 1e-8), params, m, v
        )
        learner.params = params
        losses.append(float(jnp.mean(step_losses)))
    return losses


# --8<-- [end:train]


def main() -> None:
    print(f"rules vs jax.vjp: max gap {check_rules():.1e}")
    rules: list[tuple[str, etrax.OnlineAlgorithm[Any]]] = [
        ("D-RTRL", etrax.DRTRL()),
        ("pp-prop", etrax.PPProp(decay=0.9)),
    ]
    for name, algorithm in rules:
        losses = train(algorithm)
        print(f"{name:8s} loss {losses[0]:.4f} -> {min(losses[-10:]):.4f}")


if __name__ == "__main__":
    main()
