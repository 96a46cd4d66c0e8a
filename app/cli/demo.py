"""The demo: a tiny character-level model and task adapters anyone can check (`loraland demo-assets`),
served on the local stack with live results (`loraland demo`). Imports stay light until a command runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def register_demo(subparsers) -> None:
    """Add `demo-assets` and `demo` to an argparse subparsers object (each sets `func(args) -> int`)."""
    a = subparsers.add_parser(
        "demo-assets",
        help="train the demo base model and its adapters (upper, reverse, rot13) on CPU, or reuse them",
        description="Seeded, reproducible CPU training (about three minutes on two cores). The default folder "
        "is <cache_dir>/demo ($LORALAND_CACHE_DIR, else ~/.cache/loraland); a matching build is reused.",
    )
    a.add_argument("--out", type=Path, default=None, help="where to write them (default: <cache_dir>/demo)")
    a.add_argument("--force", action="store_true", help="rebuild even if a matching build is there")
    a.set_defaults(func=_cmd_assets)

    d = subparsers.add_parser(
        "demo",
        help="serve the demo model and adapters locally and show live results (Ctrl-C stops everything)",
        description="Builds or reuses the demo assets, starts a local Ray with a private Redis and no auth "
        "(loopback only), registers the adapters and prints results and ready-to-paste requests.",
    )
    d.add_argument(
        "--assets",
        type=Path,
        default=None,
        help="demo assets folder (default: a build committed under app/demo/assets, else <cache_dir>/demo)",
    )
    d.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--once", action="store_true", help="print the results, then shut down instead of serving")
    d.set_defaults(func=_cmd_demo)


def _cmd_assets(args: argparse.Namespace) -> int:
    from app.demo.assets import build_assets

    out = build_assets(args.out, force=args.force, say=print)
    print(out)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from app.demo.run_demo import run_demo

    return run_demo(args)
