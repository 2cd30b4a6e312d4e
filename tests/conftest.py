"""Test configuration: float64, strict dtype promotion, two fake CPU devices.

Runtime type checking (jaxtyping + beartype over the whole `etrax` package) is
switched on by ``--jaxtyping-packages`` in ``pyproject.toml``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import brainstate  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

# brainstate may reset jax_enable_x64 on import: set precision through it as well.
jax.config.update("jax_enable_x64", True)
brainstate.environ.set(precision=64)
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _float64() -> None:
    """Every test runs in float64 (some tests may switch precision locally)."""
    jax.config.update("jax_enable_x64", True)
    brainstate.environ.set(precision=64)
