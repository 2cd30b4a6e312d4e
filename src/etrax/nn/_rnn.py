"""Recurrent cells. Every weight is an `etrax.nn.Linear` on ``[x, h]`` (or on ``x``),
so the compiler finds it; hidden states are `brainstate.HiddenState`s created by
``init_state(batch_size)``."""

import brainstate
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from ._common import Activation, Initializer, init_param, positive_int, resolve_activation
from ._linear import Linear

__all__ = [
    "GRUCell",
    "LSTMCell",
    "MGUCell",
    "MiniGRU",
    "ValinaRNNCell",
    "VanillaRNNCell",
]


class _Cell(brainstate.nn.Module):
    """Shared constructor and state plumbing (not part of the public API): the hidden
    states named in `_state_names`, each ``(num_out,)`` per sample, created in that
    order by ``init_state(batch_size)``."""

    _state_names: tuple[str, ...] = ("h",)
    h: "brainstate.HiddenState[Array]"

    def __init__(
        self,
        num_in: int,
        num_out: int,
        state_init: Initializer,
        name: str | None,
    ) -> None:
        super().__init__(name=name)
        cell = type(self).__name__
        num_in = positive_int(f"{cell}: num_in", num_in)
        num_out = positive_int(f"{cell}: num_out", num_out)
        self.num_in = num_in
        self.num_out = num_out
        self.in_size = (num_in,)
        self.out_size = (num_out,)
        self._state_init = brainstate.nn.init.ZeroInit() if state_init is None else state_init

    def _new_state(self, batch_size: int | None) -> Array:
        return init_param(self._state_init, (self.num_out,), batch_size)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        for name in self._state_names:
            setattr(self, name, brainstate.HiddenState(self._new_state(batch_size)))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        for name in self._state_names:
            getattr(self, name).value = self._new_state(batch_size)


class ValinaRNNCell(_Cell):
    r"""Vanilla RNN: ``h = φ(W [x; h] + b)``.

    The recurrence runs through the weight ``W`` only, so the compiled group has no
    element-wise recurrence (``D ≡ 0``). Also available as `VanillaRNNCell`.
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        activation: Activation = "relu",
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        state_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        self.activation = resolve_activation(activation)
        self.W = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)

    def update(self, x: ArrayLike) -> Array:
        h = self.h.value
        new = self.activation(self.W(jnp.concatenate([jnp.asarray(x), h], axis=-1)))
        self.h.value = new
        return new


VanillaRNNCell = ValinaRNNCell


class GRUCell(_Cell):
    r"""Gated recurrent unit.

    ``z = σ(W_z [x; h])``, ``r = σ(W_r [x; h])``, ``ĥ = φ(W_h [x; r ⊙ h])``,
    ``h ← (1 − z) ⊙ h + z ⊙ ĥ``.

    ``W_r`` reaches ``h`` only through ``W_h``: it is not traced through time and
    learns from its instantaneous gradient (reported by the compiler).
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        activation: Activation = "tanh",
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        state_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        if w_init is None:
            w_init = brainstate.nn.init.Orthogonal()
        self.activation = resolve_activation(activation)
        self.Wz = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)
        self.Wr = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)
        self.Wh = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        xh = jnp.concatenate([x, h], axis=-1)
        z = jax.nn.sigmoid(self.Wz(xh))
        r = jax.nn.sigmoid(self.Wr(xh))
        candidate = self.activation(self.Wh(jnp.concatenate([x, r * h], axis=-1)))
        new = (1.0 - z) * h + z * candidate
        self.h.value = new
        return new


class MGUCell(_Cell):
    r"""Minimal gated unit.

    ``f = σ(W_f [x; h])``, ``ĥ = φ(W_h [x; f ⊙ h])``, ``h ← (1 − f) ⊙ h + f ⊙ ĥ``.

    ``W_f`` reaches ``h`` directly and through ``W_h``; only the direct path is
    traced (reported as a partial path).
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        activation: Activation = "tanh",
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        state_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        if w_init is None:
            w_init = brainstate.nn.init.Orthogonal()
        self.activation = resolve_activation(activation)
        self.Wf = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)
        self.Wh = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        f = jax.nn.sigmoid(self.Wf(jnp.concatenate([x, h], axis=-1)))
        candidate = self.activation(self.Wh(jnp.concatenate([x, f * h], axis=-1)))
        new = (1.0 - f) * h + f * candidate
        self.h.value = new
        return new


class LSTMCell(_Cell):
    r"""Long short-term memory cell with hidden ``h`` and cell ``c`` (one group, S = 2).

    ``i, g, f, o = W_{i,g,f,o} [x; h]``, ``c ← σ(f + 1) ⊙ c + σ(i) ⊙ φ(g)``,
    ``h ← σ(o) ⊙ φ(c)``. The forget gate carries a +1 bias.
    """

    def __init__(
        self,
        num_in: int,
        num_out: int,
        activation: Activation = "tanh",
        w_init: Initializer = None,
        b_init: Initializer = "zeros",
        state_init: Initializer = None,
        name: str | None = None,
    ) -> None:
        super().__init__(num_in, num_out, state_init, name)
        if w_init is None:
            w_init = brainstate.nn.init.XavierNormal()
        self.activation = resolve_activation(activation)
        n = num_in + num_out
        self.Wi = Linear(n, num_out, w_init=w_init, b_init=b_init)
        self.Wg = Linear(n, num_out, w_init=w_init, b_init=b_init)
        self.Wf = Linear(n, num_out, w_init=w_init, b_init=b_init)
        self.Wo = Linear(n, num_out, w_init=w_init, b_init=b_init)

    _state_names = ("h", "c")
    c: "brainstate.HiddenState[Array]"

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        c = self.c.value
        xh = jnp.concatenate([x, h], axis=-1)
        i = self.Wi(xh)
        g = self.Wg(xh)
        f = self.Wf(xh)
        o = self.Wo(xh)
        c_new = jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * self.activation(g)
        h_new = jax.nn.sigmoid(o) * self.activation(c_new)
        self.h.value = h_new
        self.c.value = c_new
        return h_new


class MiniGRU(_Cell):
    r"""Minimal GRU: ``z = σ(W_z [x; h])``, ``h ← (1 − z) ⊙ h + z ⊙ W_x x``."""

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
        self.W_z = Linear(num_in + num_out, num_out, w_init=w_init, b_init=b_init)

    def update(self, x: ArrayLike) -> Array:
        x = jnp.asarray(x)
        h = self.h.value
        z = jax.nn.sigmoid(self.W_z(jnp.concatenate([x, h], axis=-1)))
        new = (1.0 - z) * h + z * self.W_x(x)
        self.h.value = new
        return new
