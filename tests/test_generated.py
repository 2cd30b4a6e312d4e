"""Generated-model property test of etrax's central invariant.

For every generated model the compiler accepts, one step (T = 1) from a random
hidden state, every online algorithm's gradient equals `jax.grad` of the one-step
loss through brainstate's *own* jaxpr of ``model.update`` (`oracles.BrainstateStep`,
not etrax's `bptt_grad`), for every parameter leaf, readouts included, in float64.

Models the compiler refuses with a typed etrax error, and graphs that online
learning refuses with `etrax.CompilationError` (no traced relation), are counted,
not failed; any other exception is a failure. Each test checks a chunk of seeds
and lists every failing seed with its description.

The tiny models run eagerly (`jax.disable_jit`): XLA-compiling each model's
online step once per algorithm costs far more than running it op by op.
"""

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import etrax
from etrax._typing import Path

from .generated_models import GeneratedCase, generate
from .oracles import BrainstateStep

NUM_SEEDS = 200
CHUNK = 20
TOL = 1e-10
MIN_ACCEPTED = 0.9

ALGORITHMS: tuple[tuple[str, Callable[[], etrax.OnlineAlgorithm]], ...] = (
    ("DRTRL()", lambda: etrax.DRTRL()),
    ("DRTRL(chunk_steps=1)", lambda: etrax.DRTRL(chunk_steps=1)),
    ("PPProp(decay=0.9)", lambda: etrax.PPProp(decay=0.9)),
    ("EProp()", lambda: etrax.EProp()),
)


def sq_loss(y: Any, target: Any) -> Array:
    """Sum of squares of ``y − target`` over every leaf of a (pytree) output."""
    terms = [
        jnp.sum((a - b) ** 2)
        for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(target), strict=True)
    ]
    return functools.reduce(jnp.add, terms)


@dataclass(frozen=True)
class Outcome:
    """What happened to one seed: ``status`` is ``accepted``, ``refused-compile`` or
    ``refused-online``; ``failures`` lists every violated check."""

    seed: int
    description: str
    status: str
    failures: tuple[str, ...]
    refusal: str = ""


def _normal(rng: np.random.Generator, like: Any) -> Any:
    """Random normals shaped and typed like every leaf of `like`."""
    return jax.tree.map(
        lambda a: jnp.asarray(rng.standard_normal(jnp.shape(a)), dtype=jnp.result_type(a)), like
    )


def _with_time(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[None], tree)


def _oracle(
    case: GeneratedCase, state: etrax.ModelState, args: tuple[Array, ...], target: Any
) -> tuple[dict[Path, Any], float]:
    """``∂ loss / ∂ params`` of one step through brainstate's own jaxpr, and the loss."""
    step = BrainstateStep(case.model, args)

    def loss(params: dict[Path, Any]) -> Array:
        vals: dict[Path, Any] = {**state.other, **state.hidden, **params}
        out, _ = step(vals)
        return sq_loss(out, target)

    value, grads = jax.value_and_grad(loss)(dict(state.params))
    return grads, float(value)


def _deviations(
    got: Any, expected: dict[Path, Any], params: Any
) -> list[tuple[Path, float, float]]:
    """``(path, max |got − expected|, max |expected|)`` for every parameter whose
    gradient deviates beyond ``TOL`` relative to the whole gradient's scale."""
    scale = max(
        (float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(expected) if leaf.size),
        default=0.0,
    )
    bad: list[tuple[Path, float, float]] = []
    for path in params:
        if path not in got:
            bad.append((path, float("inf"), scale))
            continue
        g_leaves = jax.tree.leaves(got[path])
        e_leaves = jax.tree.leaves(expected[path])
        if [jnp.shape(a) for a in g_leaves] != [jnp.shape(b) for b in e_leaves]:
            bad.append((path, float("inf"), scale))
            continue
        dev = max(
            (float(jnp.max(jnp.abs(a - b))) for a, b in zip(g_leaves, e_leaves, strict=True)),
            default=0.0,
        )
        if not dev <= TOL * max(scale, 1.0):
            leaf_scale = max((float(jnp.max(jnp.abs(b))) for b in e_leaves), default=0.0)
            bad.append((path, dev, leaf_scale))
    return bad


def _crash(where: str, err: BaseException) -> str:
    last = traceback.extract_tb(err.__traceback__)[-1:]
    at = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{where} raised {type(err).__name__}: {str(err)[:300]}{at}"


def _run(case: GeneratedCase) -> Outcome:
    seed, desc = case.seed, case.description
    try:
        graph = etrax.compile_etrace_graph(case.model, *case.args)
    except etrax.EtraxError as err:
        return Outcome(seed, desc, "refused-compile", (), f"{type(err).__name__}: {err}")
    except Exception as err:
        return Outcome(seed, desc, "accepted", (_crash("compile_etrace_graph", err),))

    rng = np.random.default_rng(10_000 + seed)
    state = etrax.state_of(graph)
    state = state.replace_hidden(_normal(rng, dict(state.hidden)))
    args = tuple(_normal(rng, a) for a in case.args)
    x = args if len(args) > 1 else args[0]
    y, _ = BrainstateStep(case.model, args)({**state.other, **state.hidden, **state.params})
    target = _normal(rng, y)
    expected, _ = _oracle(case, state, args, target)

    failures: list[str] = []
    refusal = ""
    for name, make in ALGORITHMS:
        algo = make()
        try:
            traces = algo.init(graph, state)
            grads, _ = etrax.online_grad(
                graph, algo, state, traces, _with_time(x), _with_time(target), sq_loss
            )
        except etrax.CompilationError as err:
            refusal = f"{name}: {err}"
            continue
        except Exception as err:
            failures.append(_crash(name, err))
            continue
        if list(grads) != list(state.params):
            failures.append(f"{name}: gradient paths {list(grads)} != params {list(state.params)}")
        for path, dev, scale in _deviations(grads, expected, state.params):
            failures.append(f"{name}: {path} off by {dev:.3g} (|grad| up to {scale:.3g})")
    if refusal and not failures:
        return Outcome(seed, desc, "refused-online", (), refusal)
    return Outcome(seed, desc, "accepted", tuple(failures))


@functools.cache
def outcome(seed: int) -> Outcome:
    """The checked outcome of `seed` (cached: the summary test reuses it)."""
    with jax.disable_jit():
        case = generate(seed)
        try:
            return _run(case)
        except Exception as err:  # the oracle or the setup: still name the seed
            return Outcome(seed, case.description, "accepted", (_crash("test setup", err),))


def _report(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        if o.failures:
            lines.append(f"seed {o.seed}: {o.description}")
            lines.extend(f"    {f}" for f in o.failures)
    return "\n".join(lines)


@pytest.mark.parametrize(
    "start", range(0, NUM_SEEDS, CHUNK), ids=lambda s: f"seeds{s}-{s + CHUNK - 1}"
)
def test_online_gradients_equal_one_step_gradient(start: int) -> None:
    outcomes = [outcome(s) for s in range(start, start + CHUNK)]
    failing = [o for o in outcomes if o.failures]
    assert not failing, (
        f"{len(failing)} of {CHUNK} generated models give a wrong T = 1 gradient "
        f"(tolerance {TOL:g} relative):\n{_report(failing)}"
    )


def test_generator_is_deterministic_and_varied() -> None:
    """Two calls give the same model; the seeds give distinct models."""
    for seed in (0, 7, 123):
        a, b = generate(seed), generate(seed)
        assert a.description == b.description, seed
        va = jax.tree.leaves({p: s.value for p, s in a.model.states().items()})
        vb = jax.tree.leaves({p: s.value for p, s in b.model.states().items()})
        assert all(np.array_equal(u, v) for u, v in zip(va, vb, strict=True)), seed
    descriptions = {outcome(s).description.split(" ", 1)[1] for s in range(NUM_SEEDS)}
    assert len(descriptions) >= NUM_SEEDS * 0.95, len(descriptions)


def test_most_generated_models_are_accepted() -> None:
    outcomes = [outcome(s) for s in range(NUM_SEEDS)]
    refused = [o for o in outcomes if o.status != "accepted"]
    summary = "\n".join(f"seed {o.seed} {o.status}: {o.description}: {o.refusal}" for o in refused)
    assert len(refused) <= (1 - MIN_ACCEPTED) * NUM_SEEDS, summary
