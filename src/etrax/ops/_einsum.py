"""``jnp.einsum(equation, x, f(W))`` as an ETP primitive.

Letters of the equation are classified once: *sample* letters appear in ``x`` and
the output but not in the weight (batch or position axes, kept in the trace);
*weight* letters are the weight's axes, each either in the output (the weight
element reaches that output position) or contracted with ``x``. Supported:
two operands, an explicit ``->``, no ellipsis, no repeated letter within an
operand, and every weight letter appearing in ``x`` or in the output (otherwise
one weight element would reach several outputs and the trace would not be
per-position).
"""

from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._compat import bind
from .._errors import OpArgumentError
from .._typing import Params, Shape
from ._primitive import ETPRules, register_primitive
from ._util import chain_transform, check_transform, operand

__all__ = ["EinsumSpec", "einsum", "einsum_p", "parse_einsum"]

Transform = Callable[[Array], Array] | None


class EinsumSpec(eqx.Module):
    """A parsed, supported einsum equation (hashable, static)."""

    x: str = eqx.field(static=True)
    w: str = eqx.field(static=True)
    out: str = eqx.field(static=True)
    sample: str = eqx.field(static=True)

    @property
    def equation(self) -> str:
        return f"{self.x},{self.w}->{self.out}"


def parse_einsum(equation: str) -> EinsumSpec:
    """Parse and validate an equation; raises `ValueError` saying what is unsupported."""
    eq = equation.replace(" ", "")
    hint = (
        " etrax.einsum supports 'x,w->out' with two operands, lowercase letters, no ellipsis, "
        "and every weight axis either contracted with x or kept in the output."
    )
    if "..." in eq or "->" not in eq:
        raise OpArgumentError(
            f"einsum equation {equation!r} needs an explicit '->' and no ellipsis.{hint}"
        )
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        raise OpArgumentError(
            f"einsum equation {equation!r} has {len(ops)} operands; exactly 2.{hint}"
        )
    xs, ws = ops
    for name, spec in (("x", xs), ("weight", ws), ("output", out)):
        if name == "output" and not spec:
            continue  # a scalar output ('i,i->'), as jnp.einsum takes it
        if not spec.isalpha() or not spec.islower():
            raise OpArgumentError(
                f"einsum equation {equation!r}: the {name} spec {spec!r} must be lowercase "
                f"letters.{hint}"
            )
        if len(set(spec)) != len(spec):
            raise OpArgumentError(
                f"einsum equation {equation!r}: the {name} spec {spec!r} repeats a letter.{hint}"
            )
    stray = [c for c in out if c not in xs and c not in ws]
    if stray:
        raise OpArgumentError(
            f"einsum equation {equation!r}: output letters {stray} appear in no operand.{hint}"
        )
    summed = [c for c in ws if c not in xs and c not in out]
    if summed:
        raise OpArgumentError(
            f"einsum equation {equation!r}: weight axes {summed} are summed away without x, so "
            f"one weight element reaches several outputs and cannot be traced per position.{hint}"
        )
    sample = "".join(c for c in out if c in xs and c not in ws)
    return EinsumSpec(x=xs, w=ws, out=out, sample=sample)


def _impl(x: Array, w: Array, *, spec: EinsumSpec, weight_fn: Transform) -> Array:
    return jnp.einsum(spec.equation, x, w if weight_fn is None else weight_fn(w))


def _instant(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    s: EinsumSpec = params["spec"]
    return {"weight": jnp.einsum(f"{s.x},{s.out}->{s.sample}{s.w}", x, cot)}


def _scale(hvec: Array, trace: Mapping[str, Array], params: Params) -> dict[str, Array]:
    s: EinsumSpec = params["spec"]
    return {
        "weight": jnp.einsum(f"{s.sample}{s.w},{s.out}->{s.sample}{s.w}", trace["weight"], hvec)
    }


def _solve(
    signal: Array, trace: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    s: EinsumSpec = params["spec"]
    return {"weight": jnp.einsum(f"{s.sample}{s.w},{s.out}->{s.w}", trace["weight"], signal)}


def _contract(
    x: Array | None, cot: Array, weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    assert x is not None
    s: EinsumSpec = params["spec"]
    return {"weight": jnp.einsum(f"{s.x},{s.out}->{s.w}", x, cot)}


def _chain(
    grads: Mapping[str, Array], weights: Mapping[str, Array], params: Params
) -> dict[str, Array]:
    return {"weight": chain_transform(params["weight_fn"], weights["weight"], grads["weight"])}


def _trace_shapes(
    x: jax.ShapeDtypeStruct | None,
    y: jax.ShapeDtypeStruct,
    weights: Mapping[str, jax.ShapeDtypeStruct],
    params: Params,
) -> dict[str, Shape]:
    s: EinsumSpec = params["spec"]
    sample = tuple(y.shape[s.out.index(c)] for c in s.sample)
    return {"weight": sample + tuple(weights["weight"].shape)}


EINSUM_RULES = ETPRules(
    instant=_instant,
    scale=_scale,
    param_trace_shapes=_trace_shapes,
    solve_rule=_solve,
    contract_rule=_contract,
    chain_rule=_chain,
)

einsum_p = register_primitive("etp_einsum", _impl, rules=EINSUM_RULES)


def _check_sizes(equation: str, x_shape: Shape, w_shape: Shape) -> None:
    """A `ValueError` when a label has two sizes in `x` and `weight`."""
    terms = equation.replace(" ", "").split("->")[0].split(",")
    if len(terms) != 2 or "." in equation:
        return  # parse_einsum has checked the form; an ellipsis is left to JAX
    sizes: dict[str, int] = {}
    for labels, shape, name in ((terms[0], x_shape, "x"), (terms[1], w_shape, "weight")):
        for label, size in zip(labels, shape, strict=False):
            if sizes.setdefault(label, size) != size:
                raise OpArgumentError(
                    f"einsum {equation!r}: label {label!r} has size {sizes[label]} in x but "
                    f"{size} in {name} (x {tuple(x_shape)}, weight {tuple(w_shape)})"
                )


def einsum(equation: str, x: ArrayLike, weight: ArrayLike, *, weight_fn: Transform = None) -> Array:
    """``jnp.einsum(equation, x, weight_fn(weight))`` whose weight is traced online.

    !!! Example

        ```python
        y = etrax.einsum("bti,io->bto", x, W)   # a position-wise linear map
        ```
    """
    spec = parse_einsum(equation)
    x = operand("einsum", "x", x)
    weight = operand("einsum", "weight", weight)
    check_transform("einsum: weight_fn", weight_fn, weight)
    if x.ndim != len(spec.x) or weight.ndim != len(spec.w):
        raise OpArgumentError(
            f"einsum {equation!r}: x has {x.ndim} axes and weight {weight.ndim}, the equation "
            f"says {len(spec.x)} and {len(spec.w)}"
        )
    _check_sizes(equation, x.shape, weight.shape)
    return bind(einsum_p, x, weight, spec=spec, weight_fn=weight_fn)
