"""Where pp-prop's time goes, part by part (`python benchmarks/run.py parts
[options]`, or `nox -s bench -- parts`).

For each configuration (the peer benchmark's GRU models by default), etrax's
``PPProp(0.9)`` program is built four ways: whole; without the reset-gate weight's
exact instantaneous gradient (the deferred gradients of the uses inside equations:
their stacked operands, backward product and contraction; "no Wr"); without the
stacked contractions of the traced weights (`stream_finish`; "no contraction"); and
without both. A part is removed by zeroing its result inside the traced program, so
that XLA drops the part and the per-step stacking that feeds only it: those programs'
gradients are wrong, they only time the rest. They run in interleaved rounds beside
braintrace's pp-prop and the model's forward step (medians, no Python dispatch).
Results go to ``<out>/parts_<device>.md``.
"""

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp

from etrax.algorithms import _drivers, _pp

from ._common import write_device_report
from .bench_peer import (
    Config,
    Data,
    Lib,
    Program,
    _interleaved,
    add_only_option,
    add_timing_options,
    build_program,
    make_data,
)

CONFIGS = (Config("GRU", 1, 128, 1), Config("GRU", 1, 512, 32))
PARTS = ("full", "no Wr", "no contraction", "neither")
"""The program variants: which parts of pp-prop's gradient are left out."""


def _zeroed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with every array of its result replaced by zeros of the same shape."""

    def zero(*args: Any, **kwargs: Any) -> Any:
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), fn(*args, **kwargs))

    return zero


@contextlib.contextmanager
def _without(part: str) -> Iterator[None]:
    """While tracing inside: etrax's pp-prop with `part` (one of `PARTS`) zeroed."""
    with contextlib.ExitStack() as stack:
        if part in ("no Wr", "neither"):
            deferred = _zeroed(_drivers._deferred_use_grads)
            stack.enter_context(mock.patch.object(_drivers, "_deferred_use_grads", deferred))
        if part in ("no contraction", "neither"):
            finish = _zeroed(_pp.InputOutput.stream_finish)
            stack.enter_context(mock.patch.object(_pp.InputOutput, "stream_finish", finish))
        yield


def _programs(cfg: Config, data: Data) -> dict[tuple[Lib, str], Program]:
    programs: dict[tuple[Lib, str], Program] = {
        ("etrax", "forward"): build_program("etrax", "forward", cfg, data),
        ("braintrace", "pp-prop"): build_program("braintrace", "pp-prop", cfg, data),
    }
    for part in PARTS:
        with _without(part):
            programs["etrax", part] = build_program("etrax", "pp-prop", cfg, data)
    return programs


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run.py parts", description=__doc__.split("\n\n")[0])
    add_only_option(parser)
    add_timing_options(parser, steps=64, rounds=5)
    return parser.parse_args(list(argv))


def run(argv: Sequence[str] = ()) -> str:
    args = _arguments(argv)
    configs: Sequence[Config] = args.only or CONFIGS
    header = ["model", "L", "H", "B", *(f"{p} µs/step" for p in PARTS)]
    header += ["braintrace µs/step", "forward µs/step", "gradient part / step"]
    rows: list[list[str]] = []
    for cfg in configs:
        print(f"  {cfg.label}", flush=True)
        programs = _programs(cfg, make_data(cfg, args.steps))
        per_call = _interleaved(programs, args.rounds, args.min_time)
        us = {key: seconds / args.steps * 1e6 for key, seconds in per_call.items()}
        parts = [us["etrax", p] for p in PARTS]
        share = (parts[0] - parts[-1]) / parts[0]
        rows.append(
            [cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch)]
            + [f"{t:,.1f}" for t in parts]
            + [f"{us['braintrace', 'pp-prop']:,.1f}", f"{us['etrax', 'forward']:,.1f}"]
            + [f"{share:.0%}"]
        )
        jax.clear_caches()  # type: ignore[no-untyped-call]  # unannotated in JAX
    preamble = (
        f"jax {jax.__version__}, float32, T = {args.steps}, median of {args.rounds} "
        "interleaved rounds. A part is left out by zeroing its result in the traced "
        "program (the gradients of those variants are wrong: they time the rest)."
    )
    return write_device_report(args.out, "parts", "pp-prop by parts", preamble, header, rows)
