"""`loraland tenants ...`: create tenants, list them, rotate their API keys (a key is printed once, when made),
set their fair-share weights, and set or show the quotas of tenants and adapters (app/catalog/quotas.py; no quota is unlimited)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from app.catalog.tenants import MAX_WEIGHT, MIN_WEIGHT
from app.cli.output import catalog_from_args, json_option, print_json, table


def register(subparsers: Any) -> None:
    js = json_option()
    tenants = subparsers.add_parser(
        "tenants", help="create, list and delete tenants, rotate their API keys, set quotas"
    )
    t = tenants.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = t.add_parser("create", parents=[js], help="create tenant NAME and print its API key (shown once)")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_create)
    p = t.add_parser("list", parents=[js], help="all tenants")
    p.set_defaults(func=cmd_tenant_list)
    p = t.add_parser("rotate-key", parents=[js], help="replace NAME's API key (the old one stops working)")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_rotate)
    p = t.add_parser("delete", parents=[js], help="delete NAME and its API key (refused at once everywhere)")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_delete)
    p = t.add_parser(
        "set-weight",
        parents=[js],
        help="NAME's fair share in the replicas' scheduler (default 1; 'none' resets it)",
        description="With scheduling_policy vtc, a tenant of weight 2 gets twice the tokens of a tenant of "
        "weight 1 while both are backlogged. Replicas pick a change up with their next heartbeat.",
    )
    p.add_argument("name")
    p.add_argument("weight", type=_weight, metavar="W|none")
    p.set_defaults(func=cmd_set_weight)
    p = t.add_parser(
        "set-quota",
        parents=[js],
        help="change NAME's quota: only the limits given change; 'none' removes a limit",
        description="Quotas hold across all ingress replicas; over one a request gets 429 with Retry-After.",
    )
    p.add_argument("name", help="a tenant, or with --adapter an adapter")
    _scope_option(p)
    p.add_argument("--concurrent", type=_limit, metavar="N|none", help="requests in progress at once")
    p.add_argument("--rpm", type=_limit, metavar="N|none", help="requests per minute")
    p.add_argument("--tpm", type=_limit, metavar="N|none", help="tokens (prompt + completion) per minute")
    p.add_argument("--clear", action="store_true", help="remove every limit (unlimited)")
    p.set_defaults(func=cmd_set_quota)
    p = t.add_parser("get-quota", parents=[js], help="show NAME's quota")
    p.add_argument("name", help="a tenant, or with --adapter an adapter")
    _scope_option(p)
    p.set_defaults(func=cmd_get_quota)
    p = t.add_parser("quotas", parents=[js], help="every quota set, on tenants and adapters")
    p.set_defaults(func=cmd_quotas)


_NONE = object()  # "--rpm none": remove the limit (argparse's None means the option was not given)


def _limit(text: str) -> object:
    if text.lower() in ("none", "unlimited"):
        return _NONE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'none'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'none'")
    return value


def _weight(text: str) -> float | None:
    if text.lower() in ("none", "default"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'none'") from None
    if not MIN_WEIGHT <= value <= MAX_WEIGHT:
        raise argparse.ArgumentTypeError(f"{text!r} is outside [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]")
    return value


def _scope_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter",
        dest="kind",
        action="store_const",
        const="adapter",
        default="tenant",
        help="NAME is an adapter: its quota counts every tenant's requests to it",
    )


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


def cmd_tenant_delete(args: argparse.Namespace) -> int:
    catalog_from_args(args).delete_tenant(args.name)
    if args.json:
        print_json({"name": args.name, "deleted": True})
    else:
        print(f"deleted tenant {args.name}; its API key no longer works (its adapters stay, admin-only)")
    return 0


def cmd_set_weight(args: argparse.Namespace) -> int:
    catalog_from_args(args).set_tenant_weight(args.name, args.weight)
    weight = 1.0 if args.weight is None else args.weight
    if args.json:
        print_json({"name": args.name, "weight": weight})
    else:
        print(f"tenant {args.name}: weight {weight:g} (replicas apply it with their next heartbeat)")
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
            f"{t.get('weight', 1.0):g}",
            t.get("key_hint", "") + "...",
            time.strftime(fmt, time.localtime(t["created"])),
            time.strftime(fmt, time.localtime(t["rotated"])) if t.get("rotated") else None,
        ]
        for t in tenants
    ]
    table(["NAME", "ADAPTERS", "WEIGHT", "KEY", "CREATED", "ROTATED"], rows)
    return 0


def _show_quota(args: argparse.Namespace, quota: Any) -> None:
    limits = (quota.to_dict() if quota else {"concurrent": None, "requests_per_minute": None,
              "tokens_per_minute": None})  # fmt: skip
    if args.json:
        print_json({"scope": args.kind, "name": args.name, **limits})
    else:
        print(f"{args.kind} {args.name}: {quota.describe() if quota else 'unlimited'}")


def cmd_set_quota(args: argparse.Namespace) -> int:
    from app.errors import InvalidRequest

    given = {"concurrent": args.concurrent, "requests_per_minute": args.rpm, "tokens_per_minute": args.tpm}
    changes = {k: (None if v is _NONE else v) for k, v in given.items() if v is not None}
    if args.clear and changes:
        raise InvalidRequest("--clear removes every limit: give it alone, or give only the limits to change")
    if not args.clear and not changes:
        raise InvalidRequest("nothing to change: give --concurrent, --rpm, --tpm (N or 'none') or --clear")
    quota = catalog_from_args(args).set_quota(args.kind, args.name, changes, merge=not args.clear)
    _show_quota(args, quota)
    return 0


def cmd_get_quota(args: argparse.Namespace) -> int:
    _show_quota(args, catalog_from_args(args).get_quota(args.kind, args.name))
    return 0


def cmd_quotas(args: argparse.Namespace) -> int:
    quotas = catalog_from_args(args).quotas()
    rows = []
    for sid, q in sorted(quotas.items()):
        kind, _, name = sid.partition(":")
        rows.append({"scope": kind, "name": name, **q.to_dict()})
    if args.json:
        print_json(rows)
        return 0
    table(
        ["SCOPE", "NAME", "CONCURRENT", "REQUESTS/MIN", "TOKENS/MIN"],
        [
            [r["scope"], r["name"], r["concurrent"], r["requests_per_minute"], r["tokens_per_minute"]]
            for r in rows
        ],
    )
    return 0
