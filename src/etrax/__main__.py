"""Command line: ``python -m etrax demo``."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m etrax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile the bundled example models and show their graphs")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo

        run_demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
