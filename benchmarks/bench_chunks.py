"""How the chunk length moves the online rules' per-step time
(`python benchmarks/run.py chunks [options]`, or `nox -s bench -- chunks`).

For each configuration (the peer benchmark's models: stacked GRU / LSTM / LIF / ALIF
layers → ``Linear(H, 1)``) and each of etrax's ``DRTRL()``, ``PPProp(0.9)`` and
``EProp(0.9)``, the compiled ``T``-step ``online_grad`` program with every
``chunk_steps`` in ``--chunks`` (default 1, 8 and 32), timed in interleaved rounds
beside the model's own forward step (medians; no Python dispatch). The gradients do
not depend on the chunk length; its best value does, on the device and the size: a
chunk turns each step's contractions into one product with ``K · B`` rows, but keeps
each step's operands, and on a GPU every stacking write is one more kernel launch.
Results go to ``<out>/chunks_<device>.md``. braintrace is not involved.
"""

import argparse
from collections.abc import Sequence

import jax

from ._common import write_device_report
from .bench_peer import (
    Config,
    Lib,
    Program,
    _interleaved,
    add_only_option,
    add_timing_options,
    build_program,
    make_data,
)

METHODS = ("D-RTRL", "pp-prop", "e-prop")
CONFIGS = (
    Config("GRU", 1, 128, 1),
    Config("GRU", 1, 512, 1),
    Config("GRU", 1, 128, 32),
    Config("GRU", 1, 512, 32),
    Config("LIF", 1, 512, 32),
)


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run.py chunks", description=__doc__.split("\n\n")[0])
    add_only_option(parser)
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[1, 8, 32], help="the chunk lengths to time"
    )
    add_timing_options(parser, steps=64, rounds=5)
    return parser.parse_args(list(argv))


def run(argv: Sequence[str] = ()) -> str:
    args = _arguments(argv)
    configs: Sequence[Config] = args.only or CONFIGS
    chunks: list[int] = args.chunks
    header = ["model", "L", "H", "B", "method", *(f"K = {k} µs/step" for k in chunks)]
    header += ["best K", "best × fwd"]
    rows: list[list[str]] = []
    for cfg in configs:
        print(f"  {cfg.label}", flush=True)
        data = make_data(cfg, args.steps)
        programs: dict[tuple[Lib, str], Program] = {
            ("etrax", "forward"): build_program("etrax", "forward", cfg, data)
        }
        for method in METHODS:
            for k in chunks:
                programs["etrax", f"{method}:{k}"] = build_program("etrax", method, cfg, data, k)
        per_call = _interleaved(programs, args.rounds, args.min_time)
        forward = per_call["etrax", "forward"] / args.steps
        size = [cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch)]
        rows.append([*size, "forward", *(f"{forward * 1e6:,.1f}" for _ in chunks), "–", "1.00"])
        for method in METHODS:
            times = [per_call["etrax", f"{method}:{k}"] / args.steps for k in chunks]
            best = min(range(len(chunks)), key=lambda i: times[i])
            cells = [f"{t * 1e6:,.1f}" for t in times]
            rows.append([*size, method, *cells, str(chunks[best]), f"{times[best] / forward:.2f}"])
        jax.clear_caches()  # type: ignore[no-untyped-call]  # unannotated in JAX
    preamble = (
        f"jax {jax.__version__}, float32, T = {args.steps}, median of {args.rounds} "
        "interleaved rounds."
    )
    title = "Per-step time by chunk length"
    return write_device_report(args.out, "chunks", title, preamble, header, rows)
