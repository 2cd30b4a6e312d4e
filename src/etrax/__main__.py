"""Command line: ``python -m etrax demo``."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m etrax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a GRU and a spiking digits classifier online and show it (about a minute)",
    )
    demo.add_argument("--out", default=".", help="folder for etrax_demo.png")
    demo.add_argument(
        "--quick",
        action="store_true",
        help="a few iterations only (a smoke test, about half the time)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo

        run_demo(args.out, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
