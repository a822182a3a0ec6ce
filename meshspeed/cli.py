"""The `meshspeed` command: one entry point, subcommands contributed by meshspeed/commands/*.

Each module listed in SUBCOMMANDS defines `register(subparsers)` which adds its parser and sets
`func` (called with the parsed namespace, returns an exit code). Modules are imported lazily per
invocation so `meshspeed --help` stays fast and a broken optional dependency (matplotlib) only
affects the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "meshspeed.commands.bench",
    "meshspeed.commands.convert",
    "meshspeed.commands.data",
    "meshspeed.commands.eval",
    "meshspeed.commands.generate",
    "meshspeed.commands.pipeline",
    "meshspeed.commands.plan",
    "meshspeed.commands.run",
    "meshspeed.commands.sample",
    "meshspeed.commands.train",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshspeed",
        description="Train large transformer and MoE models across many devices on plain torch.distributed.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("meshspeed: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
