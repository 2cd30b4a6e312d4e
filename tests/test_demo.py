"""The demo runs end to end (a few iterations) and writes its plot."""

from pathlib import Path

import brainstate
import jax
import pytest

from etrax._demo import run_demo


@pytest.mark.slow
def test_demo_quick(tmp_path: Path) -> None:
    # The demo runs in float32 as a user would run it. optax's Adam (0.2.8) mixes
    # Python floats with int32 step counts, which strict dtype promotion rejects, so
    # this one test uses JAX's standard promotion (etrax itself is strict-clean).
    brainstate.environ.set(precision=32)
    jax.config.update("jax_numpy_dtype_promotion", "standard")  # type: ignore[no-untyped-call]  # unannotated
    try:
        path = run_demo(str(tmp_path), quick=True)
    finally:
        jax.config.update("jax_numpy_dtype_promotion", "strict")  # type: ignore[no-untyped-call]  # unannotated
        brainstate.environ.set(precision=64)
    assert path.exists() and path.stat().st_size > 10_000
