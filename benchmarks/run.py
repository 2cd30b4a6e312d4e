"""Run the benchmarks (`nox -s bench`): `python benchmarks/run.py [executor ...]`."""

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_executor, bench_online

SUITES: dict[str, Callable[[], str]] = {"executor": bench_executor.run, "online": bench_online.run}


def main(argv: list[str]) -> int:
    names = argv or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(SUITES)}")
        return 2
    for name in names:
        print(f"== {name}")
        print(SUITES[name]())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
