"""The named learning rules: presets of `LearningRule` with fixed coordinates.

Each preset returns a `LearningRule`; change a coordinate of one with
`eqx.tree_at` or build the rule directly. `by_name` resolves the names
`etrax.compile` accepts.
"""

from collections.abc import Callable
from typing import Any, Literal, SupportsIndex

import jax
from jaxtyping import PRNGKeyArray, ScalarLike

from ._axes import (
    Bootstrapped,
    Coupled,
    Kappa,
    Modulatory,
    NoFilter,
    NoRecursion,
    RandomFeedback,
    Sparse,
    Symmetric,
    _unit_interval,
)
from ._base import as_int
from ._drtrl import ParamTraces, PerParameter
from ._pp import InputOutput, IOTraces, steps_from
from ._rule import LearningRule
from ._uoro import ProjectionTraces, RandomProjection

__all__ = [
    "DNI",
    "DRTRL",
    "ESDRTRL",
    "PRESETS",
    "UORO",
    "EProp",
    "OSTLFeedforward",
    "OSTLRecurrent",
    "PPProp",
    "SnAp",
    "ThreeFactor",
    "by_name",
]


def DRTRL(
    chunk_steps: SupportsIndex | None = None, *, trace_dtype: Any = None
) -> LearningRule[ParamTraces]:  # a preset reads as the rule's name
    """Diagonal RTRL: a per-parameter trace ``ε ← D ε + x ⊗ df`` per (weight, group),
    contracted with ``∂L/∂h`` every step.

    Exact (equal to BPTT) when every transition is position-diagonal, every tail
    element-wise, and each weight reaches later steps only through the hidden group
    it feeds (in a stacked network the upper layer's state also carries the lower
    layer's weights forward); otherwise the cross-position and cross-group terms are
    dropped. Memory: each traced weight's size times ``S`` per connected group.

    **Arguments:**

    - `chunk_steps`: steps the sequence driver re-associates into one fused update (the
      trace is read and written once per chunk; results equal the per-step form).
      ``1`` runs the per-step form. At most this many: when it does not divide the
      sequence length, a divisor from half of it up is used if there is one, so that
      every chunk is alike and the program is compiled with one chunk body. `None`
      (default): 32; when the model runs on one sample, 64 on the CPU and ``1`` on a
      GPU (`default_chunk_steps`). The per-step form compiles fewer kernels (a small GRU
      on the CPU: 0.6 s instead of 0.9) but runs slower per step there (about 2×):
      worth it only for short runs, where the first compile is most of the time.
    - `trace_dtype`: the dtype traces are stored in (default: the model's).
    """
    return LearningRule(
        PerParameter(),
        chunk_steps=None if chunk_steps is None else steps_from(chunk_steps),
        trace_dtype=trace_dtype,
        name="DRTRL",
    )


def PPProp(
    decay: ScalarLike = 0.9,
    chunk_steps: SupportsIndex | None = None,
    *,
    trace_dtype: Any = None,
) -> LearningRule[IOTraces]:
    """ES-D-RTRL (pp-prop): ``ε_x ← a ε_x + x``, ``ε_f ← a (D ⊛ ε_f) + (1 − a) df``, and
    the gradient ``contract(ε_x, Σ_a ε_f[a] L[a] / c)`` through one VJP-like
    contraction, with memory ``O(I + O)`` per relation.

    The bias correction ``c = 1 − a^n`` counts trace steps ``n`` (not calls), so it is
    right under windows too. Exact at the first step; an approximation afterwards.

    **Arguments:**

    - `decay`: ``a`` in ``[0, 1)``; an integer rank ``r ≥ 1`` means ``a = (r − 1)/(r + 1)``.
      Python or NumPy numbers (``np.int64(2)``, ``np.float32(0.5)``) are accepted and
      stored as a Python ``float``; strings and bools are refused with a `TypeError`.
    - `chunk_steps`: steps whose gradient contractions run as one stacked product
      (``1``: per step). Equal results. The traces still advance step by step; what
      the chunk keeps is each step's input trace and signal per factorised slot, and
      the instantaneous-gradient operands of untraced weights, ``O(K · (I + O))`` per
      relation, for one product with ``K`` times the rows of a step's at the chunk's
      end. ``1`` keeps only the traces. A positive Python or NumPy integer, or `None`
      (default): 32, or ``1`` on a GPU when the model runs on one sample, where a step
      is a few kernel launches and the chunk's stacking writes cost more than its
      products save (`default_chunk_steps`).
    - `trace_dtype`: the dtype traces are stored in (default: the model's).
    """
    return LearningRule(
        InputOutput(decay),
        chunk_steps=None if chunk_steps is None else steps_from(chunk_steps),
        trace_dtype=trace_dtype,
        name="PPProp",
    )


ESDRTRL = PPProp
"""Alias of `PPProp` (exponentially smoothed D-RTRL)."""


def EProp(
    kappa: ScalarLike = 0.0,
    feedback: Literal["symmetric", "random"] = "symmetric",
    key: PRNGKeyArray | None = None,
    chunk_steps: SupportsIndex | None = None,
    *,
    trace_dtype: Any = None,
) -> LearningRule[ParamTraces]:
    """e-prop: D-RTRL's traces, optionally low-pass filtered (``ē ← κ ē + ε``) and
    contracted with the symmetric ``∂L/∂h`` or with random feedback ``B · ∂L/∂y``
    (Bellec et al. 2020).

    **Arguments:**

    - `kappa`: the filter's decay in ``[0, 1)`` (``0``: no filter, equal to `DRTRL`).
    - `feedback`: ``"symmetric"`` or ``"random"`` (`RandomFeedback`: a fixed random
      matrix replaces the readout's transpose).
    - `key`: a PRNG key, required for random feedback.
    - `chunk_steps`: steps the sequence driver re-associates into one fused update, as
      for `DRTRL` (the filter is folded into the chunk exactly); ``1`` runs per step,
      `None` (default) picks 32, 64 or ``1`` as for `DRTRL`.
    - `trace_dtype`: the dtype traces are stored in (default: the model's).
    """
    kappa = _unit_interval("EProp", "kappa", kappa)
    if feedback not in ("symmetric", "random"):
        raise ValueError(f"EProp: feedback must be 'symmetric' or 'random', got {feedback!r}")
    if feedback == "random" and key is None:
        raise ValueError("EProp(feedback='random') needs key=jax.random.key(...)")
    signal = Symmetric() if key is None or feedback == "symmetric" else RandomFeedback(key)
    return LearningRule(
        PerParameter(),
        signal=signal,
        filter=Kappa(kappa) if kappa > 0 else NoFilter(),
        chunk_steps=None if chunk_steps is None else steps_from(chunk_steps),
        trace_dtype=trace_dtype,
        name="EProp",
    )


def OSTLFeedforward(*, trace_dtype: Any = None) -> LearningRule[IOTraces]:
    """OSTL for feed-forward networks (Bohnstingl et al. 2022): input/output traces with
    no temporal recursion, so each step's gradient is its own instantaneous one through
    the traced ops (``ε_x = x``, ``ε_f = df``). Exact for networks whose hidden states
    carry no credit across steps; cheap (``O(I + O)``) everywhere.
    """
    return LearningRule(
        InputOutput(0.0), recursion=NoRecursion(), trace_dtype=trace_dtype, name="OSTLFeedforward"
    )


def OSTLRecurrent(*, trace_dtype: Any = None) -> LearningRule[ParamTraces]:
    """OSTL for recurrent networks (Bohnstingl et al. 2022): D-RTRL's per-parameter traces
    with the coupled scope, so ``D`` is the true per-position block of the whole
    transition, recurrent weight ops included. Equal to SnAp-1.

    Each step computes the groups' whole transition Jacobians (``P·S`` forward-mode
    passes of the step), so it suits small recurrent groups; groups past the `Coupled`
    scope's ``max_elements`` are refused when the traces are created.
    """
    return LearningRule(
        PerParameter(), scope=Coupled(), trace_dtype=trace_dtype, name="OSTLRecurrent"
    )


def SnAp(n: SupportsIndex = 2, *, trace_dtype: Any = None) -> LearningRule[ParamTraces]:
    """SnAp-n (Menick et al. 2021): per-parameter traces over the positions each weight
    entry reaches in fewer than ``n`` steps of the whole transition (see `Sparse`).
    ``n = 1`` equals `OSTLRecurrent`; once ``n − 1`` reaches the position graph's
    diameter (``n = 2`` for a dense recurrent weight) it is full within-group RTRL.

    **Arguments:**

    - `n`: the neighbourhood's steps, ``≥ 1``.
    - `trace_dtype`: the dtype traces are stored in (default: the model's).
    """
    count = as_int(n)
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"SnAp: n must be an int >= 1 (Python or NumPy integer), got {n!r}")
    return LearningRule(PerParameter(), scope=Sparse(count), trace_dtype=trace_dtype, name="SnAp")


def UORO(key: PRNGKeyArray, *, trace_dtype: Any = None) -> LearningRule[ProjectionTraces]:
    """UORO (Tallec & Ollivier 2018): a rank-1 unbiased estimate ``s̃ θ̃ᵀ`` of each
    group's full RTRL trace, advanced with one JVP of the step per group (the
    ``(P·S)²`` Jacobian is never formed), with Rademacher noise drawn from `key`.
    The step's own contribution is exact; the past is estimated (see
    `RandomProjection`). Memory ``O(P·S + |θ|)`` per group.

    **Arguments:**

    - `key`: the PRNG key of the per-step noise.
    - `trace_dtype`: the dtype traces are stored in (default: the model's).
    """
    return LearningRule(
        RandomProjection(key), scope=Coupled(), trace_dtype=trace_dtype, name="UORO"
    )


def DNI(learning_rate: float = 0.01, *, trace_dtype: Any = None) -> LearningRule[ParamTraces]:
    """Windowed D-RTRL with synthetic gradients (Jaderberg et al. 2017): run it with
    ``online_grad(..., window=k)``. Inside each window the gradient is exact reverse
    mode; across windows the traces carry the traced weights' credit, and a linear
    `SyntheticGradient` predicts the rest of the sequence's cotangent at each
    window's exit for every other parameter (see `Bootstrapped`).

    **Arguments:**

    - `learning_rate`: the synthesiser's step size.
    - `trace_dtype`: the dtype traces are stored in (default: the model's).
    """
    return LearningRule(
        PerParameter(), signal=Bootstrapped(learning_rate), trace_dtype=trace_dtype, name="DNI"
    )


def ThreeFactor(
    chunk_steps: SupportsIndex | None = 1, *, trace_dtype: Any = None
) -> LearningRule[ParamTraces]:
    """Three-factor (modulated) learning: D-RTRL's per-parameter traces contracted with
    a modulator passed per step as data (``online_grad(..., modulators=ms)``), in place
    of ``∂L/∂h``.

    Parameters outside every relation (readouts, plainly used weights) still get their
    exact instantaneous gradient of the loss; a modulator of zeros gives zero traced
    gradients.
    """
    return LearningRule(
        PerParameter(),
        signal=Modulatory(),
        chunk_steps=chunk_steps,
        trace_dtype=trace_dtype,
        name="ThreeFactor",
    )


PRESETS: dict[str, Callable[[], LearningRule[Any]]] = {
    "d_rtrl": DRTRL,
    "drtrl": DRTRL,
    "pp_prop": PPProp,
    "es_d_rtrl": PPProp,
    "esd_rtrl": PPProp,
    "esdrtrl": PPProp,
    "eprop": EProp,
    "e_prop": EProp,
    "ostl_feedforward": OSTLFeedforward,
    "ostl_recurrent": OSTLRecurrent,
    "snap": SnAp,
    "three_factor": ThreeFactor,
    "dni": DNI,
    "uoro": lambda: UORO(jax.random.key(0)),
}
"""The rules `etrax.compile` accepts by name (lower case; ``-`` reads as ``_``)."""


def by_name(name: str) -> LearningRule[Any]:
    """The preset called `name` (case-insensitive), with its default coordinates."""
    factory = PRESETS.get(name.lower().replace("-", "_"))
    if factory is None:
        raise ValueError(
            f"unknown learning rule {name!r}; use one of {sorted(PRESETS)} or a rule such as "
            "etrax.PPProp(decay=0.9)"
        )
    return factory()
