"""Counting XLA compilations in tests (JAX's backend-compile monitoring events, which
also mark a program read back from the persistent compilation cache that `conftest.py`
shares between the workers: each is a miss of JAX's in-memory caches), and reading
the loops of a traced program (`scan_outputs`)."""

import threading
from typing import Any

import jax
import jax.extend

__all__ = ["CompileCount", "scan_outputs"]


def scan_outputs(jaxpr: Any, length: int) -> list[tuple[int, ...]]:
    """The shapes of the stacked outputs of every ``scan`` of `length` steps in
    `jaxpr`, nested ones included."""
    shapes: list[tuple[int, ...]] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and eqn.params["length"] == length:
            n_carry = eqn.params["num_carry"]
            shapes += [tuple(v.aval.shape) for v in eqn.outvars[n_carry:]]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += scan_outputs(sub, length)
    return shapes


class CompileCount:
    """Counts XLA compilations inside a ``with`` block (`count`)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []  # the compiled functions' names, for failure messages
        self.elsewhere: list[str] = []  # compiled by other threads: not counted
        self._thread = threading.get_ident()

    def _listen(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event != self.EVENT:
            return
        name = str(kwargs.get("fun_name", "?"))
        if threading.get_ident() != self._thread:
            self.elsewhere.append(name)
            return
        self.count += 1
        self.names.append(name)

    def __enter__(self) -> "CompileCount":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
