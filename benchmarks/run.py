"""Run the benchmarks (`nox -s bench`): `python benchmarks/run.py
[executor|online|peer|chunks|compile|parts|scale ...] [--option ...]`; options (after the
names) go to the suites that take them, e.g. `python benchmarks/run.py peer --matrix
gpu --out DIR` (see `bench_peer.py`). With no names, every suite but `chunks`,
`compile` and `parts` runs."""

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_executor, bench_online


def _peer(options: Sequence[str]) -> str:
    # imported here: braintrace, the peer it measures, is installed only by `nox -s bench`
    from benchmarks import bench_peer

    return bench_peer.run(options)


def _chunks(options: Sequence[str]) -> str:
    from benchmarks import bench_chunks  # builds its models with bench_peer's (braintrace)

    return bench_chunks.run(options)


def _compile(options: Sequence[str]) -> str:
    from benchmarks import bench_compile  # measures braintrace's first gradient beside

    return bench_compile.run(options)


def _parts(options: Sequence[str]) -> str:
    from benchmarks import bench_parts  # times braintrace's pp-prop beside

    return bench_parts.run(options)


def _scale(options: Sequence[str]) -> str:
    from benchmarks import bench_scale  # builds its models with bench_peer's (braintrace)

    return bench_scale.run(options)


OPT_IN = ("chunks", "compile", "parts")
"""Suites that run only when named (each re-measures part of `peer` another way)."""

SUITES: dict[str, Callable[[Sequence[str]], str]] = {
    "executor": lambda options: bench_executor.run(),
    "online": lambda options: bench_online.run(),
    "peer": _peer,
    "chunks": _chunks,
    "compile": _compile,
    "parts": _parts,
    "scale": _scale,
}


def main(argv: list[str]) -> int:
    split = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    names, options = argv[:split] or [n for n in SUITES if n not in OPT_IN], argv[split:]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(SUITES)}")
        return 2
    for name in names:
        print(f"== {name}")
        print(SUITES[name](options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
