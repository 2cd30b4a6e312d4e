"""The one place where etrax touches JAX internals or version-dependent APIs.

Everything else in etrax uses `jax`, `jax.extend.core` and the helpers below.
If a JAX release moves one of these names, this module is the only one to fix.
"""

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex

import jax
import jax.extend.core as jex
import jax.extend.linear_util as _lu
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero as _SymbolicZero
from jax.interpreters import ad, batching, mlir

__all__ = [
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "ShapedArray",
    "Var",
    "array_key",
    "at_top_level",
    "aval_of",
    "bind",
    "bind_equation",
    "bind_in_parts",
    "call_body",
    "constant_outputs",
    "custom_jvp_rules",
    "define_primitive",
    "derivative_rules_key",
    "differentiable_positions",
    "equation_context",
    "equation_location",
    "equation_vjp",
    "eval_jaxpr",
    "exclude_from_locations",
    "has_user_frame",
    "inner_closed_jaxprs",
    "is_tracer",
    "match_varying",
    "replace_jaxpr",
    "replace_outvars",
    "shape_struct",
    "shaped_array",
    "struct_of",
    "vary_like",
    "vary_tree",
    "with_traceback_of",
]

Primitive = jex.Primitive
Var = jex.Var
Literal = jex.Literal
Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr
JaxprEqn = jex.JaxprEqn
DropVar = jex.DropVar
ShapedArray = jax.core.ShapedArray

# Call-like primitives whose body is spliced into the parent by `inline_calls`.
_INLINED_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"})


def is_tracer(value: object) -> bool:
    """Whether `value` is a JAX tracer (i.e. we are inside a JAX transformation)."""
    return isinstance(value, jax.core.Tracer)


def at_top_level() -> bool:
    """Whether JAX runs operations eagerly here: no transformation (`jax.jit`,
    `jax.vmap`, `jax.grad`, ...) is tracing. False where this JAX keeps its trace
    state elsewhere, which only costs the callers an XLA program they could skip."""
    try:
        from jax._src import core
    except ImportError:  # pragma: no cover - a JAX without the module
        return False
    trace = getattr(getattr(core, "trace_ctx", None), "trace", None)
    eval_trace = getattr(core, "EvalTrace", None)
    return isinstance(eval_trace, type) and isinstance(trace, eval_trace)


def forward_mode(tree: Any) -> bool:
    """Whether a leaf of `tree` is traced by forward-mode differentiation (`jax.jvp`,
    `jax.jacfwd`) outside a `jax.jit`; reverse mode (`jax.grad`, `jax.vjp`) traces with
    another tracer. False where this JAX has no such tracer type."""
    jvp_tracer = getattr(getattr(jax.interpreters, "ad", None), "JVPTracer", None)
    if not isinstance(jvp_tracer, type):
        return False
    return any(isinstance(leaf, jvp_tracer) for leaf in jax.tree.leaves(tree))


def shaped_array(shape: Sequence[int], dtype: Any, weak_type: bool = False) -> Any:
    """A `ShapedArray` abstract value."""
    return jax.core.ShapedArray(tuple(shape), dtype, weak_type=weak_type)


def shape_struct(shape: Sequence[int], dtype: Any, weak_type: bool = False) -> jax.ShapeDtypeStruct:
    """A `jax.ShapeDtypeStruct` (typed wrapper: JAX's constructor is unannotated)."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, weak_type=weak_type)  # type: ignore[no-untyped-call]


def aval_of(atom: Any) -> Any:
    """The abstract value (shape, dtype, weak_type) of a jaxpr variable or literal."""
    return atom.aval


def struct_of(atom: Any) -> jax.ShapeDtypeStruct:
    """A `jax.ShapeDtypeStruct` describing a jaxpr variable (weak type kept)."""
    aval = atom.aval
    return shape_struct(aval.shape, aval.dtype, weak_type=bool(getattr(aval, "weak_type", False)))


def bind(primitive: Any, *operands: Any, **params: Any) -> jax.Array:
    """``primitive.bind`` for a single-result primitive (JAX's `bind` is unannotated)."""
    out: jax.Array = primitive.bind(*operands, **params)
    return out


def replace_outvars(jaxpr: Any, outvars: Sequence[Any]) -> Any:
    """A copy of `jaxpr` with other output atoms (same variables, constants and equations)."""
    return jaxpr.replace(outvars=list(outvars))


def replace_jaxpr(jaxpr: Any, **fields: Any) -> Any:
    """`Jaxpr.replace` (keeps valid debug info when inputs or outputs change)."""
    return jaxpr.replace(**fields)


def call_body(eqn: Any) -> "jex.ClosedJaxpr | None":
    """The body of a call-like equation (`jit`, `closed_call`, `remat`) that can be
    inlined into its parent, or `None` for any other equation."""
    if eqn.primitive.name not in _INLINED_CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, jex.ClosedJaxpr):
            return body
        if isinstance(body, jex.Jaxpr):
            return jex.ClosedJaxpr(body, ())
    return None


def inner_closed_jaxprs(eqn: Any) -> list["jex.ClosedJaxpr"]:
    """Every sub-jaxpr held in an equation's parameters, closed."""
    found: list[jex.ClosedJaxpr] = []
    for value in eqn.params.values():
        items = value if isinstance(value, tuple | list) else (value,)
        for item in items:
            if isinstance(item, jex.ClosedJaxpr):
                found.append(item)
            elif isinstance(item, jex.Jaxpr):
                found.append(jex.ClosedJaxpr(item, ()))
    return found


def bind_equation(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Re-bind one jaxpr equation on new input values; always returns a list."""
    with equation_context(eqn):
        axes = [_varying_axes(v) for v in invals]
        if not any(axes):  # outside `jax.shard_map`: the equation as it is
            return _bind(eqn, invals)
        invals = _matched(invals, axes)
        body = call_body(eqn)
        if body is not None:  # a nested `jit`: its jaxpr's types predate the map
            return eval_jaxpr(body.jaxpr, body.consts, *invals)
        rebind = _REBIND_IN_MAP.get(eqn.primitive.name)
        return _bind(eqn, invals) if rebind is None else rebind(eqn, invals)


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluate `jaxpr` equation by equation with `bind_equation` (a thin, explicit
    version of JAX's own evaluator that also casts invariant operands to varying
    inside `jax.shard_map`, as JAX's `lax` functions do when tracing user code)."""
    return _evaluate(bind_equation, jaxpr, consts, args)


def _evaluate(
    bind: Callable[[Any, list[Any]], list[Any]], jaxpr: Any, consts: Sequence[Any], args: Any
) -> list[Any]:
    """`jaxpr` evaluated equation by equation, each with ``bind(eqn, invals)``."""
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        outs = bind(eqn, [_read(env, a) for a in eqn.invars])
        for v, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex.DropVar):
                env[v] = val
    return [_read(env, a) for a in jaxpr.outvars]


def _read(env: dict[Any, Any], atom: Any) -> Any:
    # module level, not a closure: no new function per evaluated jaxpr
    return atom.val if isinstance(atom, jex.Literal) else env[atom]


def _varying_axes(value: Any) -> frozenset[Any] | None:
    try:
        aval = jax.typeof(value)
    except TypeError:
        return None
    mat = getattr(aval, "mat", None)
    axes = getattr(mat, "varying", None)
    if axes is None:
        axes = getattr(aval, "vma", None)
    return frozenset(axes) if axes is not None else None


def match_varying(values: Sequence[Any]) -> list[Any]:
    """Inside `jax.shard_map`, cast inputs that are invariant over a manual mesh axis
    to varying where another input varies over it (what JAX's `lax` functions do
    when tracing user code; re-binding a jaxpr made outside needs it explicitly)."""
    return _matched(values, [_varying_axes(v) for v in values])


def _matched(values: Sequence[Any], axes: Sequence[frozenset[Any] | None]) -> list[Any]:
    known = {a for a in axes if a is not None}
    if len(known) <= 1:
        return list(values)
    union = frozenset().union(*known)
    return [
        jax.lax.pcast(v, tuple(sorted(union - a, key=str)), to="varying")
        if a is not None and union - a
        else v
        for v, a in zip(values, axes, strict=True)
    ]


def vary_like(value: Any, like: Any) -> Any:
    """`value` cast to vary over the same manual mesh axes as `like` (a no-op outside
    `jax.shard_map`), e.g. for tangents built with `jnp.eye` for a varying primal."""
    want = _varying_axes(like)
    have = _varying_axes(value)
    if not want or have is None or want <= have:
        return value
    return jax.lax.pcast(value, tuple(sorted(want - have, key=str)), to="varying")


def vary_tree(tree: Any, *likes: Any) -> Any:
    """Every leaf of `tree` cast to vary over all manual mesh axes that any leaf of
    `likes` varies over (a no-op outside `jax.shard_map`): initial `lax.scan`
    carries must already vary like the values the loop body produces."""
    axes: frozenset[Any] = frozenset()
    for leaf in jax.tree.leaves(likes):
        found = _varying_axes(leaf)
        if found:
            axes = axes | found
    if not axes:
        return tree

    def cast(leaf: Any) -> Any:
        have = _varying_axes(leaf)
        if have is None or axes <= have:
            return leaf
        return jax.lax.pcast(leaf, tuple(sorted(axes - have, key=str)), to="varying")

    return jax.tree.map(cast, tree)


def no_batching_rule(error: NotImplementedError) -> bool:
    """Whether `error` is JAX's report of a primitive with no batching rule (such as
    `jax.experimental.sparse`'s ``csr_matvec``), which `jax.vmap` cannot map."""
    return "Batching rule for" in str(error)


def map_over(
    fn: Callable[..., Any],
    *args: Any,
    axis: int = 0,
    out_axis: int = 0,
    axis_size: int | None = None,
) -> Any:
    """``jax.vmap(fn, axis, out_axis, axis_size)(*args)`` (every leaf of `args` mapped
    along `axis`). Where `fn` binds a primitive with no batching rule, the same
    result from `jax.lax.map`: one application per index, in sequence."""
    try:
        return jax.vmap(fn, in_axes=axis, out_axes=out_axis, axis_size=axis_size)(*args)
    except NotImplementedError as error:
        if not no_batching_rule(error):
            raise
    moved = jax.tree.map(lambda a: jnp.moveaxis(a, axis, 0), args)
    if jax.tree.leaves(moved):
        out = jax.lax.map(lambda xs: fn(*xs), moved)
    else:  # nothing to map over but the count
        assert axis_size is not None
        out = jax.lax.map(lambda _: fn(*args), jnp.arange(axis_size))
    return jax.tree.map(lambda o: jnp.moveaxis(o, 0, out_axis), out)


def jacobian(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``jax.jacfwd(fn)(x)``, shaped ``(*out, *x.shape)``. Where `fn` binds a primitive
    with no batching rule, the same columns from one `jax.jvp` per input element under
    `jax.lax.map`."""
    try:
        jac: jax.Array = jax.jacfwd(fn)(x)
        return jac
    except NotImplementedError as error:
        if not no_batching_rule(error):
            raise
    n = math.prod(x.shape)
    basis = vary_like(jnp.eye(n, dtype=x.dtype).reshape((n, *x.shape)), x)
    cols = jax.lax.map(lambda v: jax.jvp(fn, (x,), (v,))[1], basis)  # (n, *out)
    out_shape = cols.shape[1:]
    return jnp.moveaxis(cols, 0, -1).reshape((*out_shape, *x.shape))


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    bound = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bound, tuple):  # older JAX: (subfuns, params)
        subfuns, params = bound
    else:
        subfuns, params = [], bound
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _bind_custom_jvp(
    eqn: Any, invals: Sequence[Any], evaluate: Callable[..., list[Any]] = eval_jaxpr
) -> list[Any]:
    """Re-bind a ``custom_jvp_call`` (a surrogate spike, `jax.nn.relu`) inside
    `jax.shard_map` on inputs that vary over a mesh axis. JAX re-traces the call's
    function and, when differentiated, its JVP rule from jaxprs made outside the map,
    whose equations (``x >= 0``) mix varying values with invariant literals; both are
    re-evaluated here through `evaluate` (`eval_jaxpr`), which casts such operands to
    varying as tracing user code inside the map would have. The custom JVP rule is
    kept."""
    params = dict(eqn.params)
    call = params.pop("call_jaxpr")
    n_consts = params.pop("num_consts")
    rule = params.pop("jvp_jaxpr_fun")

    def fun(*args: Any) -> list[Any]:
        return evaluate(call.jaxpr, call.consts, *args)

    def jvp(*xs: Any) -> list[Any]:
        half = len(xs) // 2  # primals then tangents, each led by the call's constants
        primals, tangents = xs[n_consts:half], xs[half + n_consts :]
        zeros = [isinstance(t, _SymbolicZero) for t in tangents]
        # the rule's jaxpr is traced once and memoised on the equation: trace it as
        # at compile time, outside the map, so that no mesh is baked into it
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            jaxpr, consts, out_zeros = rule.call_wrapped(*zeros)
        given = [t for t, z in zip(tangents, zeros, strict=True) if not z]
        out = evaluate(jaxpr, consts, *primals, *given)
        out_primals, nonzero = out[: len(out_zeros)], iter(out[len(out_zeros) :])
        out_tangents = [
            _SymbolicZero(jax.typeof(p).to_tangent_aval()) if z else next(nonzero)
            for p, z in zip(out_primals, out_zeros, strict=True)
        ]
        return [*out_primals, *out_tangents]

    wrapped = (
        _lu.wrap_init(fun, debug_info=call.jaxpr.debug_info),
        _lu.wrap_init(jvp, debug_info=rule.debug_info),
    )
    return list(eqn.primitive.bind(*invals, subfuns=wrapped, **params))


def custom_jvp_rules(eqn: Any) -> list["jex.ClosedJaxpr"]:
    """The jaxprs of a ``custom_jvp_call``'s JVP rule as JAX traces them on the call's
    own input shapes: one, or with symbolic zeros one for each set of inputs whose
    tangents may be zero (but not all of them: then no rule runs)."""
    rule = eqn.params["jvp_jaxpr_fun"]
    n = len(eqn.invars) - eqn.params["num_consts"]
    # without symbolic zeros, JAX gives the rule every tangent, zeros made explicit
    flags = itertools.product((False, True), repeat=n) if eqn.params["symbolic_zeros"] else [()]
    found = []
    for zeros in flags:
        zeros = zeros or (False,) * n
        if all(zeros):
            continue
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            jaxpr, consts, _ = rule.call_wrapped(*zeros)
        found.append(jex.ClosedJaxpr(jaxpr, consts))
    return found


def bind_in_parts(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Re-bind an element-wise equation on parts of its operands cut along their last
    axis (operands of the equation's shape cut, scalars as they are). A plain
    primitive is re-bound as it is. A ``custom_jvp_call`` (`jax.nn.relu`,
    `jax.nn.softplus`) keeps its JVP rule: its function and rule, whose jaxprs were
    traced on the whole operands, are evaluated on the parts, each constant they
    broadcast to the whole shape broadcast to the part's instead. The caller checks
    that every value in those jaxprs has the whole shape or none, so that nothing
    else in them depends on it."""
    if eqn.primitive.name != "custom_jvp_call":
        return bind_equation(eqn, invals)
    whole = tuple(aval_of(eqn.outvars[0]).shape)
    part = next(
        (jnp.shape(v) for v, a in zip(invals, eqn.invars, strict=True) if aval_of(a).shape),
        whole,
    )
    evaluate = functools.partial(_eval_resized, whole, tuple(part))
    with equation_context(eqn):
        return _bind_custom_jvp(eqn, match_varying(invals), evaluate)


def _eval_resized(
    whole: tuple[int, ...], part: tuple[int, ...], jaxpr: Any, consts: Sequence[Any], *args: Any
) -> list[Any]:
    """`eval_jaxpr` of an element-wise `jaxpr` traced on `whole`-shaped values, on
    `part`-shaped ones (`bind_in_parts`)."""
    return _evaluate(functools.partial(_bind_resized, whole, part), jaxpr, consts, args)


def _bind_resized(
    whole: tuple[int, ...], part: tuple[int, ...], eqn: Any, invals: list[Any]
) -> list[Any]:
    """One equation of `_eval_resized`: a scalar broadcast to `whole` is broadcast to
    `part`, and nested calls are evaluated on the parts too."""
    evaluate = functools.partial(_eval_resized, whole, part)
    body = call_body(eqn)
    if eqn.primitive.name == "broadcast_in_dim" and tuple(eqn.params["shape"]) == whole:
        with equation_context(eqn):
            dims = eqn.params["broadcast_dimensions"]
            return [jax.lax.broadcast_in_dim(invals[0], part, dims)]
    if body is not None:
        return evaluate(body.jaxpr, body.consts, *invals)
    if eqn.primitive.name == "custom_jvp_call":
        with equation_context(eqn):
            return _bind_custom_jvp(eqn, match_varying(invals), evaluate)
    return bind_equation(eqn, invals)


def _closed_fn(closed: Any, *leading: Any) -> Callable[..., list[Any]]:
    """`closed` (a `ClosedJaxpr`) as a function of its inputs after `leading`,
    evaluated with `eval_jaxpr`."""

    def fn(*args: Any) -> list[Any]:
        return eval_jaxpr(closed.jaxpr, closed.consts, *leading, *args)

    return fn


def _bind_scan(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """A ``scan`` kept whole (a long `fori_loop`), re-traced inside `jax.shard_map`
    through `jax.lax.scan` with its body evaluated by `eval_jaxpr`; the initial carry
    varies like the inputs, as the body's outputs will."""
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts = invals[:n_consts]
    carry, xs = invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]
    body = _closed_fn(p["jaxpr"], *consts)

    def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        out = body(*c, *x)
        return out[:n_carry], out[n_carry:]

    carry_out, ys = jax.lax.scan(
        step, vary_tree(list(carry), invals), list(xs), length=p["length"],
        reverse=p["reverse"], unroll=p["unroll"],
    )  # fmt: skip
    return [*carry_out, *ys]


def _bind_while(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """A ``while`` re-traced inside `jax.shard_map` through `jax.lax.while_loop`."""
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond = _closed_fn(p["cond_jaxpr"], *invals[:n_cond])
    body = _closed_fn(p["body_jaxpr"], *invals[n_cond : n_cond + n_body])
    init = vary_tree(list(invals[n_cond + n_body :]), invals)
    out: list[Any] = jax.lax.while_loop(lambda c: cond(*c)[0], lambda c: body(*c), init)
    return list(out)


def _bind_cond(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """A ``cond`` re-traced inside `jax.shard_map` through `jax.lax.switch`."""
    branches = [_closed_fn(b) for b in eqn.params["branches"]]
    return list(jax.lax.switch(invals[0], branches, *invals[1:]))


_REBIND_IN_MAP: dict[str, Callable[[Any, Sequence[Any]], list[Any]]] = {
    "custom_jvp_call": _bind_custom_jvp,
    "scan": _bind_scan,
    "while": _bind_while,
    "cond": _bind_cond,
}
"""Equations that hold jaxprs traced outside `jax.shard_map`, re-traced inside it when
an input varies over a mesh axis (their bodies mix varying and invariant values)."""


_CUSTOM_DERIVATIVES = frozenset({"custom_jvp_call", "custom_vjp_call"})


def derivative_rules_key(jaxpr: Any) -> tuple[Any, ...]:
    """What a printed jaxpr leaves out: the user's derivative rules in its
    ``custom_jvp_call`` / ``custom_vjp_call`` equations (a surrogate spike's
    pseudo-derivative), nested jaxprs included. The printed equation names the rule's
    Python function only, so two rules with the same name and other constants (a
    surrogate's ``alpha``) would print alike. A ``custom_jvp`` rule is keyed here by
    its own jaxpr (JAX traces it once per equation and keeps it), a ``custom_vjp`` rule
    by the jaxpr of the equation's pullback traced on abstract values: either shows the
    rule's arithmetic and constants. A rule that cannot be traced so is keyed by the
    equation's own identity: never equal to another compile's, which costs a
    recompile, never a wrong program."""
    found: list[Any] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CUSTOM_DERIVATIVES:
            found.append(_rule_key(eqn))
        for inner in inner_closed_jaxprs(eqn):
            if eqn.primitive.name in _CUSTOM_DERIVATIVES:
                continue  # the call's own body is printed; its rules show in the trace
            nested = derivative_rules_key(inner.jaxpr)
            if nested:
                found.append(nested)
    return tuple(found)


def differentiable_positions(eqn: Any) -> tuple[list[int], list[int]]:
    """The positions of `eqn`'s inputs and outputs of an inexact dtype: those a
    derivative of the equation has."""
    wrt = [i for i, v in enumerate(eqn.invars) if jnp.issubdtype(aval_of(v).dtype, jnp.inexact)]
    outs = [i for i, v in enumerate(eqn.outvars) if jnp.issubdtype(aval_of(v).dtype, jnp.inexact)]
    return wrt, outs


def equation_vjp(
    eqn: Any,
    args: Sequence[Any],
    bind: Callable[[Any, Sequence[Any]], list[Any]] = bind_equation,
) -> tuple[list[Any], Callable[..., Any]]:
    """`jax.vjp` of `eqn` re-bound (by `bind`) at `args`, along its inexact inputs and
    of its inexact outputs (`differentiable_positions`): those outputs and the
    pullback (cotangents of the outputs ↦ a tuple of the inputs' cotangents). A
    ``custom_vjp`` call's pullback is the user's backward rule."""
    wrt, outs = differentiable_positions(eqn)

    def differentiable(*diff: Any) -> list[Any]:
        full = list(args)
        for i, d in zip(wrt, diff, strict=True):
            full[i] = d
        result = bind(eqn, full)
        return [result[k] for k in outs]

    values, pullback = jax.vjp(differentiable, *(args[i] for i in wrt))
    return values, pullback


def _rule_key(eqn: Any) -> tuple[Any, ...]:
    if eqn.primitive.name == "custom_jvp_call":
        try:  # the rule's own jaxpr, traced once by JAX's memo (cheaper than a pullback)
            n = len(eqn.invars) - eqn.params["num_consts"]
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                jaxpr, consts, out_zeros = eqn.params["jvp_jaxpr_fun"].call_wrapped(*[False] * n)
            return ("jvp", str(jaxpr), tuple(array_key(c) for c in consts), tuple(out_zeros))
        except Exception:  # another JAX's internals: the pullback below
            pass
    avals = [aval_of(v) for v in eqn.invars]
    _, outs = differentiable_positions(eqn)

    def pullback(args: list[Any], cotangents: list[Any]) -> Any:
        return equation_vjp(eqn, args, _bind)[1](cotangents)

    structs = [shape_struct(a.shape, a.dtype) for a in avals]
    cts = [shape_struct(eqn.outvars[i].aval.shape, eqn.outvars[i].aval.dtype) for i in outs]
    try:
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            traced = jax.make_jaxpr(pullback)(structs, cts)
    except Exception:  # any failure: key by identity (safe)
        return (eqn.primitive.name, _Identity(eqn))
    consts = tuple(array_key(c) for c in traced.consts)
    return (eqn.primitive.name, str(traced.jaxpr), consts)


def array_key(value: Any) -> tuple[Any, ...]:
    """A hashable key of an array's value: shape, dtype and bytes (a typed PRNG key by
    its implementation and key data, which NumPy cannot hold)."""
    if is_prng_key(value):
        impl = str(jax.random.key_impl(value))
        return ("key", impl, *array_key(jax.random.key_data(value)))
    arr = np.asarray(value)
    return (arr.shape, str(arr.dtype), arr.tobytes())


class _Identity:
    """Equal only to itself (and hashable by identity): a key part for what has no
    structural key."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj


def exclude_from_locations(*paths: str) -> None:
    """Hide library frames (etrax's ops and compiler, brainstate) from the source
    locations JAX records, so diagnostics point at the user's model code."""
    try:
        from jax._src import source_info_util

        for path in paths:
            source_info_util.register_exclusion(path)
    except Exception:  # pragma: no cover - depends on the JAX version
        pass


def equation_context(eqn: Any) -> Any:
    """A context manager that re-binds an equation under its original source info."""
    try:
        from jax._src import source_info_util

        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
    except Exception:  # pragma: no cover - depends on the JAX version
        return contextlib.nullcontext()


def has_user_frame(eqn: Any) -> bool:
    """Whether `eqn`'s traceback holds a frame outside JAX and the libraries hidden
    from locations (`exclude_from_locations`): not so for an equation traced inside a
    library's own `jax.jit` (brainevent's products), whose traceback starts in the
    jitted function."""
    try:
        from jax._src import source_info_util

        return source_info_util.user_frame(eqn.source_info.traceback) is not None
    except Exception:  # pragma: no cover - depends on the JAX version
        return True


def with_traceback_of(eqn: Any, site: Any) -> Any:
    """`eqn` located at `site` (another equation's source info: the call it is inlined
    from), with its own name stack."""
    try:
        return eqn.replace(source_info=eqn.source_info.replace(traceback=site.traceback))
    except Exception:  # pragma: no cover - depends on the JAX version
        return eqn


def equation_location(eqn: Any) -> str:
    """A short 'file:line (function)' description of where an equation was traced."""
    try:
        from jax._src import source_info_util

        return str(source_info_util.summarize(eqn.source_info)) or "<unknown location>"
    except Exception:  # pragma: no cover - depends on the JAX version
        return "<unknown location>"


def _output_aval(out: Any) -> Any:
    """The `ShapedArray` of an `eval_shape` result, keeping the manual mesh axes it
    varies over inside `jax.shard_map` (JAX versions with varying types) so the
    primitive's output varies like its inputs, as JAX's own primitives' do."""
    mat = getattr(out, "manual_axis_type", None)
    if mat is None or not getattr(mat, "varying", None):
        return jax.core.ShapedArray(out.shape, out.dtype)
    return jax.core.ShapedArray(out.shape, out.dtype, sharding=out.sharding, manual_axis_type=mat)


def _impl_along(
    impl: Callable[..., jax.Array],
    primals: Sequence[Any],
    live: Sequence[int],
    params: dict[str, Any],
    *ops: Any,
) -> Any:
    """`impl` at `primals` with the operands at positions `live` replaced by `ops`."""
    full = list(primals)
    for n, op in zip(live, ops, strict=True):
        full[n] = op
    return impl(*full, **params)


def define_primitive(
    name: str,
    impl: Callable[..., jax.Array],
    batch_rule: Callable[..., tuple[jax.Array, int]] | None,
) -> "jex.Primitive":
    """Create a single-output JAX primitive whose every rule derives from `impl`.

    - evaluation and lowering call `impl(*operands, **params)`;
    - abstract evaluation is `jax.eval_shape(impl)`;
    - the JVP is `jax.jvp(impl)`, so reverse mode is JAX's own transpose of the
      linearised `impl`;
    - batching uses `batch_rule` if given, else `jax.vmap(impl)`.
    """
    prim = jex.Primitive(name)
    prim.def_impl(impl)  # type: ignore[no-untyped-call]  # JAX's Primitive API is unannotated

    def abstract_eval(*avals: Any, **params: Any) -> Any:
        out = jax.eval_shape(lambda *ops: impl(*ops, **params), *avals)
        return _output_aval(out)

    prim.def_abstract_eval(abstract_eval)  # type: ignore[no-untyped-call]  # unannotated in JAX

    def lower(ctx: Any, *args: Any, **params: Any) -> Any:
        return mlir.lower_fun(lambda *ops: impl(*ops, **params), multiple_results=False)(ctx, *args)

    mlir.register_lowering(prim, lower)

    def jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> Any:
        # differentiate along the operands with a tangent only: a symbolic zero
        # tangent (e.g. a weight's, when only the input is perturbed) adds no products
        live = [n for n, t in enumerate(tangents) if type(t) is not ad.Zero]
        if not live:  # JAX calls a JVP rule with at least one tangent: kept for safety
            tangents = [ad.instantiate_zeros(t) for t in tangents]  # type: ignore[no-untyped-call]
            live = list(range(len(tangents)))
        along = functools.partial(_impl_along, impl, primals, live, params)
        return jax.jvp(along, tuple(primals[n] for n in live), tuple(tangents[n] for n in live))

    ad.primitive_jvps[prim] = jvp

    def batch(args: Sequence[Any], dims: Sequence[int | None], **params: Any) -> Any:
        if batch_rule is not None:
            return batch_rule(args, dims, **params)
        out = jax.vmap(lambda *ops: impl(*ops, **params), in_axes=tuple(dims))(*args)
        return out, 0

    batching.primitive_batchers[prim] = batch
    return prim


def _np_broadcast_in_dim(
    x: np.ndarray,
    *,
    shape: Sequence[SupportsIndex],
    broadcast_dimensions: Sequence[SupportsIndex],
    **_: Any,
) -> np.ndarray:
    placed = [1] * len(shape)
    for axis, dim in zip(broadcast_dimensions, x.shape, strict=True):
        placed[int(axis)] = dim
    return np.broadcast_to(x.reshape(placed), tuple(int(d) for d in shape))


def _np_convert(x: np.ndarray, *, new_dtype: Any, **_: Any) -> np.ndarray:
    return x.astype(new_dtype)


def _np_reshape(
    x: np.ndarray, *, new_sizes: Sequence[SupportsIndex], dimensions: Any = None, **_: Any
) -> np.ndarray | None:
    return None if dimensions is not None else x.reshape(tuple(int(d) for d in new_sizes))


# The primitives `constant_outputs` evaluates with numpy: those that make zeros.
_NUMPY_RULES: dict[str, Callable[..., np.ndarray | None]] = {
    "broadcast_in_dim": _np_broadcast_in_dim,
    "convert_element_type": _np_convert,
    "reshape": _np_reshape,
}


FOLD_MAX_BYTES = 64 << 20
"""The most bytes of outputs `constant_outputs` makes with numpy. Writing them on
the host and copying them to the device costs about 0.7 ms per MiB on a 2-core CPU,
against 0.4 ms for an XLA program, whose compilation (40–100 ms, once per program)
the host path saves: past about 64 MiB the program is the faster (a large model's
D-RTRL traces reach GBs)."""


def constant_outputs(fn: Callable[..., Any], *args: Any) -> Any | None:
    """``fn(*args)`` without compiling anything, when every output of `fn` is a
    constant built from literals and closed-over arrays by broadcasts, casts and
    reshapes only (initial zero traces, a rule's PRNG key): the values are made with
    numpy and placed on the default device (a typed PRNG key as its key data, wrapped
    back). `None` when any output depends on the arguments or on another primitive
    (then run `fn` under `jax.jit`), and when the outputs hold more than
    `FOLD_MAX_BYTES`. Saves one XLA compilation per learner."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    if sum(_nbytes(struct) for struct in jax.tree.leaves(shapes)) > FOLD_MAX_BYTES:
        return None
    known: dict[Any, np.ndarray] = {}
    impls: dict[Any, Any] = {}  # the PRNG implementation of each known typed key
    for var, const in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        if is_prng_key(const):
            known[var] = np.asarray(jax.random.key_data(const))
            impls[var] = jax.random.key_impl(const)
        elif isinstance(const, (np.ndarray, jax.Array)):
            known[var] = np.asarray(const)

    def value(atom: Any) -> np.ndarray | None:
        if isinstance(atom, jex.Literal):
            return np.asarray(atom.val)
        return known.get(atom)

    for eqn in closed.jaxpr.eqns:
        rule = _NUMPY_RULES.get(eqn.primitive.name)
        ins = [value(v) for v in eqn.invars]
        if rule is None or len(eqn.outvars) != 1 or any(i is None for i in ins):
            continue
        impl = next(
            (impls[v] for v in eqn.invars if not isinstance(v, jex.Literal) and v in impls), None
        )
        params = eqn.params
        if impl is not None:  # key data: the key's own axes trail the array's
            if eqn.primitive.name != "broadcast_in_dim":
                continue
            key_data = ins[0]
            assert key_data is not None
            trailing = key_data.shape[len(eqn.invars[0].aval.shape) :]
            dims = (
                *params["broadcast_dimensions"],
                *range(len(params["shape"]), len(params["shape"]) + len(trailing)),
            )
            params = {
                **params,
                "shape": (*params["shape"], *trailing),
                "broadcast_dimensions": dims,
            }
        out = rule(*ins, **params)
        if out is not None:
            known[eqn.outvars[0]] = out
            if impl is not None:
                impls[eqn.outvars[0]] = impl
    leaves = []
    for atom in closed.jaxpr.outvars:
        val = value(atom)
        if val is None or getattr(atom.aval, "weak_type", False):
            return None
        if not isinstance(atom, jex.Literal) and atom in impls:
            key = jax.random.wrap_key_data(jax.device_put(val), impl=impls[atom])
            if key.shape != atom.aval.shape:
                return None
            leaves.append(key)
        elif val.shape != atom.aval.shape:
            return None
        else:
            leaves.append(jax.device_put(_materialised(val, atom.aval.dtype)))
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def _nbytes(struct: Any) -> int:
    """The bytes of an output of `struct`'s shape and dtype (a typed PRNG key's, its
    key data's)."""
    if jnp.issubdtype(struct.dtype, jax.dtypes.extended):
        struct = jax.eval_shape(jax.random.key_data, struct)
    return int(math.prod(struct.shape) * np.dtype(struct.dtype).itemsize)


def _materialised(val: np.ndarray, dtype: Any) -> np.ndarray:
    """`val` as a contiguous array of `dtype`. A broadcast scalar (the usual constant
    output, a zero trace) is filled directly; a zero by ``np.zeros``, whose pages the
    system hands out already zeroed, so that the copy to the device is the only pass
    over a large trace (a negative zero keeps its sign)."""
    if val.size and not any(val.strides):  # one value, broadcast
        fill = val.reshape(-1)[0]
        negative = np.issubdtype(val.dtype, np.floating) and bool(np.signbit(fill))
        if fill == 0 and not negative:
            return np.zeros(val.shape, dtype)
        return np.full(val.shape, fill, dtype)
    return np.ascontiguousarray(val, dtype=dtype)


def is_prng_key(x: Any) -> bool:
    """Whether `x` is an array of typed PRNG keys (``jax.random.key``)."""
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def not_differentiable(message: str, tree: Any, anchor: Any = None) -> Any:
    """`tree` unchanged; differentiating through it is a `TypeError` with `message`: for
    values whose derivatives etrax does not compute (online gradients, a step's
    Jacobians), which would otherwise be silently wrong or zero. `anchor` holds the
    inputs `tree` was computed from, so the check also fires where `tree` itself was
    computed out of reach of autodiff; a function that does not use `tree` is
    differentiated as usual."""
    return tree


def _nd_fwd(message: str, tree: Any, anchor: Any) -> tuple[Any, None]:
    primal = jax.custom_derivatives.CustomVJPPrimal  # each leaf, with symbolic zeros
    return jax.tree.map(
        lambda x: x.value if isinstance(x, primal) else x,
        tree,
        is_leaf=lambda x: isinstance(x, primal),
    ), None


def _nd_bwd(message: str, _: None, cotangent: Any) -> tuple[None, None]:
    zero = jax.custom_derivatives.SymbolicZero
    if all(isinstance(c, zero) for c in jax.tree.leaves(cotangent, is_leaf=_is_zero)):
        return None, None
    raise TypeError(message)


def _is_zero(x: Any) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


not_differentiable.defvjp(_nd_fwd, _nd_bwd, symbolic_zeros=True)
