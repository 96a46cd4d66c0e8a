"""Output and connection helpers shared by the CLI command modules."""

from __future__ import annotations

import argparse
import json
from typing import Any

from app.errors import InvalidRequest


def catalog_from_args(args: argparse.Namespace) -> Any:
    from app.catalog.store import Catalog

    if not args.redis:
        raise InvalidRequest("no catalog: pass --redis redis://HOST:PORT/DB or set LORALAND_REDIS_URL")
    return Catalog(args.redis)


def json_option() -> argparse.ArgumentParser:
    """A parent parser (argparse's `parents=[...]`) adding --json to a command."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
