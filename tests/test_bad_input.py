"""Bad input (issue 8): a typed etrax error before any XLA compilation, naming the
state and what to do, with the model's brainstate states left as they were.

`test_errors.py` covers the compile-time structure errors; this file covers state
shapes and dtypes that change within a step, integer weights, empty sequences,
exceptions raised by the user's loss and `PPProp`'s argument types.
"""

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import brainstate
import brainunit as bu
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax

from .compiles import CompileCount
from .models import LeakyLinear, build
from .typechecks import unchecked


@contextlib.contextmanager
def no_xla_compilation() -> Iterator[None]:
    """Fail if XLA compiles anything inside the block."""
    with CompileCount() as counted:
        yield
    assert not counted.count, (
        f"{counted.count} XLA compilation(s) before the error: {counted.names} (other "
        f"threads: {counted.elsewhere})"
    )


def snapshot(model: brainstate.nn.Module) -> dict[Any, list[Any]]:
    """The leaves of every state's value (the objects themselves)."""
    return {p: jax.tree.leaves(s.value) for p, s in model.states().items()}


def assert_unchanged(model: brainstate.nn.Module, before: dict[Any, list[Any]]) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for p, leaves in before.items():
        assert len(after[p]) == len(leaves)
        for old, new in zip(leaves, after[p], strict=True):
            assert new is old, f"state {p} was rebound"


def mse(y: Array, t: Array) -> Array:
    return jnp.mean((y - t) ** 2)


# --- 1. a step that changes a state's shape or dtype -----------------------------------------


class Float32State(brainstate.nn.Module):
    """A float32 hidden state whose update promotes it to float64."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4, jnp.float32))

    def update(self, x: ArrayLike) -> Array:
        h = 0.5 * self.h.value.astype(jnp.float64) + self.fc(x)
        self.h.value = h
        return h


class GrowingShortTerm(brainstate.nn.Module):
    """A ShortTermState that gains an axis every step."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LeakyLinear(3, 4)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.log = brainstate.ShortTermState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        h = self.inner(x)
        self.log.value = jnp.stack([self.log.value, h])
        return h


@pytest.mark.parametrize(
    ("make", "x", "patterns"),
    [
        (
            lambda: LeakyLinear(3, 4),
            jnp.ones((2, 3)),
            [r"HiddenState \('h',\)", r"shape \(4,\) to \(2, 4\)", r"batch_size=2"],
        ),
        (
            lambda: etrax.nn.LIF(4),
            jnp.ones((5, 4)),
            [r"\('V',\)", r"shape \(4,\) to \(5, 4\)", r"init_all_states\(model, batch_size=5\)"],
        ),
        (
            Float32State,
            jnp.ones(3),
            [r"\('h',\)", "dtype float32 to float64", r"Cast the new value to float32"],
        ),
        (
            GrowingShortTerm,
            jnp.ones(3),
            [r"ShortTermState \('log',\)", r"shape \(4,\) to \(2, 4\)"],
        ),
    ],
    ids=["batched_input_unbatched_state", "lif_batched_input", "dtype", "short_term"],
)
def test_step_changes_a_state(
    make: Callable[[], brainstate.nn.Module], x: Array, patterns: list[str]
) -> None:
    model = make()
    brainstate.nn.init_all_states(model)  # no batch_size: the common mistake
    before = snapshot(model)
    with no_xla_compilation(), pytest.raises(etrax.StateShapeChangedError) as info:
        etrax.compile_etrace_graph(model, x)
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))
    assert isinstance(info.value, etrax.CompilationError)
    assert_unchanged(model, before)


def test_batched_states_still_compile() -> None:
    # the fix the message gives works
    model = LeakyLinear(3, 4)
    brainstate.nn.init_all_states(model, batch_size=2)
    graph = etrax.compile_etrace_graph(model, jnp.ones((2, 3)))
    assert graph.module_info.state_info(("h",)).shapes == ((2, 4),)


# --- 2. integer ParamStates -------------------------------------------------------------------


class IntTable(brainstate.nn.Module):
    """A recurrence through a permutation table; `kind` says where the table lives."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)
        perm = jnp.array([3, 2, 1, 0])
        if kind == "param":
            self.perm: Any = brainstate.ParamState(perm)
        elif kind == "param_dict":
            self.perm = brainstate.ParamState({"idx": perm, "scale": jnp.ones(4)})
        else:
            self.perm = brainstate.State(perm)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        value = self.perm.value
        idx = value["idx"] if isinstance(value, dict) else value
        h = 0.5 * self.h.value[idx] + self.fc(x)
        self.h.value = h
        return h


@pytest.mark.parametrize(("kind", "where"), [("param", r"\('perm',\)"), ("param_dict", "'idx'")])
def test_integer_param_state_is_refused(kind: str, where: str) -> None:
    model = IntTable(kind)
    brainstate.nn.init_all_states(model)
    before = snapshot(model)
    x = jnp.ones(3)  # made outside the block: its own (eager) program is not etrax's
    with no_xla_compilation(), pytest.raises(etrax.WeightNotFloatError, match=where) as info:
        etrax.compile_etrace_graph(model, x)
    message = str(info.value)
    assert "int64" in message and "brainstate.State" in message and "constant" in message
    assert isinstance(info.value, etrax.NotSupportedError)
    assert info.value.records[-1].kind is etrax.DiagnosticKind.WEIGHT_NOT_FLOAT
    assert info.value.records[-1].weight_path == ("perm",)
    assert_unchanged(model, before)


def test_integer_table_in_a_plain_state_trains() -> None:
    # the fix the message gives works end to end
    model = IntTable("state")
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3))
    state = etrax.state_of(graph)
    xs, ts = jnp.ones((3, 3)), jnp.zeros((3, 4))
    grads, _ = etrax.bptt_grad(graph, state, xs, ts, mse)
    assert set(grads) == {("fc", "weight")}


# --- 3. empty sequences -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def problem() -> tuple[etrax.ETraceGraph, etrax.ModelState]:
    model, x = build(LeakyLinear, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    return graph, etrax.state_of(graph)


ALGORITHMS: dict[str, etrax.OnlineAlgorithm[Any]] = {
    "drtrl_chunked": etrax.DRTRL(),
    "drtrl_per_step": etrax.DRTRL(chunk_steps=1),
    "drtrl_chunk_3": etrax.DRTRL(chunk_steps=3),
    "pp_prop": etrax.PPProp(0.5),
    "pp_prop_chunk_3": etrax.PPProp(0.5, chunk_steps=3),
    "e_prop": etrax.EProp(),
    "e_prop_filtered": etrax.EProp(kappa=0.5),
}


def _empty_error(call: Callable[[], Any]) -> str:
    with no_xla_compilation(), pytest.raises(etrax.StepInputError, match=r"T = 0") as info:
        call()
    return str(info.value)


def test_empty_sequence_same_error_everywhere(
    problem: tuple[etrax.ETraceGraph, etrax.ModelState],
) -> None:
    graph, state = problem
    xs, ts = jnp.ones((0, 3)), jnp.ones((0, 4))
    traces = {name: algo.init(graph, state) for name, algo in ALGORITHMS.items()}
    messages = {
        name: _empty_error(
            functools.partial(etrax.online_grad, graph, algo, state, traces[name], xs, ts, mse)
        )
        for name, algo in ALGORITHMS.items()
    }
    algo, tr = ALGORITHMS["drtrl_per_step"], traces["drtrl_per_step"]
    messages["window"] = _empty_error(
        functools.partial(etrax.online_grad, graph, algo, state, tr, xs, ts, mse, window=2)
    )
    messages["bptt"] = _empty_error(functools.partial(etrax.bptt_grad, graph, state, xs, ts, mse))
    messages["multi_step"] = _empty_error(functools.partial(etrax.multi_step, graph, state, xs))
    assert len(set(messages.values())) == 1, messages


# --- 4. exceptions raised by the user's loss ----------------------------------------------------


def _drivers(
    problem: tuple[etrax.ETraceGraph, etrax.ModelState],
) -> list[Callable[[Any, Callable[[Any, Any], Array]], Any]]:
    graph, state = problem
    xs = jnp.ones((4, 3))
    algo = etrax.DRTRL(chunk_steps=1)
    traces = algo.init(graph, state)
    return [
        lambda ts, f: etrax.online_grad(graph, algo, state, traces, xs, ts, f),
        lambda ts, f: etrax.bptt_grad(graph, state, xs, ts, f),
    ]


def _key_error(y: Array, t: Array) -> Array:
    return {"a": y}["b"]


def _zero_division(y: Array, t: Array) -> Array:
    return jnp.sum(y) / (1 // 0)


def _runtime_error(y: Array, t: Array) -> Array:
    raise RuntimeError("boom")


def _own_value_error(y: Array, t: Array) -> Array:
    raise ValueError("my loss is not configured")


def _own_type_error(y: Array, t: Array) -> Array:
    return mse(y, t) + jnp.zeros(2)[None, :, None] @ jnp.zeros((3, 1))


@pytest.mark.parametrize(
    ("loss", "error", "message"),
    [
        (_runtime_error, RuntimeError, "boom"),
        (_key_error, KeyError, "'b'"),
        (_zero_division, ZeroDivisionError, "division"),
        (_own_value_error, ValueError, "my loss is not configured"),
        (_own_type_error, TypeError, "dot_general"),
    ],
    ids=["runtime", "key", "zero_division", "value", "type"],
)
def test_loss_exception_propagates_unchanged(
    problem: tuple[etrax.ETraceGraph, etrax.ModelState],
    loss: Callable[[Any, Any], Array],
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error) as expected:
        loss(jnp.ones(4), jnp.ones(4))
    ts = jnp.zeros((4, 4))
    for run in _drivers(problem):
        with no_xla_compilation(), pytest.raises(error, match=message) as info:
            run(ts, loss)
        assert type(info.value) is type(expected.value)
        assert not isinstance(info.value, etrax.EtraxError)
        assert str(info.value) == str(expected.value)


def test_targets_that_do_not_fit_are_blamed(
    problem: tuple[etrax.ETraceGraph, etrax.ModelState],
) -> None:
    def tree_mse(y: Array, t: Any) -> Array:
        return sum(jax.tree.leaves(jax.tree.map(mse, y, t)), start=jnp.zeros(()))

    wide = jnp.zeros((4, 5))
    bad = {"a": jnp.zeros((4, 4)), "b": jnp.zeros((4, 4))}
    for run in _drivers(problem):
        # a shape that does not broadcast against y_t
        with (
            no_xla_compilation(),
            pytest.raises(etrax.StepInputError, match=r"\(4,\).*\(5,\)") as info,
        ):
            run(wide, mse)
        assert ".." not in str(info.value)  # JAX's own sentence ends once
        # a structure that does not match y_t
        with no_xla_compilation(), pytest.raises(etrax.StepInputError, match="fit loss_fn"):
            run(bad, tree_mse)


# --- 5. PPProp's argument types -----------------------------------------------------------------


def _decay(algo: etrax.LearningRule[etrax.IOTraces]) -> float:
    assert isinstance(algo.factorisation, etrax.InputOutput)
    return algo.factorisation.decay


def test_pp_prop_accepts_numpy_numbers() -> None:
    reference = etrax.PPProp(decay=2, chunk_steps=3)
    algo = etrax.PPProp(decay=np.int64(2), chunk_steps=np.int64(3))
    assert _decay(algo) == pytest.approx(1 / 3) and type(_decay(algo)) is float
    assert algo.chunk_steps == 3 and type(algo.chunk_steps) is int
    assert algo == reference and hash(algo) == hash(reference)  # one jit cache entry
    assert _decay(etrax.PPProp(np.int32(1))) == 0.0
    for decay in (np.float32(0.5), np.float64(0.5), np.array(0.5)):
        value = _decay(etrax.PPProp(decay))
        assert value == 0.5 and type(value) is float


# Under the suite's runtime type checking, values outside the annotation are refused by
# the checker (also a TypeError naming the argument); the others reach PPProp's own check.
@pytest.mark.parametrize("decay", ["0.5", "2", None, [0.5], True, np.True_, 0.5j])
def test_pp_prop_refuses_non_numbers(decay: Any) -> None:
    with pytest.raises(TypeError, match="decay") as info:
        etrax.PPProp(decay)
    if isinstance(decay, bool | np.bool_ | complex):
        assert "decay must be a float in [0, 1) or an integer rank >= 1" in str(info.value)


@pytest.mark.parametrize("steps", ["2", 2.0, True, np.True_])
def test_pp_prop_refuses_non_integer_chunk_steps(steps: Any) -> None:
    with pytest.raises(TypeError, match="chunk_steps") as info:
        etrax.PPProp(0.5, chunk_steps=steps)
    if isinstance(steps, bool):
        assert "chunk_steps must be a positive int (Python or NumPy integer) or None" in str(
            info.value
        )
    assert etrax.PPProp(0.5, chunk_steps=None).chunk_steps is None  # the default


# --- 6. the researcher's slips ----------------------------------------------------------------


def _gru_f32() -> tuple[brainstate.nn.Module, etrax.ETraceGraph]:
    brainstate.environ.set(precision=32)
    gru = etrax.nn.GRUCell(3, 4)
    brainstate.nn.init_all_states(gru, batch_size=2)
    return gru, etrax.compile_etrace_graph(gru, jnp.zeros((2, 3), jnp.float32))


def test_passing_the_model_where_a_graph_is_expected() -> None:
    gru, graph = _gru_f32()
    state = etrax.state_of(graph)
    xs, ts = jnp.zeros((3, 2, 3), jnp.float32), jnp.zeros((3, 2, 4), jnp.float32)
    calls: dict[str, Callable[[], Any]] = {
        "state_of": lambda: etrax.state_of(gru),  # type: ignore[arg-type]  # the slip under test
        "the step": lambda: etrax.step(gru, state, xs[0]),  # type: ignore[arg-type]  # the slip under test
        "online_grad": lambda: etrax.online_grad(gru, etrax.DRTRL(), state, None, xs, ts, mse),  # type: ignore[arg-type]  # the slip under test
        "bptt_grad": lambda: etrax.bptt_grad(gru, state, xs, ts, mse),  # type: ignore[arg-type]  # the slip under test
    }
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)  # as users run: etrax's own check
    try:
        for where, call in calls.items():
            with pytest.raises(TypeError, match=rf"{where} needs an etrax.ETraceGraph, got GRU"):
                call()
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def test_numpy_float64_inputs_are_cast_and_integers_get_advice() -> None:
    _, graph = _gru_f32()
    state = etrax.state_of(graph)
    x64 = np.random.default_rng(0).standard_normal((2, 3))  # NumPy float64
    y_cast, _, _ = etrax.step(graph, state, x64)
    y_ref, _, _ = etrax.step(graph, state, jnp.asarray(x64, jnp.float32))
    np.testing.assert_array_equal(y_cast, y_ref)
    xs64, ts = np.zeros((3, 2, 3)), jnp.zeros((3, 2, 4), jnp.float32)
    grads, _ = etrax.online_grad(
        graph, etrax.DRTRL(), state, etrax.DRTRL().init(graph, state), xs64, ts, mse
    )
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    with pytest.raises(
        etrax.StepInputError, match=r"cast it first, e\.g\. x\.astype\(jnp\.float32\)"
    ):
        etrax.step(graph, state, np.zeros((2, 3), np.int32))


def test_batch_first_sequences_are_explained() -> None:
    _, graph = _gru_f32()
    state = etrax.state_of(graph)
    rule = etrax.DRTRL()
    xs, ts = jnp.zeros((2, 5, 3), jnp.float32), jnp.zeros((2, 5, 4), jnp.float32)  # (B, T, …)
    with pytest.raises(etrax.StepInputError, match=r"time-major.*jnp\.swapaxes\(xs, 0, 1\)"):
        etrax.online_grad(graph, rule, state, rule.init(graph, state), xs, ts, mse)


def test_learner_params_with_a_wrong_key() -> None:
    brainstate.environ.set(precision=32)
    learner = etrax.compile(etrax.nn.GRUCell(3, 4), etrax.DRTRL(), jnp.zeros((2, 3)), batch_size=2)
    with pytest.raises(KeyError, match=r"needs exactly the parameter paths.*unknown \[\('W',\)\]"):
        learner.params = {("W",): jnp.zeros(3)}
    before = learner.params
    wrong = dict(before)
    path = ("Wz", "weight")
    wrong[path] = {"weight": jnp.zeros((7, 5)), "bias": jnp.zeros(5)}  # another shape
    with pytest.raises(etrax.StepInputError, match=r"shapes \[\(5,\), \(7, 5\)\].*compiled"):
        learner.params = wrong
    wrong[path] = jnp.zeros((7, 4))  # another structure
    with pytest.raises(etrax.StepInputError, match="structure"):
        learner.params = wrong
    wrong[path] = jax.tree.map(lambda a: a.astype(jnp.float16), before[path])  # another dtype
    with pytest.raises(etrax.StepInputError, match=r"float16 values.*compiled with float32"):
        learner.params = wrong
    for a, b in zip(jax.tree.leaves(learner.params), jax.tree.leaves(before), strict=True):
        assert a is b  # nothing was written


@pytest.mark.parametrize(
    "key",
    [0, "k", jnp.zeros(3), jax.random.split(jax.random.key(0), 2)],
    ids=["int", "str", "float_array", "two_keys"],
)
def test_random_rules_refuse_a_key_that_is_not_one(key: Any) -> None:
    """`EProp(feedback="random", key=...)` and `UORO(key)` check their key when
    built, not deep in the driver."""
    # beartype/jaxtyping checks the signature in the tests; without it, the rule does
    with pytest.raises(TypeError, match=r"PRNG key|parameter 'key'"):
        etrax.EProp(feedback="random", key=key)
    with pytest.raises(TypeError, match=r"PRNG key|parameter 'key'"):
        etrax.UORO(key)
    for good in (jax.random.key(0), jax.random.PRNGKey(0)):
        etrax.EProp(feedback="random", key=good)
        etrax.UORO(good)


@pytest.mark.parametrize("make", [etrax.DRTRL, etrax.EProp, etrax.PPProp])
def test_numpy_integer_chunk_steps(make: Any) -> None:
    """Every rule takes `chunk_steps` as a Python or NumPy integer (the same rule)."""
    assert make(chunk_steps=np.int64(4)) == make(chunk_steps=4)
    with pytest.raises(TypeError, match="chunk_steps"):
        make(chunk_steps=4.0)


def test_numpy_window_traced_decay_and_nested_lists() -> None:
    """`window` takes a NumPy integer or a 0-d integer array (not a float one); a decay
    traced under `jax.jit` is a `TypeError` that says the setting is static; nested
    lists as sequences get a short message that says to convert them (not one entry
    per number)."""
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    rule = etrax.DRTRL()

    def mse(y: Any, t: Any) -> Any:
        return jnp.sum((y - t) ** 2)

    xs, ts = jnp.ones((4, 3)), jnp.zeros((4, 4))
    tr = rule.init(graph, state)
    b = etrax.online_grad(graph, rule, state, tr, xs, ts, mse, window=2).grads
    for given in (np.int64(2), jnp.asarray(2), np.asarray(2)):
        a = etrax.online_grad(graph, rule, state, tr, xs, ts, mse, window=given).grads
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(u, v)
    with pytest.raises(ValueError, match="window must be an int"):
        etrax.online_grad(graph, rule, state, tr, xs, ts, mse, window=jnp.asarray(2.0))
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda d: etrax.PPProp(d).chunk_steps)(0.9)
    with pytest.raises(etrax.StepInputError, match=r"jnp\.asarray\(xs\)") as info:
        etrax.online_grad(graph, rule, state, tr, np.ones((50, 3)).tolist(), ts, mse)
    assert len(str(info.value)) < 300
    # where the numbers arrive traced, as 0-d arrays: a learner's program, a user's jit
    learner = etrax.compile(model, rule, x)
    nested = np.ones((4, 3)).tolist()

    def jitted(seq: Any) -> Any:
        return etrax.online_grad(graph, rule, state, tr, seq, ts, mse).grads

    for call in (
        lambda: learner.etrace_grad(nested, ts, mse),
        lambda: jax.jit(jitted)(nested),
        lambda: learner.etrace_grad(xs, np.zeros((4, 4)).tolist(), mse),
    ):
        with pytest.raises(etrax.StepInputError, match=r"nested list\?.*jnp\.asarray") as info:
            call()
        assert len(str(info.value)) < 300


def test_a_batch_size_the_example_inputs_do_not_have_is_named() -> None:
    """`etrax.compile` with a `batch_size` that the example inputs' leading axis does not
    have: the tracing error also names both sizes and says what to pass."""
    model, _ = build(etrax.nn.GRUCell, 3, 4)
    for batch_size, x0 in ((8, jnp.zeros((4, 3))), (4, jnp.zeros((5, 3)))):
        with pytest.raises(etrax.InputStructureError) as info:
            etrax.compile(model, etrax.DRTRL(), x0, batch_size=batch_size)
        message = str(info.value)
        assert f"batch_size={batch_size}" in message
        assert f"lead with [{x0.shape[0]}]" in message
        assert ".." not in message

    # an input that does lead with batch_size keeps the tracing error as it was
    class TwoInputs(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = etrax.nn.GRUCell(3, 4)

        def update(self, x: Array, y: Array) -> Array:
            return self.cell(x) + y

    with pytest.raises(etrax.InputStructureError) as info:
        etrax.compile(
            TwoInputs(), etrax.DRTRL(), jnp.zeros((2, 3)), jnp.zeros((2, 5)), batch_size=2
        )
    assert "batch_size=2" not in str(info.value)


def test_a_preset_passed_uncalled_is_told_to_be_called() -> None:
    """`etrax.DRTRL` where `etrax.DRTRL()` belongs (`etrax.compile` takes either): the
    functional entry points say to call it. (The suite's runtime type checks would
    refuse it first; a user without them reaches etrax's own check.)"""
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs, ts = jnp.ones((4, 3)), jnp.zeros((4, 4))

    def mse(y: Any, t: Any) -> Any:
        return jnp.sum((y - t) ** 2)

    rule = etrax.DRTRL()
    tr = rule.init(graph, state)
    calls: list[Callable[[], object]] = [
        lambda: etrax.online_grad(graph, etrax.DRTRL, state, tr, xs, ts, mse),  # type: ignore[arg-type]
        lambda: etrax.online_evolve(graph, etrax.PPProp, state, tr, xs),  # type: ignore[arg-type]
        lambda: etrax.check_gradients(graph, etrax.EProp, state, xs, ts, mse),  # type: ignore[arg-type]
    ]
    with unchecked():
        for call, name in zip(calls, ("DRTRL", "PPProp", "EProp"), strict=True):
            with pytest.raises(TypeError, match=rf"call it: etrax\.{name}\(\)"):
                call()


def test_differentiating_through_an_online_gradient_is_refused() -> None:
    """An online gradient's values are exact for its rule, but its derivatives are not
    (the traces hold the step's weight operations constant): `jax.grad` through
    `online_grad` is a `TypeError` that points to `bptt_grad`, whose own derivatives
    match finite differences."""
    model, x = build(etrax.nn.GRUCell, 3, 4, batch=2)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    xs = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 3))
    ts = jax.random.normal(jax.random.PRNGKey(1), (4, 2, 4))

    def mse(y: Any, t: Any) -> Any:
        return jnp.sum((y - t) ** 2)

    def meta(v: Any, rule: Any, window: int | None = None) -> Any:
        tr = rule.init(graph, state)
        g = etrax.online_grad(graph, rule, state, tr, v, ts, mse, window=window).grads
        return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g))

    for rule, window in (
        (etrax.DRTRL(), None),
        (etrax.PPProp(0.9, chunk_steps=1), None),
        (etrax.DRTRL(), 2),
    ):
        meta(xs, rule, window)  # the value itself is fine
        with pytest.raises(TypeError, match="bptt_grad"):
            jax.grad(meta)(xs, rule, window)
        # forward mode too, with etrax's message (not JAX's about custom_vjp functions)
        with pytest.raises(TypeError, match=r"bptt_grad.*forward mode"):
            jax.jvp(lambda v, r=rule, w=window: meta(v, r, w), (xs,), (xs,))
        with pytest.raises(TypeError, match=r"bptt_grad.*forward mode"):
            jax.jacfwd(meta)(xs, rule, window)

    def meta_bptt(v: Any) -> Any:
        g = etrax.bptt_grad(graph, state, v, ts, mse).grads
        return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g))

    d = jax.random.normal(jax.random.PRNGKey(2), xs.shape)
    eps = 1e-6
    fd = (meta_bptt(xs + eps * d) - meta_bptt(xs - eps * d)) / (2 * eps)
    np.testing.assert_allclose(jnp.sum(jax.grad(meta_bptt)(xs) * d), fd, rtol=1e-6)


def test_a_learner_inside_a_transformation_is_refused() -> None:
    """`OnlineLearner` calls are eager (they read and write the model's states):
    under `jax.jit`, `jax.grad`, `jax.vmap` or `brainstate.transform.jit` they raise
    a `TypeError` that points to `etrax.online_grad`, and the learner still works."""
    brainstate.environ.set(precision=32)
    B, T = 2, 4
    learner = etrax.compile(etrax.nn.GRUCell(3, 5), etrax.DRTRL(), jnp.zeros((B, 3)), batch_size=B)
    xs, ys = jnp.ones((T, B, 3)), jnp.zeros((T, B, 5))

    def loss(y: Array, t: Array) -> Array:
        return jnp.mean((y - t) ** 2)

    def grad_norm(x: Array) -> Array:
        leaves = jax.tree.leaves(learner.etrace_grad(x, ys, loss))
        return jnp.sum(jnp.stack([jnp.sum(g) for g in leaves]))

    calls: list[Callable[[], object]] = [
        lambda: jax.jit(grad_norm)(xs),
        lambda: jax.grad(grad_norm)(xs),
        lambda: jax.vmap(grad_norm)(xs[None]),
        lambda: brainstate.transform.jit(lambda: learner.etrace_grad(xs, ys, loss))(),
        lambda: jax.jit(lambda x: learner.etrace_evolve(x))(xs),
        lambda: jax.jit(lambda x: learner.bptt_grad(x, ys, loss))(xs),
        lambda: jax.jit(lambda p: setattr(learner, "params", p))(learner.params),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"runs eagerly.*etrax\.online_grad"):
            call()
    learner.etrace_grad(xs, ys, loss)  # untouched: still runs


def test_lower_level_entry_points_check_their_inputs() -> None:
    """`graph.call_hidden_perturb`, a `Pullback` and a rule's ``init`` refuse
    mis-shaped or foreign inputs with typed errors (not JAX's)."""
    brainstate.environ.set(precision=32)
    B = 2
    gru = etrax.nn.GRUCell(3, 4)
    brainstate.nn.init_all_states(gru, batch_size=B)
    graph = etrax.compile_etrace_graph(gru, jnp.zeros((B, 3)))
    state = etrax.state_of(graph)
    x = jnp.ones((B, 3))
    with pytest.raises(etrax.StepInputError, match="perturbations of shapes"):
        graph.call_hidden_perturb((x,), (jnp.zeros((B, 4, 1)),))
    with pytest.raises(etrax.StepInputError, match="step inputs have shapes"):
        graph.call_hidden_perturb((jnp.ones((B, 5)),), (jnp.zeros((B, 4)),))
    graph.call_hidden_perturb((x,), (jnp.zeros((B, 4)),))  # the right shapes run
    pullback = etrax.step_vjp(graph, state, x)[3]
    with pytest.raises(etrax.StepInputError, match="y_cot"):
        pullback(jnp.zeros((B, 7)))
    with pytest.raises(etrax.StepInputError, match="hidden_cot has paths"):
        pullback(jnp.zeros((B, 4)), {("c",): jnp.zeros((B, 4))})
    with pytest.raises(etrax.StepInputError, match=r"hidden_cot\["):
        pullback(jnp.zeros((B, 4)), {("h",): jnp.zeros((B, 5))})
    pullback(jnp.zeros((B, 4)), {("h",): jnp.zeros((B, 4))})
    rule = etrax.DRTRL()
    # the common slip, on purpose (the tests' signature check or the rule's own)
    with pytest.raises(TypeError, match=r"needs an etrax\.ETraceGraph|parameter 'graph'"):
        rule.init(gru, state)  # type: ignore[arg-type]
    no_hidden = etrax.ModelState(state.params, etrax.PathDict(), state.other)
    with pytest.raises(etrax.StepInputError, match="missing"):
        rule.init(graph, no_hidden)
    # another graph's state: the leaf is named by its path inside the parameter
    wider = etrax.nn.GRUCell(3, 6)
    brainstate.nn.init_all_states(wider, batch_size=B)
    foreign = etrax.state_of(etrax.compile_etrace_graph(wider, jnp.zeros((B, 3))))
    with pytest.raises(etrax.StepInputError, match=r"\]\['(bias|weight)'\] has shape"):
        rule.init(graph, foreign)


def test_op_arguments_that_do_not_fit_name_the_op() -> None:
    """Mis-shaped op operands are etrax errors naming the op and the shapes (not
    JAX's or opt_einsum's from inside)."""
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: etrax.conv(
                jnp.ones((1, 5, 3)), jnp.ones((3, 2, 4)), dimension_numbers=("NWC", "WIO", "NWC")
            ),
            "conv: x has 3 input channels",
        ),
        (
            lambda: etrax.conv(
                jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), dimension_numbers=("NXC", "WIO", "NWC")
            ),
            "conv: dimension_numbers",
        ),
        (lambda: etrax.einsum("i,io->o", jnp.ones(3), jnp.ones((4, 4))), "label 'i' has size 3"),
        (
            lambda: etrax.matmul(jnp.ones(3), jnp.ones((3, 4)), weight_fn=jnp.transpose),
            "weight_fn must keep the shape",
        ),
        # every op checks that its transforms keep the shape (a sum would be traced
        # into traces of the wrong shape)
        (lambda: etrax.element_wise(jnp.ones(4), weight_fn=jnp.sum), "element_wise: weight_fn"),
        (
            lambda: etrax.embedding(jnp.arange(2), jnp.ones((5, 3)), weight_fn=jnp.transpose),
            "embedding: weight_fn",
        ),
        (
            lambda: etrax.einsum("i,io->o", jnp.ones(3), jnp.ones((3, 3)), weight_fn=jnp.sum),
            "einsum: weight_fn",
        ),
        (
            lambda: etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), kernel_fn=jnp.ravel),
            "conv: kernel_fn",
        ),
        # and conv the values of its arguments
        (lambda: etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), strides=0), "strides"),
        (
            lambda: etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), rhs_dilation=(0,)),
            "rhs_dilation must be positive",
        ),
        (
            lambda: etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), feature_group_count=0),
            "feature_group_count must be a positive int",
        ),
        (
            lambda: etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), padding="FULL"),
            "padding must be",
        ),
        (
            lambda: etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), padding=((1, 1),) * 2),
            "one (low, high) pair per spatial axis (1)",
        ),
        (
            lambda: etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), lhs_dilation=2),
            "lhs_dilation (2,) needs explicit padding",
        ),
    ]
    for call, message in cases:
        with pytest.raises(etrax.OpArgumentError, match=re.escape(message)):
            call()
    # operands that are not arrays (a Linear's parameter dict, a string), which mypy and
    # the suite's runtime type checks refuse first: each op's own check, for untyped code
    params: Any = {"weight": jnp.ones((3, 4)), "bias": jnp.zeros(4)}
    text: Any = "x"
    not_arrays: list[tuple[Callable[[], object], str]] = [
        (lambda: etrax.matmul(jnp.ones(3), params), "matmul: weight must be an array, got a dict"),
        (lambda: etrax.matmul(text, jnp.ones((3, 4))), "matmul: x must be an array"),
        (lambda: etrax.element_wise(params), "element_wise: weight must be an array"),
        (
            lambda: etrax.conv(jnp.ones((1, 5, 2)), {"k": params}),  # type: ignore[arg-type]
            "conv: kernel must be an array",
        ),
        (lambda: etrax.embedding(jnp.arange(2), text), "embedding: table must be an array"),
    ]
    with unchecked():
        for call, message in not_arrays:
            with pytest.raises(etrax.OpArgumentError, match=re.escape(message)):
                call()
    etrax.einsum("i,io->o", jnp.ones(3), jnp.ones((3, 4)))  # the fitting ones run
    etrax.matmul(jnp.ones(3), jnp.ones((3, 4)), weight_fn=jnp.abs)
    etrax.conv(jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4)), padding=((1, 1),), lhs_dilation=2)


def test_an_op_argument_error_while_compiling_is_the_ops_own() -> None:
    """An op's argument error raised while the compiler traces the step keeps the op's
    own message (naming the op and the argument) and says which of the inputs or the
    op call to fix; a custom op bound with fewer operands than its registration names
    is refused at the call."""

    class Bad(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(jnp.ones(4))

        def init_state(self, batch_size: int | None = None, **kw: object) -> None:
            self.h = brainstate.HiddenState(jnp.zeros(4))

        def update(self, x: ArrayLike) -> Array:
            h = 0.5 * self.h.value + etrax.element_wise(self.w.value, weight_fn=jnp.sum)
            self.h.value = h
            return h

    model = Bad()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.InputStructureError, match="inside an etrax op") as info:
        etrax.compile_etrace_graph(model, jnp.ones(3))
    assert "element_wise: weight_fn must keep the shape" in str(info.value)
    assert "fix that call in update()" in str(info.value)
    assert isinstance(info.value.__cause__, etrax.OpArgumentError)
    gain_p = etrax.register_primitive(
        "probe_gain_no_x",
        lambda w: 2.0 * w,
        x_index=None,  # trainable: {'weight': 1}
    )
    with pytest.raises(etrax.OpArgumentError, match=r"1 operand\(s\).*'weight': 1"):
        etrax.ops.bind(gain_p, jnp.ones(3))


def test_a_state_of_plain_dicts_in_any_order() -> None:
    """SPEC's state fields are ``dict[path, value]``: a `ModelState` built from plain
    dicts, in another order than the graph's, runs every entry point (the fields are
    rebuilt as `PathDict`s in the graph's order) with the same results, instead of a
    raw `lax.scan` structure error; a missing path is still a `StepInputError`."""
    model, x = build(etrax.nn.GRUCell, 3, 4)
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    loose = etrax.ModelState(
        dict(reversed(list(state.params.items()))), dict(state.hidden), dict(state.other)
    )
    rule = etrax.DRTRL()

    def mse(y: Any, t: Any) -> Any:
        return jnp.sum((y - t) ** 2)

    xs, ts = jnp.ones((4, 3)), jnp.zeros((4, 4))
    for s_given in (state, loose):
        assert isinstance(etrax.step(graph, s_given, x)[1].params, etrax.PathDict)
    want, got = (
        (
            etrax.step(graph, s, x)[0],
            etrax.bptt_grad(graph, s, xs, ts, mse).grads,
            etrax.online_grad(graph, rule, s, rule.init(graph, s), xs, ts, mse).grads,
        )
        for s in (state, loose)
    )
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(u, v)
    short = etrax.ModelState(dict(list(state.params.items())[1:]), state.hidden, state.other)
    with pytest.raises(etrax.StepInputError, match="missing"):
        etrax.bptt_grad(graph, short, xs, ts, mse)


class WhileSubsteps(brainstate.nn.Module):
    """Three Euler sub-steps in a `lax.while_loop` (the weight read outside it), whose
    result also reaches the output: the untraced route from the weight's product to
    the output crosses the loop, which reverse mode cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.7 * jax.random.normal(jax.random.PRNGKey(0), (3, 4)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        cur = jnp.asarray(x) @ self.w.value
        _, v = jax.lax.while_loop(
            lambda c: c[0] < 3,
            lambda c: (c[0] + 1, c[1] + 0.25 * (-c[1] + 2.0 * jnp.tanh(cur))),
            (0, self.v.value),
        )
        self.v.value = 0.9 * v
        return jnp.tanh(v)


def test_a_while_loop_on_a_differentiated_route_is_a_typed_error() -> None:
    """JAX cannot reverse-differentiate a `lax.while_loop`: when the gradient's route
    crosses one, every driver raises a `NotSupportedError` that names the loop and
    says to write `fori_loop` or `scan`, instead of JAX's error from deep inside."""
    model = WhileSubsteps()
    brainstate.nn.init_all_states(model)
    graph = etrax.compile_etrace_graph(model, jnp.ones(3))
    etrax.step(graph, etrax.state_of(graph), jnp.ones(3))  # the step itself runs
    state = etrax.state_of(graph)
    xs, ts = jnp.ones((2, 3)), jnp.zeros((2, 4))

    def mse(y: Any, t: Any) -> Any:
        return jnp.sum((y - t) ** 2)

    def online(algo: etrax.OnlineAlgorithm[Any]) -> Any:
        return etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, mse)

    calls: list[Callable[[], Any]] = [
        lambda: etrax.bptt_grad(graph, state, xs, ts, mse),
        *(
            functools.partial(online, algo)
            for algo in (etrax.DRTRL(), etrax.PPProp(0.9), etrax.EProp(0.5))
        ),
        lambda: etrax.compile(model, etrax.DRTRL(), jnp.ones(3)).etrace_grad(xs, ts, mse),
    ]
    for call in calls:
        with pytest.raises(etrax.NotSupportedError, match=r"while_loop \(at .*test_bad_input"):
            call()


def test_arguments_of_the_wrong_kind_get_a_message_not_an_attribute_or_index_error() -> None:
    """A `policy` given as a dict, a `seed` given as a string, a report level given as a
    string and an empty `MultiStepData` each say what to pass (before: an
    `AttributeError` deep in the compiler, brainstate's key error, a comparison
    `TypeError`, an `IndexError`)."""
    model, x = build(LeakyLinear, 3, 4)
    with unchecked():
        with pytest.raises(TypeError, match=r"policy must be an etrax\.CompilePolicy"):
            etrax.compile_etrace_graph(model, x, policy={"unroll_limit": 4})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="seed must be an int"):
            etrax.compile(model, etrax.DRTRL(), x, seed="0")  # type: ignore[arg-type]
        graph = etrax.compile_etrace_graph(model, x)
        with pytest.raises(ValueError, match="level must be 1"):
            graph.report().to_str("2")
        with pytest.raises(ValueError, match="level must be 1"):
            graph.report().to_str(3)
        executor = etrax.ETraceGraphExecutor(model)
        executor.compile_graph(x)
        with pytest.raises(etrax.StepInputError, match="leading time axis"):
            executor.solve_h2w_h2h_jacobian(etrax.MultiStepData({}))
    assert len(graph.report().to_str(2)) >= len(graph.report().to_str(1))  # both levels run


class CurrentDriven(brainstate.nn.Module):
    """A membrane driven by a current in nA (brainunit quantities)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.5 * jnp.ones((3, 5)) * bu.mV / bu.nA)

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(5) * bu.mV)

    def update(self, current: Any) -> Array:
        self.v.value = 0.8 * self.v.value + bu.math.matmul(current, self.w.value)
        return bu.get_mantissa(self.v.value)  # type: ignore[no-any-return]


def test_a_sequence_of_the_wrong_dtype_or_unit_is_told_so_without_the_axes_hint() -> None:
    """The time-major hint (``jnp.swapaxes``) is for shapes; a dtype or a unit at fault
    gets its own fix only, and a unit is named as a unit (before: a tree-structure
    error about passing a tuple)."""
    learner = etrax.compile(CurrentDriven(), "d_rtrl", jnp.zeros(3) * bu.nA)
    targets = jnp.zeros((4, 5))
    with pytest.raises(etrax.StepInputError, match="cast it first") as err:
        learner.etrace_grad(jnp.zeros((4, 3), jnp.int32) * bu.nA, targets, mse)
    assert "time-major" not in str(err.value)
    with pytest.raises(etrax.StepInputError, match=r"units \['pA'\].*compiled with \['nA'\]"):
        learner.etrace_grad((jnp.ones((4, 3)) * bu.nA).to(bu.pA), targets, mse)
    with pytest.raises(etrax.StepInputError, match="time-major"):  # shapes: the hint stays
        learner.etrace_grad(jnp.zeros((4, 2)) * bu.nA, targets, mse)
    grads = learner.etrace_grad(jnp.ones((4, 3)) * bu.nA, targets, mse)  # the right input
    assert set(grads) == {("w",)}
