"""The axes of a learning rule, each a closed family of small final Modules.

A `LearningRule` is one point on these axes (see `etrax.algorithms.LearningRule`):

- *trace factorisation* (`PerParameter`, `InputOutput`) lives with its engine in
  `_drtrl.py` / `_pp.py`;
- *temporal recursion* (`Jacobian`, `ScalarLeak`, `NoRecursion`): what carries a
  trace from one step to the next;
- *recurrence scope* (`Diagonal`, `Coupled`, `Sparse`): which part of the transition
  the recursion uses;
- *learning signal* (`Symmetric`, `RandomFeedback`, `Modulatory`): what the traces
  are contracted with;
- *trace filter* (`NoFilter`, `Kappa`): an optional low-pass filter of the traces.
"""

import abc
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._errors import CompilationError
from .._typing import PyTree
from ..compiler import ETraceGraph
from ..executor import StepJacobians
from ._base import as_int, concrete_number
from ._snap import gather_transition, neighbourhood


def check_key(owner: str, key: object) -> None:
    """A `TypeError` unless `key` is one PRNG key: typed (``jax.random.key``) or raw
    key data of JAX's default implementation (``jax.random.PRNGKey``'s ``uint32[2]``
    for threefry, ``[4]`` when ``jax_default_prng_impl`` is ``rbg``: raw data is read
    with the default implementation); the field is annotated, but only checked at run
    time in the tests."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.extended)
    raw_shape = jax.random.key_data(jax.random.key(0)).shape  # the default implementation's
    raw = isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape == raw_shape
    if not ((typed and isinstance(key, jax.Array) and key.shape == ()) or raw):
        raise TypeError(
            f"{owner}: key must be one PRNG key such as jax.random.key(0) (raw key data must "
            f"be uint32{list(raw_shape)}, JAX's default implementation's), got "
            f"{type(key).__name__} {key!r}"
        )


__all__ = [
    "Bootstrapped",
    "Coupled",
    "Diagonal",
    "Filter",
    "Jacobian",
    "Kappa",
    "Modulatory",
    "NoFilter",
    "NoRecursion",
    "RandomFeedback",
    "Recursion",
    "ScalarLeak",
    "Scope",
    "Signal",
    "Sparse",
    "Symmetric",
]


def _unit_interval(owner: str, name: str, value: object, *, closed_low: bool = True) -> float:
    """`value` as a float in ``[0, 1)`` (or ``(0, 1)``), else a `ValueError` naming it
    (a concrete 0-d array is its number; anything but a real number is a `TypeError`)."""
    value = concrete_number(value)
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{owner}: {name} must be a float in [0, 1), got {value!r}")
    v = float(value)
    if not (0.0 <= v < 1.0 if closed_low else 0.0 < v < 1.0):
        interval = "[0, 1)" if closed_low else "(0, 1)"
        raise ValueError(f"{owner}: {name} must be in {interval}, got {v}")
    return v


# --- temporal recursion ----------------------------------------------------------------------


class Recursion(eqx.Module):
    """How a trace is carried from one step to the next: the transition ``D`` used in
    ``ε ← D ε + …`` (``(*varshape, S, S)`` per group)."""

    @abc.abstractmethod
    def transition(self, D: Float[Array, "*pos S S"]) -> Float[Array, "*pos S S"]:
        """The transition that replaces a group's per-position Jacobian `D`."""

    def apply(self, jac: StepJacobians) -> StepJacobians:
        """`jac` with every group's ``D`` replaced by `transition`."""
        return StepJacobians(jac.x, jac.df, tuple(self.transition(D) for D in jac.D), jac.point)


class Jacobian(Recursion):
    """The true per-position Jacobian ``∂h^t/∂h^{t-1}`` (RTRL's recursion)."""

    def transition(self, D: Float[Array, "*pos S S"]) -> Float[Array, "*pos S S"]:
        return D


class ScalarLeak(Recursion):
    """``D`` replaced by ``decay · I``: a leaky integrator that ignores the dynamics
    (cheap, and the right model for a fixed membrane leak).

    **Arguments:**

    - `decay`: the leak in ``(0, 1)``.
    """

    decay: float = eqx.field(static=True)

    def __init__(self, decay: float) -> None:
        self.decay = _unit_interval("ScalarLeak", "decay", decay, closed_low=False)

    def transition(self, D: Float[Array, "*pos S S"]) -> Float[Array, "*pos S S"]:
        eye = jnp.eye(D.shape[-1], dtype=D.dtype)
        return jnp.broadcast_to(self.decay * eye, D.shape)


class NoRecursion(Recursion):
    """``D = 0``: a trace holds only the current step's contribution (no temporal credit
    through the hidden state)."""

    def transition(self, D: Float[Array, "*pos S S"]) -> Float[Array, "*pos S S"]:
        return jnp.zeros_like(D)


# --- recurrence scope ------------------------------------------------------------------------


class Scope(eqx.Module):
    """Which part of the step's transition the recursion follows."""

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """A short name for reports."""

    @property
    @abc.abstractmethod
    def needs_point(self) -> bool:
        """Whether the rule needs each step's `StepPoint` (the whole transition)."""

    @abc.abstractmethod
    def transitions(self, graph: ETraceGraph, jac: StepJacobians) -> StepJacobians:
        """`jac` with each group's ``D`` replaced by this scope's transition."""

    @abc.abstractmethod
    def check(self, graph: ETraceGraph) -> None:
        """Raise `CompilationError` if this scope cannot run on `graph`."""


class Diagonal(Scope):
    """The element-wise transition of each group, per position: a recurrent weight op
    is a boundary (D-RTRL's scope)."""

    @property
    def label(self) -> str:
        return "diagonal"

    @property
    def needs_point(self) -> bool:
        return False

    def transitions(self, graph: ETraceGraph, jac: StepJacobians) -> StepJacobians:
        return jac

    def check(self, graph: ETraceGraph) -> None:
        return None


def _check_size(graph: ETraceGraph, max_elements: int, owner: str) -> None:
    for g in graph.hidden_groups:
        n = (int(np.prod(g.varshape, dtype=np.int64)) * g.num_state) ** 2
        if n > max_elements:
            raise CompilationError(
                f"{owner}: hidden group {g.index}'s whole transition Jacobian has {n} elements "
                f"(varshape {g.varshape}, S = {g.num_state}), more than max_elements="
                f"{max_elements}; raise max_elements or use the Diagonal scope"
            )


def _full(graph: ETraceGraph, jac: StepJacobians, index: int) -> Array:
    if jac.point is None:
        raise ValueError("this scope needs StepJacobians.point (the drivers attach it)")
    return jac.point.transition_jacobian(graph, index)


class Coupled(Scope):
    """Each group's whole transition, weight ops included, per position: ``D`` becomes
    the true per-position block of ``∂h^t/∂h^{t-1}`` (OSTL for recurrent networks;
    equal to SnAp-1). Cross-position terms are still dropped.

    The block is read from the group's full transition Jacobian, which costs
    ``P·S`` forward-mode passes of the step per step (``P`` positions, ``S`` states).

    **Arguments:**

    - `max_elements`: the largest full Jacobian (``(P·S)²`` elements) allowed; a larger
      group is a `CompilationError` when the traces are created.
    """

    max_elements: int = eqx.field(static=True, default=2**24)

    @property
    def label(self) -> str:
        return "coupled"

    @property
    def needs_point(self) -> bool:
        return True

    def check(self, graph: ETraceGraph) -> None:
        _check_size(graph, self.max_elements, "the coupled scope")

    def transitions(self, graph: ETraceGraph, jac: StepJacobians) -> StepJacobians:
        blocks = []
        for g, D in zip(graph.hidden_groups, jac.D, strict=True):
            P = int(np.prod(g.varshape, dtype=np.int64))
            S = g.num_state
            J = _full(graph, jac, g.index).reshape(P, S, P, S)
            diag = jnp.arange(P)
            blocks.append(J[diag, :, diag, :].reshape(D.shape))
        return StepJacobians(jac.x, jac.df, tuple(blocks), jac.point)


class Sparse(Scope):
    """SnAp-n: per-parameter traces over the positions each weight entry reaches in
    fewer than ``n`` steps of the group's whole transition (``n − 1`` hops of its
    position graph: a dense recurrent weight reaches every position of its batch entry
    in one hop, a sparse one follows its pattern). ``n = 1`` is the coupled scope;
    once ``n − 1`` reaches the position graph's diameter the traces are full
    within-group RTRL (Menick et al. 2021).

    **Arguments:**

    - `n`: the neighbourhood's steps, ``≥ 1``.
    - `max_elements`: the largest full transition Jacobian (``(P·S)²``) allowed.
    - `max_trace_elements`: the largest trace (over all weights) allowed; past it,
      creating the traces is a `CompilationError`.
    """

    n: int = eqx.field(static=True, converter=as_int)
    max_elements: int = eqx.field(static=True, default=2**24)
    max_trace_elements: int = eqx.field(static=True, default=2**26)

    def __check_init__(self) -> None:
        n: object = self.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Sparse: n must be an int >= 1, got {self.n!r}")

    @property
    def label(self) -> str:
        return f"sparse-{self.n}"

    @property
    def needs_point(self) -> bool:
        return True

    def check(self, graph: ETraceGraph) -> None:
        _check_size(graph, self.max_elements, f"the sparse-{self.n} scope")

    def transitions(self, graph: ETraceGraph, jac: StepJacobians) -> StepJacobians:
        out = []
        for g in graph.hidden_groups:
            P = int(np.prod(g.varshape, dtype=np.int64))
            hood = neighbourhood(graph, g.index, self.n, self.max_elements)
            out.append(gather_transition(_full(graph, jac, g.index), hood, P, g.num_state))
        return StepJacobians(jac.x, jac.df, tuple(out), jac.point)


# --- learning signal -------------------------------------------------------------------------


Signals = tuple[tuple[Array, ...], tuple[Array, ...]]
"""Learning signals per group: on the new hidden values, and on the old ones."""


class Signal(eqx.Module):
    """What the traces are contracted with at each step."""

    @property
    @abc.abstractmethod
    def needs_modulator(self) -> bool:
        """Whether a per-step modulator must be passed (``online_grad(modulators=…)``)."""

    @property
    @abc.abstractmethod
    def symmetric(self) -> bool:
        """Whether the signal is the true ``∂L/∂h`` (required by windowed learning)."""

    @property
    def synthetic_rate(self) -> float | None:
        """The synthesiser's learning rate, for a bootstrapped signal (else `None`)."""
        return None

    @abc.abstractmethod
    def signals(
        self,
        graph: ETraceGraph,
        dl_dh: tuple[Array, ...],
        olds: tuple[Array, ...],
        dl_dy: PyTree,
        modulator: PyTree | None,
    ) -> Signals:
        """The learning signals of one step, from the true ``∂L/∂h^t`` per group
        (`dl_dh`), the direct ``∂L/∂h^{t-1}`` (`olds`), the output cotangent ``∂L/∂y``
        (`dl_dy`) and the step's modulator (if any)."""


class Symmetric(Signal):
    """The true loss-to-hidden gradient ``∂L/∂h^t`` (gradient descent's own signal)."""

    @property
    def needs_modulator(self) -> bool:
        return False

    @property
    def symmetric(self) -> bool:
        return True

    def signals(
        self,
        graph: ETraceGraph,
        dl_dh: tuple[Array, ...],
        olds: tuple[Array, ...],
        dl_dy: PyTree,
        modulator: PyTree | None,
    ) -> Signals:
        return dl_dh, olds


def _zeros(signals: Sequence[Array]) -> tuple[Array, ...]:
    return tuple(jnp.zeros_like(s) for s in signals)


class RandomFeedback(Signal):
    """Feedback alignment: the learning signal of every group is ``B_g · ∂L/∂y`` with a
    fixed random matrix ``B_g`` in place of the transposed readout (Lillicrap et al.
    2016; Bellec et al. 2020's random e-prop; every group is fed directly, as in
    Nøkland 2016's direct feedback alignment).

    ``B_g`` maps each output leaf's last axis to the group's last varshape axis and
    its ``S`` states, with entries ``N(0, scale² / Y)`` (``Y``: the total output
    width); leading axes (a batch axis) are shared, so every output leaf must have the
    group's leading varshape axes. The signal does not depend on the readout weights.
    The direct signal on old hidden values is not used.

    **Arguments:**

    - `key`: the PRNG key ``B`` is drawn from (fixed for the rule's lifetime).
    - `scale`: the entries' scale (default 1).
    """

    key: PRNGKeyArray
    scale: float = eqx.field(static=True, default=1.0)

    def __check_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"RandomFeedback: scale must be a positive float, got {self.scale!r}")
        check_key("RandomFeedback", self.key)

    @property
    def needs_modulator(self) -> bool:
        return False

    @property
    def symmetric(self) -> bool:
        return False

    def matrices(self, graph: ETraceGraph, dl_dy: PyTree) -> list[list[Array]]:
        """``B_g`` per group and output leaf, shaped ``(Y_leaf, H_g, S)``."""
        leaves = jax.tree.leaves(dl_dy)
        widths = [leaf.shape[-1] if leaf.ndim else 1 for leaf in leaves]
        total = max(sum(widths), 1)
        out = []
        for g in graph.hidden_groups:
            width = g.varshape[-1] if g.varshape else 1
            lead = g.varshape[:-1]
            mats = []
            for i, (leaf, y_width) in enumerate(zip(leaves, widths, strict=True)):
                y_lead = leaf.shape[:-1] if leaf.ndim else ()
                if tuple(y_lead) != tuple(lead):
                    raise ValueError(
                        f"RandomFeedback: output leaf {i} has shape {leaf.shape}, but hidden "
                        f"group {g.index} has varshape {g.varshape}; random feedback needs "
                        "outputs whose leading axes (a batch axis) equal the group's leading "
                        "varshape axes. Use the symmetric signal for this model."
                    )
                key = jax.random.fold_in(jax.random.fold_in(self.key, g.index), i)
                B = jax.random.normal(key, (y_width, width, g.num_state), leaf.dtype)
                mats.append(B * jnp.asarray(self.scale / np.sqrt(total), leaf.dtype))
            out.append(mats)
        return out

    def signals(
        self,
        graph: ETraceGraph,
        dl_dh: tuple[Array, ...],
        olds: tuple[Array, ...],
        dl_dy: PyTree,
        modulator: PyTree | None,
    ) -> Signals:
        leaves = jax.tree.leaves(dl_dy)
        out = []
        for g, sym, mats in zip(
            graph.hidden_groups, dl_dh, self.matrices(graph, dl_dy), strict=True
        ):
            total = jnp.zeros_like(sym)
            for leaf, B in zip(leaves, mats, strict=True):
                cot = leaf if leaf.ndim else leaf[None]
                term = jnp.einsum("...y,yhs->...hs", cot, B)
                total = total + (term.reshape(sym.shape) if g.varshape else term[0])
            out.append(total)
        return tuple(out), _zeros(olds)


class Modulatory(Signal):
    """Three-factor learning: the signal is a modulator passed per step as data
    (``online_grad(..., modulators=ms)``), never captured when tracing.

    A step's modulator is one array broadcastable to every group's ``(*varshape, S)``
    (a scalar, or per position an array shaped ``(*varshape, 1)``: ``(B, H)`` does not
    broadcast against ``(B, H, S)``), or a tuple with one such array per hidden
    group. The direct signal on old hidden values is not used.
    """

    @property
    def needs_modulator(self) -> bool:
        return True

    @property
    def symmetric(self) -> bool:
        return False

    def signals(
        self,
        graph: ETraceGraph,
        dl_dh: tuple[Array, ...],
        olds: tuple[Array, ...],
        dl_dy: PyTree,
        modulator: PyTree | None,
    ) -> Signals:
        if modulator is None:
            raise ValueError("Modulatory signal: pass modulators=... to online_grad")
        per_group = (
            tuple(modulator)
            if isinstance(modulator, tuple | list)
            else (modulator,) * len(graph.hidden_groups)
        )
        if len(per_group) != len(graph.hidden_groups):
            raise ValueError(
                f"Modulatory signal: got {len(per_group)} modulators for "
                f"{len(graph.hidden_groups)} hidden groups; pass one array (broadcast to every "
                "group) or one per group"
            )
        out = []
        for g, m, sym in zip(graph.hidden_groups, per_group, dl_dh, strict=True):
            m = jnp.asarray(m)
            try:
                full = jnp.broadcast_to(m, sym.shape)
            except ValueError:
                raise ValueError(
                    f"Modulatory signal: a modulator shaped {m.shape} does not broadcast to "
                    f"hidden group {g.index}'s (*varshape, S) = {sym.shape}"
                ) from None
            out.append(full.astype(sym.dtype))
        return tuple(out), _zeros(olds)


class Bootstrapped(Signal):
    """Synthetic gradients (DNI, Jaderberg et al. 2017): inside each window the true
    ``∂L/∂h``; at each window's exit a `SyntheticGradient` predicts the cotangent the
    rest of the sequence would send back, which reaches the parameters no relation
    traces (the traces already carry cross-window credit for the traced ones). The
    synthesiser trains itself by bootstrapping, one gradient step per window. Needs
    ``online_grad(..., window=k)``; the last window of each call gets no synthetic
    cotangent (the call is the sequence's end).

    A trained synthesiser predicts for the loss, window length and input statistics
    it was trained on; its prediction is linear in the hidden state.

    **Arguments:**

    - `learning_rate`: the synthesiser's step size.
    """

    learning_rate: float = eqx.field(static=True, default=0.001)

    def __check_init__(self) -> None:
        if not (self.learning_rate > 0 and np.isfinite(self.learning_rate)):
            raise ValueError(
                f"Bootstrapped: learning_rate must be a positive finite number, got "
                f"{self.learning_rate!r}"
            )

    @property
    def needs_modulator(self) -> bool:
        return False

    @property
    def symmetric(self) -> bool:
        return True

    @property
    def synthetic_rate(self) -> float | None:
        return self.learning_rate

    def signals(
        self,
        graph: ETraceGraph,
        dl_dh: tuple[Array, ...],
        olds: tuple[Array, ...],
        dl_dy: PyTree,
        modulator: PyTree | None,
    ) -> Signals:
        return dl_dh, olds


# --- trace filter ----------------------------------------------------------------------------


class Filter(eqx.Module):
    """An optional low-pass filter applied to the traces before they are contracted."""

    @property
    @abc.abstractmethod
    def decay(self) -> float | None:
        """The filter's decay, or `None` for no filter."""


class NoFilter(Filter):
    """The traces are contracted as they are."""

    @property
    def decay(self) -> float | None:
        return None


class Kappa(Filter):
    """e-prop's κ filter: ``ē ← κ ē + ε``, and ``ē`` is contracted with the signal.

    **Arguments:**

    - `kappa`: the filter's decay in ``(0, 1)``.
    """

    kappa: float = eqx.field(static=True)

    def __init__(self, kappa: float) -> None:
        self.kappa = _unit_interval("Kappa", "kappa", kappa, closed_low=False)

    @property
    def decay(self) -> float | None:
        return self.kappa


def as_dtype(value: Any, owner: str) -> str | None:
    """A floating dtype name for a trace-storage dtype (or `None`), else a `TypeError`."""
    if value is None:
        return None
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise TypeError(f"{owner}: trace_dtype must be a float dtype, got {value!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{owner}: trace_dtype must be a float dtype, got {dt}")
    return str(dt)
