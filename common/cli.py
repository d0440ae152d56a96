"""`sprinter`: one console script; each package contributes its subcommands through entry points.

Subcommands are found in the `sprinter.commands` entry-point group (see pyproject.toml), so this
module, like the rest of `common`, never imports `edge` or `cloud`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points

from common.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sprinter", description="Edge-cloud speculative decoding.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in sorted(entry_points(group="sprinter.commands"), key=lambda e: e.name):
        try:
            register = entry.load()
        except (ImportError, AttributeError) as err:  # one broken subcommand must not take the others down
            print(f"sprinter: subcommand {entry.name!r} is unavailable: {err}", file=sys.stderr)
            continue
        register(subcommands)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The namespace every command's `run` gets: its flags, plus `argv` (for a command that starts copies of itself)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.run(args) or 0)
    except UsageError as err:  # a newcomer's mistake gets one line, as argparse gives a bad flag
        print(f"sprinter: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
