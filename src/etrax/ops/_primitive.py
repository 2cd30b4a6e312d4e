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
import jax.numpy as jnp
from jaxtyping import Array

from .._compat import Primitive, define_primitive, shape_struct
from .._compat import bind as _bind
from .._errors import OpArgumentError
from .._typing import Params, Shape
from ._util import operand, sum_leading

__all__ = [
    "ETPOpSpec",
    "ETPRules",
    "Factorization",
    "bind",
    "etp_spec",
    "is_etp_primitive",
    "register_primitive",
    "register_rules",
    "registered_primitives",
]


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
class ContractRule(Protocol):
    def __call__(
        self, x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params, /
    ) -> dict[str, Array]: ...


@runtime_checkable
class ChainRule(Protocol):
    def __call__(
        self, grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params, /
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
class EffectiveShapeRule(Protocol):
    def __call__(
        self, weights: Mapping[str, jax.ShapeDtypeStruct], params: Params, /
    ) -> dict[str, Shape]: ...


@runtime_checkable
class InputReprRule(Protocol):
    def __call__(self, x: Array, weights: Mapping[str, Array], params: Params, /) -> Array: ...


class Factorization(eqx.Module):
    """How an op's instantaneous trace factorises as an outer product.

    For each trainable key, ``instant(x, cot)[key] = u[..., :, None] * cot[..., None, :]``
    when ``inputs[key]`` is an array ``u`` of shape ``(*batch, I)``, or
    ``instant(x, cot)[key] = cot`` when it is `None`; the op's output positions are
    the axes of ``y`` after its `batch_ndim` leading batch axes. Online algorithms
    use this to run fused (and chunked) trace kernels.
    """

    batch_ndim: int = eqx.field(static=True)
    inputs: dict[str, Array | None]


@runtime_checkable
class FactorRule(Protocol):
    def __call__(self, x: Array | None, params: Params, /) -> Factorization: ...


def _identity_input(x: Array, weights: Mapping[str, Array], params: Params) -> Array:
    return x


class ETPRules(eqx.Module):
    """What online algorithms need to know about one ETP primitive.

    Traces live in the space of the op's *effective* trainable operands (after any
    element-wise ``weight_fn`` the primitive applies); `chain` maps gradients from
    that space back to the raw operands.

    **Arguments:**

    - `instant`: ``(x, cot, weights, params) -> trace``: the instantaneous eligibility
      ``∂h/∂θ_eff`` given ``cot = ∂h/∂y`` for one hidden-state slot, shaped like
      `param_trace_shapes` (the op's batch axes kept).
    - `scale`: ``(hvec, trace, params) -> trace``: multiply a weight-shaped trace by an
      output-shaped vector along the link from each weight to its output (dense:
      column ``o`` of ``ε[i, o]`` times ``hvec[o]``).
    - `param_trace_shapes`: ``(x, y, weights, params) -> {key: shape}`` of one state
      slot of the per-parameter trace.
    - `solve`: ``(signal, trace, weights, params) -> grads``: contract an
      output-shaped signal with a trace into effective-operand gradients, summing
      the op's batch axes. Default: ``scale`` then a sum over the leading axes.
    - `contract`: ``(x, cot, weights, params) -> grads``: the effective-operand
      gradient for output cotangent ``cot``. Default: ``solve(cot, instant(x, 1))``.
    - `chain`: ``(grads, weights, params) -> grads``: effective to raw operands (the
      VJP of any ``weight_fn``). Default: identity.
    - `factor`: optional ``(x, params) -> Factorization`` enabling fused kernels.
    - `effective_shapes`: ``(weights, params) -> {key: shape}`` of the effective
      operands the traces describe, keyed like the traces. Default: the trainable
      operands themselves. An op may trace one effective operand for several raw
      ones (LoRA traces ``W = α·B·A``); `chain` maps back to the raw keys.
    - `input_repr`: what an input trace low-pass filters (default: ``x`` itself).

    `weight_grad` (``chain ∘ contract``) must equal `jax.vjp` of the op with respect
    to its raw trainable operands.
    """

    instant: InstantRule
    scale: ScaleRule
    param_trace_shapes: TraceShapeRule
    solve_rule: SolveRule | None = None
    contract_rule: ContractRule | None = None
    chain_rule: ChainRule | None = None
    factor: FactorRule | None = None
    effective_shape_rule: EffectiveShapeRule | None = None
    input_repr: InputReprRule = _identity_input

    def effective_shapes(
        self, weights: Mapping[str, jax.ShapeDtypeStruct], params: Params
    ) -> dict[str, Shape]:
        """Shapes of the effective operands, keyed like the traces."""
        if self.effective_shape_rule is not None:
            return {k: tuple(v) for k, v in self.effective_shape_rule(weights, params).items()}
        return {k: tuple(v.shape) for k, v in weights.items()}

    def solve(
        self,
        signal: Array,
        trace: Mapping[str, Array],
        weights: Mapping[str, Array],
        params: Params,
    ) -> dict[str, Array]:
        """Effective-operand gradients from an output-shaped signal and a trace."""
        if self.solve_rule is not None:
            return self.solve_rule(signal, trace, weights, params)
        scaled = self.scale(signal, trace, params)
        structs = {k: shape_struct(jnp.shape(v), jnp.result_type(v)) for k, v in weights.items()}
        shapes = self.effective_shapes(structs, params)
        return {k: sum_leading(v, len(shapes[k])) for k, v in scaled.items()}

    def contract(
        self, x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
    ) -> dict[str, Array]:
        """Effective-operand gradients for an output cotangent."""
        if self.contract_rule is not None:
            return self.contract_rule(x, cot, weights, params)
        return self.solve(
            cot, self.instant(x, jnp.ones_like(cot), weights, params), weights, params
        )

    def chain(
        self, grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params
    ) -> dict[str, Array]:
        """Map effective-operand gradients to raw-operand gradients."""
        if self.chain_rule is not None:
            return self.chain_rule(grads, weights, params)
        return dict(grads)

    def weight_grad(
        self, x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
    ) -> dict[str, Array]:
        """Raw-operand gradients for an output cotangent (equals `jax.vjp` of the op)."""
        return self.chain(self.contract(x, cot, weights, params), weights, params)


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

    **Returns:** the new `jax.extend.core.Primitive`; apply it with
    ``etrax.ops.bind(prim, *operands, **params)`` inside a model's ``update``.

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
        raise OpArgumentError(
            f"register_primitive: `name` must be a non-empty string, got {name!r}."
        )
    if not callable(impl):
        raise OpArgumentError(
            f"register_primitive: `impl` must be callable, got {type(impl).__name__}."
        )
    if trainable is None:
        trainable_fn: Callable[[Params], Mapping[str, int]] = _default_trainable
    elif callable(trainable):
        trainable_fn = trainable
    else:
        fixed = dict(trainable)
        if not fixed:
            raise OpArgumentError("register_primitive: `trainable` must name at least one operand.")

        def trainable_fn(params: Params) -> Mapping[str, int]:
            return fixed

    index_obj: object = x_index
    if index_obj is not None and (
        isinstance(index_obj, bool) or not isinstance(index_obj, int) or index_obj < 0
    ):
        raise OpArgumentError(
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


def bind(primitive: Primitive, *operands: Any, **params: Any) -> Array:
    """Apply a (single-output) ETP primitive to its operands: a typed
    ``primitive.bind(*operands, **params)``.

    Use it inside a layer's ``update``; operands are converted with `jnp.asarray` (one
    that is not array-like is an `OpArgumentError`).
    """
    spec = etp_spec(primitive)
    if spec is None:
        raise OpArgumentError(
            f"etrax.ops.bind: {primitive!r} is not an ETP primitive; create it with "
            "etrax.register_primitive."
        )
    n = len(operands)
    slots = dict(spec.trainable(params))
    if spec.x_index is not None:
        slots["x (x_index)"] = spec.x_index
    outside = {k: i for k, i in slots.items() if not 0 <= i < n}
    if outside:
        raise OpArgumentError(
            f"{primitive.name}: bound with {n} operand(s), but its registration names "
            f"operand indices {outside} (trainable operands and x_index count from 0 over "
            "all the operands); pass those operands, or fix trainable= / x_index= in "
            "etrax.register_primitive."
        )
    arrays = (operand(primitive.name, f"operand {i}", op) for i, op in enumerate(operands))
    return _bind(primitive, *arrays, **params)


def register_rules(primitive: Primitive, rules: ETPRules) -> None:
    """Attach (or replace) the `ETPRules` of an already registered primitive."""
    spec = _REGISTRY.get(primitive)
    if spec is None:
        raise OpArgumentError(
            f"register_rules: {primitive!r} is not an ETP primitive; create it with "
            "etrax.register_primitive first."
        )
    if not isinstance(rules, ETPRules):
        raise OpArgumentError(
            f"register_rules: expected an etrax.ETPRules, got {type(rules).__name__}."
        )
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
