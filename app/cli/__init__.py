"""`loraland`, the command line: `loraland [--redis URL] COMMAND ...` (also `python -m app.cli`).

Each command group is one module of this package exposing `register(subparsers)`, which adds its subparser(s)
and sets `func(args) -> int` on each; a new group is a new module listed in COMMAND_MODULES. output.py holds
what they share. Expected failures (app.errors, bad input, unreachable services) print one line and exit 1;
argparse's usage errors exit 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# In `loraland --help` order; imported when the parser is built, so keep their top-level imports light.
COMMAND_MODULES = (
    "app.cli.adapters",  # adapters push | register | list | show | rm | pin | unpin | validate
    "app.cli.tenants",  # tenants create | list | rotate-key
    "app.cli.placement",  # placement
    "app.cli.serve",  # serve
    "app.cli.demo",  # demo-assets, demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraland",
        description="LoRA-Land: serve, and administer the adapter catalog, tenants and placement.",
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="Redis URL of the catalog, e.g. redis://127.0.0.1:6379/0 (default: $LORALAND_REDIS_URL)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    from app.errors import LoraLandError

    args = build_parser().parse_args(argv)
    try:
        if args.redis is None:
            from app.config.settings import Settings

            args.redis = Settings.from_env().redis_url
        return int(args.func(args) or 0)
    except (LoraLandError, ValueError, OSError) as e:
        # ValueError/OSError: bad settings, a model config we cannot read, a folder that is not there.
        print(f"loraland: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loraland: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
