"""The ETP primitive protocol: how a weight operation is recognised and what
online algorithms need to know about it.

An *ETP primitive* (eligibility-trace-propagating primitive) is a JAX primitive
registered here. The compiler recognises weight operations only by membership in
this registry (never by name), and the online algorithms consult the op's
`ETPRules` to move between output-shaped quantities (``∂h/∂y``, learning
signals) and weight-shaped ones (traces, gradients).

Terms: ``x`` is the op's data input, ``y`` its output, and the *trainable
operands* are the inputs named by `ETPOpSpec.trainable` (``'weight'``, ``'bias'``,
...). Rules see the op's own batch axes (e.g. the leading ``B`` of a batched
``x``); broadcasting of ``y`` onto a larger hidden state is handled by the caller.
"""

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
from jaxtyping import Array

from .._compat import Primitive, define_primitive
from .._typing import Params, Shape

__all__ = [
    "ETPOpSpec",
    "ETPRules",
    "etp_spec",
    "is_etp_primitive",
    "register_primitive",
    "register_rules",
    "registered_primitives",
]


@runtime_checkable
class WeightGradRule(Protocol):
    def __call__(
        self, x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params, /
    ) -> dict[str, Array]: ...


@runtime_checkable
class InstantRule(Protocol):
    def __call__(
        self, x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params, /
    ) -> dict[str, Array]: ...


@runtime_checkable
class ScaleRule(Protocol):
    def __call__(
        self, hvec: Array, trace: Mapping[str, Array], params: Params, /
    ) -> dict[str, Array]: ...


@runtime_checkable
class SolveRule(Protocol):
    def __call__(
        self,
        signal: Array,
        trace: Mapping[str, Array],
        weights: Mapping[str, Array],
        params: Params,
        /,
    ) -> dict[str, Array]: ...


@runtime_checkable
class TraceShapeRule(Protocol):
    def __call__(
        self,
        x: jax.ShapeDtypeStruct | None,
        y: jax.ShapeDtypeStruct,
        weights: Mapping[str, jax.ShapeDtypeStruct],
        params: Params,
        /,
    ) -> dict[str, Shape]: ...


@runtime_checkable
class InputReprRule(Protocol):
    def __call__(self, x: Array, weights: Mapping[str, Array], params: Params, /) -> Array: ...


def _identity_input(x: Array, weights: Mapping[str, Array], params: Params) -> Array:
    return x


class ETPRules(eqx.Module):
    """What online algorithms need to know about one ETP primitive.

    Traces live in the space of the op's *effective* trainable operands (after any
    element-wise ``weight_fn`` the primitive applies); `solve` and `weight_grad`
    return gradients with respect to the raw operands.

    **Arguments:**

    - `weight_grad`: ``(x, cot, weights, params) -> grads``: the VJP of ``y`` with
      respect to the raw trainable operands at cotangent ``cot`` (shaped like
      ``y``), summed over the op's batch axes. Must equal `jax.vjp` of the op.
    - `instant`: ``(x, cot, weights, params) -> trace``: the instantaneous
      eligibility ``∂h/∂θ_eff`` given ``cot = ∂h/∂y`` for one hidden state slot,
      shaped like `param_trace_shapes` (batch axes kept).
    - `scale`: ``(hvec, trace, params) -> trace``: multiply a weight-shaped trace by
      an output-shaped vector along the link from each weight to its output
      (dense: column ``o`` of ``ε[i, o]`` times ``hvec[o]``).
    - `solve`: ``(signal, trace, weights, params) -> grads``: contract an
      output-shaped learning signal with a trace into raw-operand gradients,
      summing the op's batch axes.
    - `param_trace_shapes`: ``(x, y, weights, params) -> {key: shape}``: the shape of
      one state slot of the per-parameter trace.
    - `input_repr`: what an input trace low-pass filters (default: ``x`` itself).
    """

    weight_grad: WeightGradRule
    instant: InstantRule
    scale: ScaleRule
    solve: SolveRule
    param_trace_shapes: TraceShapeRule
    input_repr: InputReprRule = _identity_input


class ETPOpSpec(eqx.Module):
    """Static description of a registered ETP primitive.

    **Arguments:**

    - `primitive`: the JAX primitive.
    - `trainable`: maps the equation's parameters to ``{key: operand index}`` of
      the trainable operands, e.g. ``{'weight': 1, 'bias': 2}``.
    - `x_index`: operand index of the data input ``x``, or `None` when the op has
      no data input (``element_wise``).
    - `gradient_enabled`: the op is transparent to the compiler: it never cuts a
      ``y → h`` path or a transition (only sensible for ops with no data input).
    - `rules`: the `ETPRules`, or `None` if none were registered yet (the op is then
      recognised by the compiler but cannot be traced by an online algorithm).
    """

    primitive: Primitive = eqx.field(static=True)
    trainable: Callable[[Params], Mapping[str, int]] = eqx.field(static=True)
    x_index: int | None = eqx.field(static=True)
    gradient_enabled: bool = eqx.field(static=True)
    rules: ETPRules | None = eqx.field(static=True)

    @property
    def name(self) -> str:
        return str(self.primitive.name)


# The op registry: the only module-level mutable state in etrax.
_REGISTRY: dict[Primitive, ETPOpSpec] = {}


def _default_trainable(params: Params) -> Mapping[str, int]:
    return {"weight": 1}


def register_primitive(
    name: str,
    impl: Callable[..., Array],
    *,
    trainable: Mapping[str, int] | Callable[[Params], Mapping[str, int]] | None = None,
    x_index: int | None = 0,
    gradient_enabled: bool = False,
    rules: ETPRules | None = None,
    batch_rule: Callable[..., tuple[Array, int]] | None = None,
) -> Primitive:
    """Create and register a new ETP primitive.

    The primitive's evaluation, abstract evaluation, lowering, JVP (hence
    reverse mode) and batching are all derived from `impl`; `batch_rule` may
    replace the default ``jax.vmap(impl)`` batching (e.g. to keep the primitive
    visible to the compiler when only ``x`` is batched).

    **Arguments:**

    - `name`: the primitive's name, as shown in jaxprs and diagnostics.
    - `impl`: ``impl(*operands, **params) -> y``; all params must be hashable.
    - `trainable`: ``{key: operand index}`` of the trainable operands, or a function
      of the equation's params returning it. Default ``{'weight': 1}``.
    - `x_index`: operand index of the data input, or `None`.
    - `gradient_enabled`: see `ETPOpSpec`.
    - `rules`: the op's `ETPRules` (may also be given later with `register_rules`).
    - `batch_rule`: a JAX batching rule ``(args, dims, **params) -> (out, out_dim)``.

    **Returns:** the new `jax.extend.core.Primitive`; bind it with
    ``prim.bind(*operands, **params)`` inside a model's ``update``.

    !!! Example

        ```python
        def scaled_matmul_impl(x, w, *, scale):
            return scale * (x @ w)

        scaled_matmul_p = etrax.register_primitive(
            "scaled_matmul", scaled_matmul_impl, rules=my_rules
        )
        ```
    """
    name_obj: object = name
    if not isinstance(name_obj, str) or not name_obj:
        raise TypeError(f"register_primitive: `name` must be a non-empty string, got {name!r}.")
    if not callable(impl):
        raise TypeError(f"register_primitive: `impl` must be callable, got {type(impl).__name__}.")
    if trainable is None:
        trainable_fn: Callable[[Params], Mapping[str, int]] = _default_trainable
    elif callable(trainable):
        trainable_fn = trainable
    else:
        fixed = dict(trainable)
        if not fixed:
            raise ValueError("register_primitive: `trainable` must name at least one operand.")

        def trainable_fn(params: Params) -> Mapping[str, int]:
            return fixed

    index_obj: object = x_index
    if index_obj is not None and (
        isinstance(index_obj, bool) or not isinstance(index_obj, int) or index_obj < 0
    ):
        raise ValueError(
            f"register_primitive: `x_index` must be a non-negative int or None, got {x_index!r}."
        )
    prim = define_primitive(name, impl, batch_rule)
    _REGISTRY[prim] = ETPOpSpec(
        primitive=prim,
        trainable=trainable_fn,
        x_index=x_index,
        gradient_enabled=bool(gradient_enabled),
        rules=rules,
    )
    return prim


def register_rules(primitive: Primitive, rules: ETPRules) -> None:
    """Attach (or replace) the `ETPRules` of an already registered primitive."""
    spec = _REGISTRY.get(primitive)
    if spec is None:
        raise ValueError(
            f"register_rules: {primitive!r} is not an ETP primitive; create it with "
            "etrax.register_primitive first."
        )
    if not isinstance(rules, ETPRules):
        raise TypeError(f"register_rules: expected an etrax.ETPRules, got {type(rules).__name__}.")
    _REGISTRY[primitive] = ETPOpSpec(
        primitive=primitive,
        trainable=spec.trainable,
        x_index=spec.x_index,
        gradient_enabled=spec.gradient_enabled,
        rules=rules,
    )


def etp_spec(primitive: Any) -> ETPOpSpec | None:
    """The `ETPOpSpec` of `primitive`, or `None` if it is not an ETP primitive."""
    try:
        return _REGISTRY.get(primitive)
    except TypeError:  # unhashable
        return None


def is_etp_primitive(primitive: Any) -> bool:
    """Whether `primitive` is a registered ETP primitive."""
    return etp_spec(primitive) is not None


def registered_primitives() -> tuple[Primitive, ...]:
    """All registered ETP primitives, in registration order."""
    return tuple(_REGISTRY)
