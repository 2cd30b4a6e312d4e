"""`check_gradients`: an online algorithm's gradient against exact BPTT, per parameter leaf.

Two comparisons per leaf: over the whole given sequence (how good the approximation
is) and over its first step alone. At ``T = 1`` every online rule of etrax equals
BPTT for every parameter (SPEC §4.4), so a first-step mismatch is an etrax bug, not
an approximation.
"""

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array

from .._errors import StepInputError
from .._typing import Path, PyTree
from ..compiler import ETraceGraph, WeightRule
from ..executor import ModelState
from ._base import OnlineAlgorithm, as_int, check_algorithm
from ._drivers import bptt_grad, online_grad

__all__ = ["GradientCheck", "ParamCheck", "check_gradients", "compare_gradients", "t1_tolerance"]

_LossFn = Callable[[PyTree, PyTree], Array]
_Host = npt.NDArray[Any]

_REPORT = (
    "By etrax's invariant every online rule equals BPTT at T = 1, so this is an etrax "
    "bug: please report it (with the model, the algorithm and this table)."
)


def t1_tolerance(dtype: Any) -> float:
    """The relative deviation tolerated at ``T = 1`` for gradients of `dtype`.

    ``10 · eps^(2/3)`` of the dtype's machine epsilon: about ``4e-10`` in float64
    and ``2e-4`` in float32 — far above the rounding of two orders of summation,
    far below any real error.

    **Arguments:**

    - `dtype`: an inexact dtype (a non-float dtype counts as float32).

    **Returns:** the tolerance, a Python float.
    """
    dt = np.dtype(dtype)
    eps = _eps(dt if np.issubdtype(dt, np.inexact) else np.dtype(np.float32))
    return 10.0 * math.pow(eps, 2.0 / 3.0)


def _eps(dtype: np.dtype[Any]) -> float:
    # jnp.finfo (unlike np.finfo) also knows bfloat16 and the other ml_dtypes floats
    return float(jnp.finfo(dtype).eps)  # type: ignore[no-untyped-call]  # unannotated in JAX


@final
class ParamCheck(eqx.Module):
    """One parameter leaf's comparison with BPTT (every field a Python value).

    **Arguments:**

    - `path`: the ParamState's path.
    - `leaf`: the leaf inside a pytree-valued parameter (``"weight"``, ``"bias"``,
      nested keys joined by ``/``), or ``""`` for an array-valued one.
    - `rule`: how the parameter learns (``graph.weight_rules()[path].rule``), if known.
    - `reference_norm`, `online_norm`: ``‖g_bptt‖`` and ``‖g_online‖`` over the sequence.
    - `deviation`: ``‖g_online − g_bptt‖ / max(‖g_bptt‖, floor)`` over the sequence,
      where ``floor`` is the rounding level ``eps · ‖g_bptt‖_all`` of the whole gradient.
    - `deviation_t1`: the same over the first step alone.
    - `t1_tolerance`: the largest `deviation_t1` counted as equal (see `t1_tolerance`).
    - `t1_promised`: whether the algorithm promises BPTT at ``T = 1`` for this leaf
      (not for traced weights under random-feedback e-prop).
    - `rtol`: the largest `deviation` counted as equal over the sequence.
    """

    path: Path = eqx.field(static=True)
    leaf: str = eqx.field(static=True)
    rule: WeightRule | None = eqx.field(static=True)
    reference_norm: float = eqx.field(static=True)
    online_norm: float = eqx.field(static=True)
    deviation: float = eqx.field(static=True)
    deviation_t1: float = eqx.field(static=True)
    t1_tolerance: float = eqx.field(static=True)
    t1_promised: bool = eqx.field(static=True)
    rtol: float = eqx.field(static=True)

    @property
    def name(self) -> str:
        """``a.b.c`` for the path, with ``[leaf]`` for a leaf of a pytree-valued parameter."""
        base = ".".join(str(k) for k in self.path)
        return f"{base}[{self.leaf}]" if self.leaf else base

    @property
    def t1_exact(self) -> bool:
        """Whether the first-step gradient equals BPTT within `t1_tolerance`."""
        return self.deviation_t1 <= self.t1_tolerance

    @property
    def exact(self) -> bool:
        """Whether the gradient over the whole sequence equals BPTT within `rtol`."""
        return self.deviation <= self.rtol

    @property
    def flag(self) -> str:
        """``exact``, ``approx`` (T = 1 exact, not over the sequence), ``T=1 BUG``
        (a broken invariant) or ``T=1 differs`` (allowed by the algorithm)."""
        if not self.t1_exact:
            return "T=1 BUG" if self.t1_promised else "T=1 differs"
        return "exact" if self.exact else "approx"


@final
class GradientCheck(eqx.Module):
    """The result of `check_gradients`: one `ParamCheck` per parameter leaf.

    `str(check)` is an aligned table (see `table`). Every field is a Python value,
    so a check prints, compares and pickles without a device.

    **Arguments:**

    - `algorithm`: the algorithm, as `equinox.tree_pformat` prints it, on one line.
    - `T`: the sequence length.
    - `window`: the `window` passed to `online_grad`.
    - `rtol`: the tolerance for calling a gradient exact over the sequence.
    - `rows`: one `ParamCheck` per parameter leaf, in the graph's state order.
    """

    algorithm: str = eqx.field(static=True)
    T: int = eqx.field(static=True)
    window: int | None = eqx.field(static=True)
    rtol: float = eqx.field(static=True)
    rows: tuple[ParamCheck, ...] = eqx.field(static=True)

    @property
    def ok(self) -> bool:
        """Whether every leaf equals BPTT at ``T = 1`` where the algorithm promises it."""
        return all(r.t1_exact or not r.t1_promised for r in self.rows)

    @property
    def broken(self) -> tuple[ParamCheck, ...]:
        """The leaves that break the ``T = 1`` invariant (etrax bugs)."""
        return tuple(r for r in self.rows if r.t1_promised and not r.t1_exact)

    @property
    def worst(self) -> ParamCheck | None:
        """The leaf with the largest deviation over the sequence (``None`` without parameters)."""
        return max(self.rows, key=lambda r: r.deviation, default=None)

    def table(self) -> str:
        """An aligned text table, one line per parameter leaf: path, rule, ``|g|`` of
        BPTT, relative deviation over ``T`` and at ``T = 1``, and a flag; then a verdict."""
        win = f", window={self.window}" if self.window is not None else ""
        lines = [f"{self.algorithm} vs BPTT over T={self.T}{win} (rtol={self.rtol:.1e})"]
        head = ("parameter", "rule", "|g| bptt", f"rel.dev T={self.T}", "rel.dev T=1", "flag")
        cells = [head] + [
            (
                r.name,
                r.rule.value if r.rule is not None else "?",
                f"{r.reference_norm:.3e}",
                f"{r.deviation:.2e}",
                f"{r.deviation_t1:.2e}",
                r.flag,
            )
            for r in self.rows
        ]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        for k, c in enumerate(cells):
            parts = [c[0].ljust(widths[0]), c[1].ljust(widths[1])]
            parts += [c[i].rjust(widths[i]) for i in range(2, 5)]
            parts.append(c[5])
            lines.append("  ".join(parts).rstrip())
            if k == 0:
                lines.append("-" * len(lines[-1]))
        broken = self.broken
        if broken:
            names = ", ".join(r.name for r in broken)
            lines.append(f"T = 1 MISMATCH for {len(broken)} leaf/leaves ({names}). {_REPORT}")
        else:
            worst = self.worst
            tail = f"; worst over T={self.T}: {worst.name} ({worst.deviation:.2e})" if worst else ""
            lines.append(f"ok: every promised T = 1 gradient equals BPTT{tail}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# --- comparison on the host ---------------------------------------------------------------


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return str(key.name)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _leaves(value: PyTree, what: str, path: Path) -> list[tuple[str, _Host]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(value))
    out: list[tuple[str, _Host]] = []
    for kp, leaf in flat:
        arr = np.asarray(leaf)
        if not np.issubdtype(arr.dtype, np.number):
            raise TypeError(f"{what}[{path!r}] holds a non-numeric leaf of dtype {arr.dtype}")
        out.append(("/".join(_key_name(k) for k in kp), arr))
    return out


def _wide(a: _Host) -> _Host:
    return a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)


def _norm(a: _Host) -> float:
    return float(np.linalg.norm(_wide(a).ravel()))


def _pairs(
    online: Mapping[Path, PyTree], reference: Mapping[Path, PyTree], what: str
) -> list[tuple[Path, str, _Host, _Host]]:
    if set(online) != set(reference):
        missing = sorted(map(repr, set(reference) - set(online)))
        extra = sorted(map(repr, set(online) - set(reference)))
        raise ValueError(
            f"{what}: the online and reference gradients must have the same parameter paths; "
            f"missing {missing}, unexpected {extra}"
        )
    out: list[tuple[Path, str, _Host, _Host]] = []
    for path in reference:
        ref = _leaves(reference[path], f"{what} reference", path)
        onl = _leaves(online[path], f"{what} online", path)
        if [k for k, _ in ref] != [k for k, _ in onl] or any(
            a.shape != b.shape for (_, a), (_, b) in zip(ref, onl, strict=True)
        ):
            raise ValueError(
                f"{what}: the gradients of {path!r} differ in structure or shape: online "
                f"{[(k, a.shape) for k, a in onl]}, reference {[(k, a.shape) for k, a in ref]}"
            )
        out.extend((path, k, a, b) for (k, a), (_, b) in zip(onl, ref, strict=True))
    return out


def _deviations(
    pairs: list[tuple[Path, str, _Host, _Host]],
) -> list[float]:
    total = math.sqrt(sum(_norm(ref) ** 2 for _, _, _, ref in pairs))
    out = []
    for _, _, onl, ref in pairs:
        eps = _eps(ref.dtype) if np.issubdtype(ref.dtype, np.inexact) else 0.0
        floor = max(eps * total, float(np.finfo(np.float64).tiny))
        out.append(_norm(_wide(onl) - _wide(ref)) / max(_norm(ref), floor))
    return out


def _check_tolerance(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


def compare_gradients(
    online: Mapping[Path, PyTree],
    reference: Mapping[Path, PyTree],
    online_t1: Mapping[Path, PyTree],
    reference_t1: Mapping[Path, PyTree],
    *,
    rules: Mapping[Path, WeightRule] | None = None,
    rtol: float = 1e-6,
    t1_rtol: float | None = None,
    t1_unpromised: Collection[Path] = (),
) -> tuple[ParamCheck, ...]:
    """Compare online gradients with reference gradients, leaf by leaf, on the host.

    The pure core of `check_gradients`, usable on any gradients shaped like
    ``state.params`` (a ``dict[path, value]``).

    **Arguments:**

    - `online`, `reference`: the gradients over the whole sequence.
    - `online_t1`, `reference_t1`: the gradients over its first step.
    - `rules`: each path's `WeightRule`, shown in the table (optional).
    - `rtol`: the largest deviation over the sequence counted as exact.
    - `t1_rtol`: the largest deviation at ``T = 1`` counted as equal; by default
      `t1_tolerance` of each leaf's dtype.
    - `t1_unpromised`: paths whose ``T = 1`` equality the algorithm does not promise.

    **Returns:** a tuple of `ParamCheck`, one per leaf, in the order of `reference`.
    """
    rtol = _check_tolerance("rtol", rtol)
    if t1_rtol is not None:
        t1_rtol = _check_tolerance("t1_rtol", t1_rtol)
    seq = _pairs(online, reference, "sequence")
    first = _pairs(online_t1, reference_t1, "T = 1")
    if [(p, k) for p, k, _, _ in seq] != [(p, k) for p, k, _, _ in first]:
        raise ValueError("the sequence and T = 1 gradients must have the same parameter leaves")
    rules = rules or {}
    rows = []
    for (path, leaf, onl, ref), dev, dev1 in zip(
        seq, _deviations(seq), _deviations(first), strict=True
    ):
        rows.append(
            ParamCheck(
                path=path,
                leaf=leaf,
                rule=rules.get(path),
                reference_norm=_norm(ref),
                online_norm=_norm(onl),
                deviation=dev,
                deviation_t1=dev1,
                t1_tolerance=t1_rtol if t1_rtol is not None else t1_tolerance(ref.dtype),
                t1_promised=path not in t1_unpromised,
                rtol=rtol,
            )
        )
    return tuple(rows)


# --- the public check -----------------------------------------------------------------------


def _length(seq: Any, name: str) -> int:
    leaves = jax.tree.leaves(seq)
    if not leaves:
        raise StepInputError(f"{name} holds no arrays: pass a sequence with a leading time axis")
    lengths = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if None in lengths or len(lengths) != 1:
        raise StepInputError(
            f"every array in {name} needs the same leading time axis; got shapes "
            f"{[jnp.shape(a) for a in leaves]}"
        )
    (T,) = lengths
    assert T is not None
    if T < 1:
        raise StepInputError(f"{name} has T = 0 steps: check_gradients needs T >= 1")
    return int(T)


def check_gradients(
    graph: ETraceGraph,
    algo: OnlineAlgorithm[Any],
    state: ModelState,
    xs: Any,
    targets: Any,
    loss_fn: _LossFn,
    *,
    window: int | None = None,
    rtol: float = 1e-6,
    t1_rtol: float | None = None,
) -> GradientCheck:
    """Check an online algorithm's gradient against exact BPTT, per parameter leaf.

    Runs `online_grad` (from ``algo.init(graph, state)``) and `bptt_grad` over the
    given sequence and over its first step alone. Over the sequence the deviation
    measures the approximation; at ``T = 1`` every online rule equals BPTT for every
    parameter, so a leaf that deviates there (beyond `t1_tolerance` of its dtype) is
    flagged as an etrax bug to report. Random-feedback e-prop does not promise it
    for its traced weights, which are flagged ``T=1 differs`` instead.

    **Arguments:**

    - `graph`, `algo`, `state`: as for `online_grad`.
    - `xs`, `targets`, `loss_fn`: the sequence (leading time axis, ``T ≥ 1``) and the
      per-step loss, as for `online_grad`.
    - `window`: passed to `online_grad` (``1`` for the first-step run).
    - `rtol`: the largest relative deviation over the sequence shown as ``exact``.
    - `t1_rtol`: overrides the ``T = 1`` tolerance (default: from the dtype).

    **Returns:** a `GradientCheck`; ``check.ok`` is false exactly when a promised
    ``T = 1`` gradient differs, and ``print(check)`` shows the table.

    !!! Example

        ```python
        check = etrax.check_gradients(graph, etrax.PPProp(0.9), state, xs, ys, mse)
        print(check)  # one line per parameter leaf
        assert check.ok, check
        print(check.worst.name, check.worst.deviation)
        ```
    """
    if not isinstance(graph, ETraceGraph):
        raise TypeError(f"graph must be an etrax ETraceGraph, got {type(graph).__name__}")
    check_algorithm(algo)
    if algo.needs_modulator:
        raise ValueError(
            f"check_gradients compares with BPTT of the loss, but {algo.name} learns from a "
            "modulator, which has no BPTT reference; check it with online_grad(modulators=...)"
        )
    if not isinstance(state, ModelState):
        raise TypeError(
            f"state must be an etrax ModelState (etrax.state_of(graph)), got {type(state).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(y_t, target_t), got {type(loss_fn).__name__}"
        )
    rtol = _check_tolerance("rtol", rtol)
    if t1_rtol is not None:
        t1_rtol = _check_tolerance("t1_rtol", t1_rtol)
    T = _length(xs, "xs")
    if _length(targets, "targets") != T:
        raise StepInputError(
            f"xs has T = {T} steps but targets has {_length(targets, 'targets')}: pass one "
            "target per step"
        )
    w: object = as_int(window)  # a NumPy or 0-d integer is an int, as for online_grad
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= T):
        raise ValueError(f"window must be None or an int in [1, T={T}], got {window!r}")

    def first(seq: Any) -> Any:
        return jax.tree.map(lambda a: a[:1], seq)

    traces = algo.init(graph, state)
    online, _ = online_grad(graph, algo, state, traces, xs, targets, loss_fn, window=window)
    reference, _ = bptt_grad(graph, state, xs, targets, loss_fn)
    x1, t1 = first(xs), first(targets)
    w1 = None if window is None else 1
    online_1, _ = online_grad(graph, algo, state, traces, x1, t1, loss_fn, window=w1)
    reference_1, _ = bptt_grad(graph, state, x1, t1, loss_fn)
    online, reference, online_1, reference_1 = jax.device_get(
        (online, reference, online_1, reference_1)
    )

    statuses = graph.weight_rules()
    rules = {p: statuses[p].rule for p in reference if p in statuses}
    traced = (WeightRule.TRACED, WeightRule.PARTLY_TRACED)  # traces learn the rule's signal
    unpromised = set() if algo.symmetric else {p for p, r in rules.items() if r in traced}
    rows = compare_gradients(
        online,
        reference,
        online_1,
        reference_1,
        rules=rules,
        rtol=rtol,
        t1_rtol=t1_rtol,
        t1_unpromised=unpromised,
    )
    return GradientCheck(
        algorithm=eqx.tree_pformat(algo, short_arrays=True, width=100_000),  # one line
        T=T,
        window=window,
        rtol=rtol,
        rows=rows,
    )
