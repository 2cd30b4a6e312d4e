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

import brainstate
import jax
import jax.numpy as jnp
import pytest

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
