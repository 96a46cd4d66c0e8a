"""The catalog's CLI commands: `adapters ...` (in cli_adapters.py), `tenants ...`, `placement`. Tables for people, --json for
scripts. Heavy imports (redis, boto3, torch via app.replica.lora.peft_format) happen inside the commands."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from app.cli.adapters import (
    cmd_list,
    cmd_pin,
    cmd_push,
    cmd_register,
    cmd_rm,
    cmd_show,
    cmd_validate,
)
from app.cli.output import catalog_from_args, print_json, table


def register(subparsers: Any) -> None:
    js = argparse.ArgumentParser(add_help=False)
    js.add_argument("--json", action="store_true", help="print JSON instead of a table")
    owner = argparse.ArgumentParser(add_help=False)
    owner.add_argument("--tenant", help="the tenant that owns the adapter (default: none, admin-owned)")
    owner.add_argument("--public", action="store_true", help="every tenant may use it")
    owner.add_argument(
        "--model", help="base model folder or Hub id: validate against it and record its identity"
    )
    owner.add_argument(
        "--max-rank", type=int, default=64, help="refuse adapters above this rank (default 64)"
    )

    adapters = subparsers.add_parser("adapters", help="push, register, list, show, remove and pin adapters")
    a = adapters.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = a.add_parser("push", parents=[owner, js], help="validate DIR, upload it to S3 and register it")
    p.add_argument("name")
    p.add_argument("dir", type=Path)
    p.add_argument("--to", required=True, metavar="s3://BUCKET/PREFIX", help="where to upload the files")
    p.add_argument("--overwrite", action="store_true", help="replace different files already at the prefix")
    p.add_argument("--no-progress", action="store_true", help="no upload progress bar")
    p.set_defaults(func=cmd_push)
    p = a.add_parser(
        "register", parents=[owner, js], help="register an adapter already at URI (s3://, hf://, folder)"
    )
    p.add_argument("name")
    p.add_argument("uri")
    p.set_defaults(func=cmd_register)
    p = a.add_parser("list", parents=[js], help="the newest version of every adapter")
    p.add_argument("--tenant", help="only the adapters this tenant may use (its own and public ones)")
    p.set_defaults(func=cmd_list)
    p = a.add_parser("show", parents=[js], help="one adapter's record: NAME (newest) or NAME@V")
    p.add_argument("ref", metavar="NAME[@V]")
    p.set_defaults(func=cmd_show)
    p = a.add_parser("rm", parents=[js], help="remove NAME@V, or every version of NAME")
    p.add_argument("ref", metavar="NAME[@V]")
    p.set_defaults(func=cmd_rm)
    for action, pinned in (("pin", True), ("unpin", False)):
        p = a.add_parser(action, help=f"{action} NAME: pinned adapters are never evicted from a replica")
        p.add_argument("name")
        p.set_defaults(func=cmd_pin, pinned=pinned)
    p = a.add_parser("validate", parents=[js], help="check DIR is a PEFT LoRA adapter that fits MODEL")
    p.add_argument("dir", type=Path)
    p.add_argument("--model", required=True, help="base model folder or Hub id")
    p.add_argument("--max-rank", type=int, default=64)
    p.set_defaults(func=cmd_validate)

    tenants = subparsers.add_parser("tenants", help="create and list tenants, rotate their API keys")
    t = tenants.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = t.add_parser("create", parents=[js], help="create tenant NAME and print its API key (shown once)")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_create)
    p = t.add_parser("list", parents=[js], help="all tenants")
    p.set_defaults(func=cmd_tenant_list)
    p = t.add_parser("rotate-key", parents=[js], help="replace NAME's API key (the old one stops working)")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_rotate)

    p = subparsers.add_parser("placement", parents=[js], help="live replicas and the adapters each holds")
    p.set_defaults(func=cmd_placement)


# ----------------------------------------------------------------- tenants and placement


def cmd_tenant_create(args: argparse.Namespace) -> int:
    key = catalog_from_args(args).create_tenant(args.name)
    if args.json:
        print_json({"name": args.name, "api_key": key})
    else:
        print(f"created tenant {args.name}; its API key (shown only now, stored hashed):\n{key}")
    return 0


def cmd_tenant_rotate(args: argparse.Namespace) -> int:
    key = catalog_from_args(args).rotate_key(args.name)
    if args.json:
        print_json({"name": args.name, "api_key": key})
    else:
        print(f"new API key for {args.name} (the old one no longer works; shown only now):\n{key}")
    return 0


def cmd_tenant_list(args: argparse.Namespace) -> int:
    catalog = catalog_from_args(args)
    tenants = catalog.list_tenants()
    owned: dict[str, int] = {}
    for r in catalog.list():
        if r.tenant:
            owned[r.tenant] = owned.get(r.tenant, 0) + 1
    for t in tenants:
        t["adapters"] = owned.get(t["name"], 0)
    if args.json:
        print_json(tenants)
        return 0
    fmt = "%Y-%m-%d %H:%M"
    rows = [
        [
            t["name"],
            t["adapters"],
            t.get("key_hint", "") + "...",
            time.strftime(fmt, time.localtime(t["created"])),
            time.strftime(fmt, time.localtime(t["rotated"])) if t.get("rotated") else None,
        ]
        for t in tenants
    ]
    table(["NAME", "ADAPTERS", "KEY", "CREATED", "ROTATED"], rows)
    return 0


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
