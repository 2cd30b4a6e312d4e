"""Bad input gets a typed error with an actionable message, before any deep JAX trace."""

import inspect
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype.roar import BeartypeCallHintParamViolation
from jaxtyping import Array, ArrayLike

import etrax

from .models import LeakyLinear, build


class WritesWeight(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.ones((3, 4)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        self.w.value = self.w.value * 0.5
        h = self.h.value + etrax.matmul(x, self.w.value)
        self.h.value = h
        return h


class ConstantWeight(brainstate.nn.Module):
    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        h = 0.5 * self.h.value + etrax.matmul(x, jnp.ones((3, 4)))
        self.h.value = h
        return h


class DataWeight(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.ones((3, 4)))

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: ArrayLike) -> Array:
        w = self.w.value * jnp.sum(self.h.value)
        h = 0.5 * self.h.value + etrax.matmul(x, w)
        self.h.value = h
        return h


class CompilesInside(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = LeakyLinear(3, 4)

    def update(self, x: ArrayLike) -> Array:
        etrax.compile_etrace_graph(self.inner, x)
        return self.inner(x)


def test_not_a_module() -> None:
    # Under the test suite's runtime type checking the signature itself refuses it ...
    with pytest.raises((TypeError, BeartypeCallHintParamViolation), match="Module"):
        etrax.compile_etrace_graph(lambda x: x, jnp.ones(3))  # type: ignore[arg-type]
    # ... and without it, etrax's own check says what to do.
    unchecked: Any = etrax.extract.__wrapped__  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="update\\(x\\) performs one time step"):
        unchecked(lambda x: x, jnp.ones(3))


def test_states_not_initialised() -> None:
    gru = etrax.nn.GRUCell(3, 4)
    with pytest.raises(etrax.StateNotInitializedError, match="init_all_states"):
        etrax.compile_etrace_graph(gru, jnp.ones(3))


def test_step_writes_a_param_state() -> None:
    model = WritesWeight()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.ParamStateWriteError, match=r"\('w',\)") as info:
        etrax.compile_etrace_graph(model, jnp.ones(3))
    assert info.value.records[-1].kind is etrax.DiagnosticKind.PARAM_STATE_WRITE
    assert isinstance(info.value, etrax.CompilationError)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ((jnp.ones(3), jnp.ones(3)), "do not match"),
        ((), "do not match"),
        ((jnp.ones(5),), "shapes"),
        ((jnp.ones((2, 3)),), "shapes"),
    ],
)
def test_example_inputs_do_not_match_update(args: tuple[Any, ...], pattern: str) -> None:
    model, _ = build(etrax.nn.GRUCell, 3, 4)
    with pytest.raises(etrax.InputStructureError, match=pattern):
        etrax.compile_etrace_graph(model, *args)


class _MixedIndexTypes(brainstate.nn.Module):
    """A delay line written at a 32-bit step counter next to a 64-bit literal index: a
    bug on one line of `update`, not in the example inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = etrax.nn.Linear(3, 4)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.buf = brainstate.HiddenState(jnp.zeros((5, 4)))
        self.k = brainstate.ShortTermState(jnp.array(0, jnp.int32))

    def update(self, x: Array) -> Array:
        start = (self.k.value, jnp.int64(0))  # int32 beside int64: JAX refuses the pair
        self.buf.value = jax.lax.dynamic_update_slice(0.9 * self.buf.value, self.fc(x)[None], start)
        self.k.value = (self.k.value + 1) % 5
        out: Array = self.buf.value[0]
        return out


def test_a_failing_line_of_update_is_named() -> None:
    """A `TypeError` raised by a line of `update` itself is reported with that line
    (file and number), and the advice says to fix it there before it suggests the
    example inputs. Before, the message only blamed the inputs."""
    model = _MixedIndexTypes()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.InputStructureError, match="integers of the same type") as info:
        etrax.compile_etrace_graph(model, jnp.ones(3))
    message = str(info.value)
    line = inspect.getsourcelines(_MixedIndexTypes.update)[1] + 2
    assert f"test_errors.py:{line} (update)" in message
    assert "fix it there; otherwise check that the example inputs" in message
    assert "etrax/" not in message.split("It was raised at")[1]


class _NeedsValues(brainstate.nn.Module):
    """A step whose Python code needs its input's value (`how`)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = etrax.nn.Linear(3, 4)
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Array) -> Array:
        if self.how == "branch":
            if x.sum() > 0:  # a Python branch on a traced value
                x = 2 * x
        elif self.how == "numpy":
            x = jnp.asarray(np.asarray(x))
        else:
            x = x * int(x[0])
        self.h.value = jnp.tanh(0.5 * self.h.value + self.fc(x))
        return self.h.value


@pytest.mark.parametrize(
    ("how", "jax_error"),
    [
        ("branch", "TracerBoolConversionError"),
        ("numpy", "TracerArrayConversionError"),
        ("int", "ConcretizationTypeError|TracerIntegerConversionError"),
    ],
)
def test_a_step_that_needs_its_values_in_python_is_explained(how: str, jax_error: str) -> None:
    """Python that needs a traced value (a branch, NumPy, `int`) is a `NotSupportedError`
    that says why the step cannot do that and what to use instead, not a remark about
    the example inputs."""
    with pytest.raises(etrax.NotSupportedError, match=jax_error) as info:
        etrax.compile_etrace_graph(_NeedsValues(how), jnp.ones(3))
    message = str(info.value)
    assert "jax.lax.cond" in message and "traced once" in message
    assert "example inputs" not in message
    assert "\n" not in message  # JAX's first line only


def test_etp_weight_is_not_a_param_state() -> None:
    model = ConstantWeight()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.WeightNotParamStateError, match="ParamState") as info:
        etrax.compile_etrace_graph(model, jnp.ones(3))
    assert "test_errors.py" in str(info.value)  # points at the user's line
    model2 = DataWeight()
    brainstate.nn.init_all_states(model2)
    with pytest.raises(etrax.WeightNotParamStateError, match="depends on the step's inputs"):
        etrax.compile_etrace_graph(model2, jnp.ones(3))


def test_recursive_compile() -> None:
    model = CompilesInside()
    brainstate.nn.init_all_states(model)
    with pytest.raises(etrax.RecursiveCompileError, match="outside of any transformation"):
        etrax.compile_etrace_graph(model, jnp.ones(3))


def test_compile_under_jit_is_refused() -> None:
    model, x = build(LeakyLinear, 3, 4)

    @jax.jit
    def f(x: Array) -> Array:
        etrax.compile_etrace_graph(model, x)
        return x

    with pytest.raises(etrax.RecursiveCompileError):
        f(x)


def test_op_argument_errors() -> None:
    with pytest.raises(ValueError, match="input features"):
        etrax.matmul(jnp.ones(3), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=r"\(batch, in\)"):
        etrax.matmul(jnp.ones((2, 2, 3)), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="bias"):
        etrax.matmul(jnp.ones(3), jnp.ones((3, 2)), jnp.ones(3))
    with pytest.raises(TypeError, match="weight_fn"):
        etrax.matmul(jnp.ones(3), jnp.ones((3, 2)), weight_fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty"):
        etrax.register_primitive("", lambda x: x)
