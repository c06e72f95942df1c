"""The ``tft-bridge`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tft-bridge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tft-bridge {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run a simulated recovery end to end")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        print("tft-bridge demo: not yet available (lands with the daemon)")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
