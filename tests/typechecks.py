"""The suite's runtime type checks (jaxtyping + beartype over the whole package,
switched on by ``--jaxtyping-packages`` in ``pyproject.toml``), paused where a test
needs to reach what a user without them reaches: etrax's own argument checks, or a
hot loop that the checks would only slow down."""

import contextlib
from collections.abc import Iterator

import jaxtyping


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Runtime type checks paused, restored after."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)
