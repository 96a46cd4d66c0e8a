"""`loraland placement`: the live replicas (load, free slots, last heartbeat) and the adapters each holds."""

from __future__ import annotations

import argparse
import time
from typing import Any

from app.cli.output import catalog_from_args, json_option, print_json, table


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "placement", parents=[json_option()], help="live replicas and the adapters each holds"
    )
    p.set_defaults(func=cmd_placement)


def cmd_placement(args: argparse.Namespace) -> int:
    catalog = catalog_from_args(args)
    replicas = catalog.replicas()
    placement: dict[str, list[str]] = {}
    for rid, info in sorted(replicas.items()):
        for a in info.resident:
            placement.setdefault(a, []).append(rid)
    if args.json:
        print_json({"replicas": {rid: r.to_dict() for rid, r in replicas.items()}, "adapters": placement})
        return 0
    now = time.time()
    rows = [
        [
            rid,
            r.free_slots,
            f"{r.load:.2f}",
            r.queue_len,
            f"{r.kv_usage:.0%}",
            f"{max(0.0, now - r.heartbeat):.1f}s",
            len(r.resident),
        ]
        for rid, r in sorted(replicas.items())
    ]
    table(["REPLICA", "FREE_SLOTS", "LOAD", "QUEUE", "KV", "LAST_BEAT", "ADAPTERS"], rows)
    if placement:
        print()
        table(["ADAPTER", "REPLICAS"], [[a, ", ".join(ids)] for a, ids in sorted(placement.items())])
    return 0
