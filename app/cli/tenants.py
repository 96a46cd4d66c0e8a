"""`loraland tenants ...`: create tenants, list them, rotate their API keys (a key is printed once, when made)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from app.cli.output import catalog_from_args, json_option, print_json, table


def register(subparsers: Any) -> None:
    js = json_option()
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
