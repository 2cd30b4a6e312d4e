"""Test configuration: float64, strict dtype promotion, two fake CPU devices, fast XLA
compilation.

Runtime type checking (jaxtyping + beartype over the whole `etrax` package) is
switched on by ``--jaxtyping-packages`` in ``pyproject.toml``.
"""

import os

# Two fake CPU devices for the multi-device tests. The suite compiles hundreds of tiny
# XLA programs and runs each a few times, so LLVM's optimisations cost more than they
# save: level 0 cuts compile time by about a quarter, and XLA:CPU's older element-wise
# emitters (``--xla_cpu_use_fusion_emitters=false``) compile a small program about a
# third faster than the fusion emitters (numerics are unchanged to the tolerances
# checked). The generated-model test, which compiles thousands of single-op programs,
# gains most. One LLVM module per program (``--xla_cpu_parallel_codegen_split_count=1``)
# instead of several compiled on a thread pool: the tests already run on two workers,
# and the generated-model test spent about 12 % less CPU time (XLA's compile time fell
# from 6.6 to 5.4 s per 30 models).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1",
)

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator

import brainevent
import brainstate
import jax
import jax.numpy as jnp
import pytest

# One XLA compilation cache per test run, shared by the xdist workers: the first process
# to load this file (the xdist controller, or a plain pytest process) makes an empty
# folder, passes it on to the workers it starts through the environment, and removes it
# when it exits. Both workers compile many identical programs (every eager op on a given
# shape, brainstate's initialisers, the shared catalogue models), and a cached program
# is read back in about a millisecond instead of 15-100 ms of XLA compilation: the suite
# ran in 4:49 instead of 5:28. Nothing carries over between runs. `tests/compiles.py`
# counts a program read from this cache as a compilation, so "compiles nothing" still
# means that the in-memory caches were hit.
_CACHE_VAR = "ETRAX_TESTS_XLA_CACHE"
if _CACHE_VAR not in os.environ:
    os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="etrax-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE_VAR], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VAR])  # type: ignore[no-untyped-call]  # unannotated in JAX
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # type: ignore[no-untyped-call]  # unannotated in JAX
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)  # type: ignore[no-untyped-call]  # unannotated in JAX

# brainstate 0.5.4's `RandomState.truncated_normal` checks its bounds with
# `jit_error_if`, an eager `lax.cond` over a new `functools.partial` at each call, so
# every weight drawn outside a trace (brainstate's default `KaimingNormal` initialiser,
# whose bounds are the constants ±2 std) traces, lowers and compiles a new `cond`
# program: about 30 ms per weight, 820 programs and 23 s of worker time over the suite.
# The tests draw no bounds that could fail the check, so it is skipped here; a test
# that passes ``check_valid`` still gets what it asks for.
setattr(  # noqa: B010  # the stub does not declare the method
    brainstate.random.RandomState,
    "truncated_normal",
    functools.partialmethod(
        brainstate.random.RandomState.truncated_normal,  # type: ignore[attr-defined]
        check_valid=False,
    ),
)

# brainstate may reset jax_enable_x64 on import: set the precision through brainstate,
# which also switches JAX to 64 bits.
brainstate.environ.set(precision=64)
jax.config.update("jax_numpy_dtype_promotion", "strict")  # type: ignore[no-untyped-call]  # unannotated in JAX


@pytest.fixture(autouse=True)
def _float64() -> None:
    """Every test runs in float64 (some tests may switch precision locally)."""
    brainstate.environ.set(precision=64)
    assert jnp.zeros(()).dtype == jnp.float64


FIRST = "tests/test_generated.py::Test"
"""The generated-model test's two halves (about a third of the suite's CPU time).
Under ``-n 2 --dist loadscope`` each half is one scope, and xdist hands out scopes
in collection order, so collecting them first starts one half on each worker at
once: the longest jobs go first and the rest fill in around them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: order kept


@pytest.fixture
def jax_event_kernels() -> Iterator[None]:
    """brainevent's pure-JAX kernels while a test runs brainevent's products itself (an
    oracle through a model's own ``update``): its default CPU kernels need numba, which
    the test environment leaves out. etrax's programs hold none of them."""
    before = brainevent.config.get_backend("cpu")
    brainevent.config.set_backend("cpu", "jax_raw")
    yield
    brainevent.config.set_backend("cpu", before)
