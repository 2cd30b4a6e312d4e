"""`CompileCount` under the suite's shared persistent compilation cache (`conftest.py`):
a program read back from that cache still counts, so "compiles nothing" keeps meaning
that JAX's in-memory caches were hit."""

from typing import Any

import jax
import jax.numpy as jnp

from .compiles import CompileCount


def _fresh_program() -> Any:
    # a new Python function each time: JAX's in-memory caches miss, the HLO is the same
    return jax.jit(lambda x: jnp.sin(x) * 7.25 + 0.5)


class _CacheHits:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: str, **kwargs: str | int) -> None:
        self.count += event == "/jax/compilation_cache/cache_hits"


def test_a_program_read_from_the_persistent_cache_counts_as_a_compilation() -> None:
    assert getattr(jax.config, "jax_compilation_cache_dir", None)  # one per run, shared
    x, y = jnp.linspace(0.0, 1.0, 13), jnp.linspace(1.0, 2.0, 13)
    hits = _CacheHits()
    with CompileCount() as first:
        _fresh_program()(x).block_until_ready()
    jax.monitoring.register_event_listener(hits)
    try:
        with CompileCount() as second:
            _fresh_program()(x).block_until_ready()
    finally:
        jax.monitoring.unregister_event_listener(hits)
    with CompileCount() as again:
        program = _fresh_program()
        program(x).block_until_ready()
        program(y).block_until_ready()
    assert first.count == 1
    assert hits.count == 1  # the second program was read back from the cache ...
    assert second.count == 1  # ... and counted
    assert again.count == 1  # the second call of one program fetches nothing
