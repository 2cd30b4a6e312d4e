"""What XLA's compiler options trade on this device: time to first gradient against
per-step time (`python benchmarks/run.py compile [options]`, or `nox -s bench --
compile`).

For each configuration of the peer benchmark's CPU matrix and each of etrax's online
rules (``DRTRL()``, ``PPProp(0.9)``, ``EProp(0.9)``), etrax is run with XLA's defaults
and with ``--options`` (default: XLA:CPU's older element-wise emitters,
``{"xla_cpu_use_fusion_emitters": False}``), passed to ``etrax.compile(...,
compiler_options=...)``: the time to first gradient through the user path (the best
of ``--builds`` builds, each from cleared JAX caches, beside braintrace 0.2.6's for
the ratio) and the per-step time of the compiled ``T``-step program (median of
interleaved rounds). "calls to break even" is the number of ``T``-step calls after
which the options' shorter compile has been spent on their slower steps (– when the
steps are not slower). Results go to ``<out>/compile_<device>.md``.
"""

import argparse
import ast
import math
from collections.abc import Sequence
from typing import Any

import jax

import etrax

from ._common import write_device_report
from .bench_peer import (
    MATRICES,
    Config,
    Lib,
    Program,
    _interleaved,
    add_only_option,
    add_timing_options,
    build_program,
    first_call,
    make_data,
)

METHODS = ("D-RTRL", "pp-prop", "e-prop")
FAST_COMPILE: etrax.CompilerOptions = {"xla_cpu_use_fusion_emitters": False}
"""XLA:CPU's older element-wise emitters: about half the compile time of a small
online program, slower code for ``tanh`` and sigmoids (see docs/benchmarks.md)."""


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run.py compile", description=__doc__.split("\n\n")[0])
    add_only_option(parser)
    parser.add_argument(
        "--options",
        type=ast.literal_eval,
        default=FAST_COMPILE,
        help="XLA options as a Python dict, e.g. \"{'xla_cpu_use_fusion_emitters': False}\"",
    )
    parser.add_argument("--builds", type=int, default=2, help="builds per first gradient")
    add_timing_options(parser, steps=32, rounds=7)
    return parser.parse_args(list(argv))


def _first_seconds(
    lib: Lib, method: str, cfg: Config, data: Any, options: etrax.CompilerOptions | None, n: int
) -> float:
    return min(first_call(lib, method, cfg, data, options).seconds for _ in range(n))


def _break_even(compile_saved: float, step_cost: float, steps: int) -> str:
    if step_cost <= 0.0:
        return "–"
    if compile_saved <= 0.0:
        return "never"
    return f"{math.ceil(compile_saved / (step_cost * steps)):,}"


def run(argv: Sequence[str] = ()) -> str:
    args = _arguments(argv)
    options: etrax.CompilerOptions = args.options
    configs: Sequence[Config] = args.only or MATRICES["cpu"]
    T: int = args.steps
    variants: tuple[tuple[str, Lib, etrax.CompilerOptions | None], ...] = (
        ("default", "etrax", None),
        ("options", "etrax", options),
        ("braintrace", "braintrace", None),
    )
    header = [
        "model", "L", "H", "B", "method",
        "1st grad s default", "1st grad s options", "1st grad s braintrace",
        "default / braintrace", "options / braintrace",
        "µs/step default", "µs/step options", "options / default",
        "calls to break even",
    ]  # fmt: skip
    rows: list[list[str]] = []
    for cfg in configs:
        print(f"  {cfg.label}", flush=True)
        data = make_data(cfg, T)
        firsts: dict[tuple[str, str], float] = {}
        for method in METHODS:
            for variant, lib, opts in variants:
                seconds = _first_seconds(lib, method, cfg, data, opts, args.builds)
                firsts[method, variant] = seconds
                print(f"    {method:8s} {variant:10s} first gradient {seconds:6.2f} s", flush=True)
        programs: dict[tuple[Lib, str], Program] = {}
        for method in METHODS:
            programs["etrax", f"{method}:default"] = build_program(
                "etrax", method, cfg, data, compiler_options=None
            )
            programs["etrax", f"{method}:options"] = build_program(
                "etrax", method, cfg, data, compiler_options=options
            )
        per_call = _interleaved(programs, args.rounds, args.min_time)
        size = [cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch)]
        for method in METHODS:
            default, fast = (per_call["etrax", f"{method}:{v}"] / T for v in ("default", "options"))
            f_default, f_options, f_peer = (
                firsts[method, v] for v in ("default", "options", "braintrace")
            )
            rows.append(
                [
                    *size,
                    method,
                    f"{f_default:.2f}",
                    f"{f_options:.2f}",
                    f"{f_peer:.2f}",
                    f"{f_default / f_peer:.2f}",
                    f"{f_options / f_peer:.2f}",
                    f"{default * 1e6:,.1f}",
                    f"{fast * 1e6:,.1f}",
                    f"{fast / default:.2f}",
                    _break_even(f_default - f_options, fast - default, T),
                ]
            )
        jax.clear_caches()  # type: ignore[no-untyped-call]  # unannotated in JAX
    preamble = (
        f"jax {jax.__version__}, float32, T = {T}; options {dict(options)!r}; first "
        f"gradient the best of {args.builds} builds from cleared caches; per-step time "
        f"the median of {args.rounds} interleaved rounds."
    )
    title = "Compiler options: first gradient against step time"
    return write_device_report(args.out, "compile", title, preamble, header, rows)
