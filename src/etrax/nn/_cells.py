"""More recurrent cells: MiniLSTM, MinimalRNN, CFN, UR-LSTM and LRU."""

import math

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from ..ops import element_wise
from ._common import Initializer, init_param, positive_int
from ._linear import Linear
from ._rnn import _Cell

__all__ = ["CFNCell", "LRUCell", "MiniLSTM", "MinimalRNNCell", "URLSTMCell"]


class MiniLSTM(_Cell):
    r"""Minimal LSTM: ``h ← σ(W_f [x; h]) ⊙ h + σ(W_i [x; h]) ⊙ W_x x``.

    The state's update is element-wise given the gates, so every weight is traced
    (``W_f``, ``W_i`` also through ``h``'s own Jacobian); the gates read ``h`` through
    their weights, so over several steps D-RTRL is the diagonal approximation.

    **Arguments:** `num_in`, `num_out` (input and state sizes); `w_init`, `b_init`
    (weight and bias initialisers; default Xavier normal and zeros); `state_init`
    (initial state; default zeros).
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        state_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        if w_init is None:
            w_init = brainstate.nn.init.XavierNormal()
        self.W_x = Linear(num_in, num_out, w_init=w_init, b_init=b_init)
        self.W_f = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)
        self.W_i = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        xh = jnp.concatenate([x, h], axis=-1)
        new = jax.nn.sigmoid(self.W_f(xh)) * h + jax.nn.sigmoid(self.W_i(xh)) * self.W_x(x)
        self.h.value = new
        return new


class MinimalRNNCell(_Cell):
    r"""Minimal RNN: ``z = tanh(Φ x)``, ``u = σ(W_u [z; h])``, ``h ← u ⊙ h + (1 − u) ⊙ z``.

    ``Φ`` reaches ``h`` directly and through ``W_u``; only the direct path is traced
    (reported as a partial path in the compilation diagnostics).

    **Arguments:** `num_in`, `num_out` (input and state sizes); `w_init`, `b_init`
    (weight and bias initialisers; default Xavier normal and zeros); `state_init`
    (initial state; default zeros).
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        state_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        if w_init is None:
            w_init = brainstate.nn.init.XavierNormal()
        self.phi = Linear(num_in, num_out, w_init=w_init, b_init=b_init)
        self.W_u = Linear(2 * num_out, num_out, w_init=w_init, b_init=b_init)

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        z = jnp.tanh(self.phi(jnp.asarray(x)))
        u = jax.nn.sigmoid(self.W_u(jnp.concatenate([z, h], axis=-1)))
        new = u * h + (1.0 - u) * z
        self.h.value = new
        return new


class CFNCell(_Cell):
    r"""Chaos-free network: ``h ← σ(W_f [x; h]) ⊙ tanh(h) + σ(W_i [x; h]) ⊙ tanh(W_h x)``.

    **Arguments:** `num_in`, `num_out` (input and state sizes); `w_init`, `b_init`
    (weight and bias initialisers; default Xavier normal and zeros); `state_init`
    (initial state; default zeros).
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        state_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        if w_init is None:
            w_init = brainstate.nn.init.XavierNormal()
        self.Wf = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)
        self.Wi = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)
        self.Wh = Linear(num_in, num_out, w_init=w_init, b_init=b_init)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        xh = jnp.concatenate([x, h], axis=-1)
        new = jax.nn.sigmoid(self.Wf(xh)) * jnp.tanh(h) + jax.nn.sigmoid(self.Wi(xh)) * jnp.tanh(
            self.Wh(x)
        )
        self.h.value = new
        return new


class URLSTMCell(_Cell):
    r"""LSTM with a uniformly initialised forget-gate bias and a refine gate.

    ``f̃ = σ(f + b)``, ``r̃ = σ(r − b)``, ``g = r̃ (1 − (1 − f̃)²) + (1 − r̃) f̃²``,
    ``c ← g ⊙ c + (1 − g) ⊙ tanh(u)``, ``h ← σ(o) ⊙ tanh(c)``, where
    ``u, f, r, o = W_{u,f,r,o} [x; h]`` (no bias) and ``b`` is a learnable
    per-unit bias traced through `element_wise`.

    **Arguments:** `num_in`, `num_out` (input and state sizes); `w_init`
    (weight initialiser; default Xavier normal); `state_init`
    (initial state; default zeros).
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        w_init: Initializer = None,
        state_init: Initializer = None,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        if w_init is None:
            w_init = brainstate.nn.init.XavierNormal()
        n = num_in + num_out
        self.Wu = Linear(n, num_out, w_init=w_init, b_init=None)
        self.Wf = Linear(n, num_out, w_init=w_init, b_init=None)
        self.Wr = Linear(n, num_out, w_init=w_init, b_init=None)
        self.Wo = Linear(n, num_out, w_init=w_init, b_init=None)
        u = np.random.default_rng(seed).uniform(1.0 / num_out, 1.0 - 1.0 / num_out, num_out)
        self.bias = brainstate.ParamState(
            jnp.asarray(-np.log(1.0 / u - 1.0), brainstate.environ.dftype())
        )

    _state_names = ("h", "c")
    c: "brainstate.HiddenState[Array]"

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h, c = self.h.value, self.c.value
        xh = jnp.concatenate([x, h], axis=-1)
        b = element_wise(self.bias.value)
        f = jax.nn.sigmoid(self.Wf(xh) + b)
        r = jax.nn.sigmoid(self.Wr(xh) - b)
        g = r * (1.0 - (1.0 - f) ** 2) + (1.0 - r) * f**2
        c_new = g * c + (1.0 - g) * jnp.tanh(self.Wu(xh))
        h_new = jax.nn.sigmoid(self.Wo(xh)) * jnp.tanh(c_new)
        self.h.value = h_new
        self.c.value = c_new
        return h_new


class LRUCell(brainstate.nn.Module):
    r"""Linear recurrent unit with a complex diagonal recurrence kept as two real
    states (one hidden group, two states per unit).

    ``λ = exp(−e^{ν} + i e^{θ})``, ``h ← λ ⊙ h + e^{γ} ⊙ (B x)``,
    ``y = Re(C h) + D ⊙ x``; ``ν, θ, γ, D`` are per-unit parameters traced through
    `element_wise`, ``B`` (real and imaginary parts) through dense matmuls, and the
    readout ``C`` is non-temporal.

    **Arguments:**

    - `d_model`: input and output size; `d_hidden`: number of complex units.
    - `r_min`, `r_max`: range of ``|λ|`` at initialisation; `max_phase`: of ``arg λ``.
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        r_min: float = 0.0,
        r_max: float = 1.0,
        max_phase: float = 2 * math.pi,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        d_model = positive_int("LRUCell: d_model", d_model)
        d_hidden = positive_int("LRUCell: d_hidden", d_hidden)
        if not 0.0 <= r_min < r_max <= 1.0:
            raise ValueError(f"need 0 <= r_min < r_max <= 1, got {r_min}, {r_max}")
        self.d_model = d_model
        self.d_hidden = d_hidden
        self.in_size = (d_model,)
        self.out_size = (d_model,)
        rng = np.random.default_rng(seed)
        dtype = brainstate.environ.dftype()
        u1, u2 = rng.uniform(size=d_hidden), rng.uniform(size=d_hidden)
        nu_log = np.log(-0.5 * np.log(u1 * (r_max**2 - r_min**2) + r_min**2 + 1e-12))
        theta_log = np.log(max_phase * u2 + 1e-12)
        lam = np.exp(-np.exp(nu_log))
        gamma_log = np.log(np.sqrt(np.maximum(1.0 - lam**2, 1e-12)))
        self.nu_log = brainstate.ParamState(jnp.asarray(nu_log, dtype))
        self.theta_log = brainstate.ParamState(jnp.asarray(theta_log, dtype))
        self.gamma_log = brainstate.ParamState(jnp.asarray(gamma_log, dtype))
        init = brainstate.nn.init.Normal(scale=1.0 / math.sqrt(2 * d_model))
        self.B_re = Linear(d_model, d_hidden, w_init=init, b_init=None)
        self.B_im = Linear(d_model, d_hidden, w_init=init, b_init=None)
        init_c = brainstate.nn.init.Normal(scale=1.0 / math.sqrt(d_hidden))
        self.C_re = Linear(d_hidden, d_model, w_init=init_c, b_init=None)
        self.C_im = Linear(d_hidden, d_model, w_init=init_c, b_init=None)
        self.D = brainstate.ParamState(init_param(brainstate.nn.init.Normal(), (d_model,)))

    def _zeros(self, batch_size: int | None) -> Array:
        out: Array = init_param(brainstate.nn.init.ZeroInit(), (self.d_hidden,), batch_size)
        return out

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.h_re = brainstate.HiddenState(self._zeros(batch_size))
        self.h_im = brainstate.HiddenState(self._zeros(batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.h_re.value = self._zeros(batch_size)
        self.h_im.value = self._zeros(batch_size)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        modulus = jnp.exp(-jnp.exp(element_wise(self.nu_log.value)))
        phase = jnp.exp(element_wise(self.theta_log.value))
        lam_re, lam_im = modulus * jnp.cos(phase), modulus * jnp.sin(phase)
        gamma = jnp.exp(element_wise(self.gamma_log.value))
        h_re, h_im = self.h_re.value, self.h_im.value
        new_re = lam_re * h_re - lam_im * h_im + gamma * self.B_re(x)
        new_im = lam_re * h_im + lam_im * h_re + gamma * self.B_im(x)
        self.h_re.value = new_re
        self.h_im.value = new_im
        return self.C_re(new_re) - self.C_im(new_im) + element_wise(self.D.value) * x
