"""`loraland adapters ...`: push, register, list, show, rm, pin/unpin, validate. Tables for people, --json for
scripts. Heavy imports (redis, boto3, torch via app.replica.lora.peft_format) happen inside the commands."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from app.cli.output import catalog_from_args, human_size, json_option, print_json, table
from app.errors import InvalidAdapter, InvalidRequest, UnknownAdapter


def register(subparsers: Any) -> None:
    js = json_option()
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
    p = a.add_parser(
        "push",
        parents=[owner, js],
        help="validate DIR, upload it to S3 as NAME's next version and register it",
        description="Each version goes under its own prefix below the root: s3://BUCKET/PREFIX/NAME/vN/ (N: the "
        "version the catalog gives it), so pushing version 2 needs no new --to.",
    )
    p.add_argument("name")
    p.add_argument("dir", type=Path)
    p.add_argument(
        "--to", required=True, metavar="s3://BUCKET/PREFIX", help="the root under which NAME/vN/ is written"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace different files already at NAME/vN/ (a failed push)"
    )
    p.add_argument("--no-progress", action="store_true", help="no upload progress bar")
    p.set_defaults(func=cmd_push)
    p = a.add_parser(
        "register", parents=[owner, js], help="register an adapter already at URI (s3://, hf://, folder)"
    )
    p.add_argument("name")
    p.add_argument("uri")
    p.add_argument("--no-progress", action="store_true", help="no download progress bar")
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


def _model_config(model: str) -> Any:
    from app.config.model_config import ModelConfig

    if Path(model).expanduser().is_dir():
        return ModelConfig.from_folder(Path(model).expanduser())
    try:
        from huggingface_hub import snapshot_download

        return ModelConfig.from_folder(snapshot_download(model, allow_patterns=["config.json"]))
    except Exception as e:
        raise InvalidRequest(
            f"cannot read the base model {model!r}: not a folder, and the Hub said: {e}"
        ) from None


def _inspect(folder: Path, model: str | None, max_rank: int) -> tuple[dict, dict]:
    """(adapter_summary, base model identity) of an adapter folder: every check that needs no base model
    (app/replica/lora/checks.py), and read against `model` when one is given."""
    from app.replica.lora.checks import check_adapter
    from app.replica.lora.peft_format import adapter_summary, read_adapter

    summary = adapter_summary(folder)
    if summary["rank"] > max_rank:
        raise InvalidAdapter(f"adapter {folder}: r={summary['rank']} exceeds --max-rank {max_rank}")
    summary["max_delta_norm"] = check_adapter(folder, max_rank=max_rank)["max_delta_norm"]
    if model is None:
        print(
            "loraland: note: no --model given: every check that needs no base model passed; the base model is "
            "not recorded, and a replica checks shapes and layer count when it first loads the adapter (a "
            "failure there marks it unloadable in `loraland adapters list`)",
            file=sys.stderr,
        )
        return summary, {}
    config = _model_config(model)
    read_adapter(folder, config, max_rank=max_rank)
    return summary, config.identity()


def _register_record(
    args: argparse.Namespace, catalog: Any, uri: str, summary: dict, base: dict, files: dict
) -> Any:
    record = catalog.register(
        args.name,
        uri,
        files=files,
        size=int(summary["size"]),
        rank=int(summary["rank"]),
        alpha=float(summary["alpha"]),
        target_modules=list(summary["target_modules"]),
        base_model=base,
        tenant=args.tenant,
        public=args.public,
        use_rslora=bool(summary.get("use_rslora")),
    )
    if args.json:
        print_json(record.to_dict())
    else:
        print(
            f"registered {record.ref}: {record.uri} (rank {record.rank}, {len(files)} files, {human_size(record.size)})"
        )
    return record


def _check_owner(args: argparse.Namespace, catalog: Any) -> None:
    from app.names import check_name, check_tenant

    check_name(args.name)
    if args.tenant is not None:
        check_tenant(args.tenant)
        if args.tenant not in {t["name"] for t in catalog.list_tenants()}:
            raise InvalidRequest(
                f"unknown tenant {args.tenant!r}: create it with `loraland tenants create {args.tenant}`"
            )


def cmd_push(args: argparse.Namespace) -> int:
    from app.catalog.sources import AdapterHub
    from app.catalog.sources.s3 import parse_s3_uri

    catalog = catalog_from_args(args)  # fail before uploading anything if the catalog is unreachable
    _check_owner(args, catalog)
    bucket, root = parse_s3_uri(args.to)
    summary, base = _inspect(args.dir, args.model, args.max_rank)
    version = catalog.next_version(args.name)
    uri = f"s3://{bucket}/{root}/{args.name}/v{version}"
    hub = AdapterHub(catalog=catalog)
    progress = not (args.no_progress or args.json)
    files = hub.upload(
        args.dir, uri, progress=progress, files=sorted(summary["files"]), overwrite=args.overwrite
    )
    record = _register_record(args, catalog, uri, summary, base, files)
    if record.version != version:  # another push of NAME registered between our look and ours
        print(
            f"loraland: note: registered as version {record.version}; its files are at {uri} (the version "
            "number when the upload started)",
            file=sys.stderr,
        )
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    from app.catalog.sources import AdapterHub

    catalog = catalog_from_args(args)
    _check_owner(args, catalog)
    uri = args.uri
    if not uri.startswith(("s3://", "hf://")):  # a local folder: record it absolute
        uri = str(Path(uri[len("file://") :] if uri.startswith("file://") else uri).expanduser().resolve())
    progress = not (args.no_progress or args.json)
    folder = AdapterHub(catalog=catalog).fetch(uri, progress=progress)
    if uri.startswith("hf://") and "@" not in uri and folder.parent.name == "snapshots":
        uri = f"{uri}@{folder.name}"  # pin the commit: the branch may move, the recorded sha256s would not
    summary, base = _inspect(folder, args.model, args.max_rank)
    _register_record(args, catalog, uri, summary, base, dict(summary["files"]))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    records = catalog_from_args(args).list(tenant=args.tenant)
    if args.json:
        print_json([r.to_dict() for r in records])
        return 0
    rows = [
        [
            r.name,
            r.version,
            r.rank,
            ",".join(r.target_modules),
            human_size(r.size),
            r.tenant,
            "yes" if r.public else "no",
            "yes" if r.pinned else "no",
            "UNLOADABLE" if r.unloadable else "ok",
            r.uri,
        ]
        for r in records
    ]
    table(["NAME", "VERSION", "RANK", "TARGETS", "SIZE", "TENANT", "PUBLIC", "PINNED", "STATE", "URI"], rows)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    catalog = catalog_from_args(args)
    record = catalog.require(args.ref)
    versions = [r.version for r in catalog.versions(record.name)]
    if args.json:
        print_json({**record.to_dict(), "versions": versions})
        return 0
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
    rows = [
        ["name", record.name],
        ["version", f"{record.version} (versions: {', '.join(map(str, versions))})"],
        ["uri", record.uri],
        ["sha256", record.sha256],
        ["size", f"{human_size(record.size)} ({record.size} bytes)"],
        ["rank", record.rank],
        ["alpha", record.alpha],
        ["rslora", record.use_rslora],
        ["targets", ", ".join(record.target_modules)],
        ["base model", json.dumps(record.base_model) if record.base_model else "not recorded"],
        ["tenant", record.tenant or "none (admin)"],
        ["public", record.public],
        ["pinned", record.pinned],
        ["state", f"UNLOADABLE: {record.unloadable}" if record.unloadable else "ok"],
        ["created", created],
    ]
    rows += [[f"file {name}", sha] for name, sha in sorted(record.files.items())]
    for key, value in rows:
        print(f"{key + ':':<{max(len(k) for k, _ in rows) + 2}}{value}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from app.names import parse_ref

    catalog = catalog_from_args(args)
    name, version = parse_ref(args.ref)
    n = catalog.remove(args.ref)
    if n == 0:
        raise UnknownAdapter(f"no adapter {args.ref!r} in the catalog: see `loraland adapters list`")
    if args.json:
        print_json({"name": name, "version": version, "removed": n})
    else:
        print(
            f"removed {args.ref}" if version is not None else f"removed {name} ({n} version{'s' * (n != 1)})"
        )
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    catalog_from_args(args).set_pinned(args.name, args.pinned)
    print(f"{'pinned' if args.pinned else 'unpinned'} {args.name}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    summary, base = _inspect(args.dir, args.model, args.max_rank)
    if args.json:
        print_json({"valid": True, "base_model": base, **summary})
        return 0
    layers = summary.get("layers") or []
    print(
        f"ok: {args.dir} is a LoRA adapter for {base.get('architecture')} ({args.model}): rank {summary['rank']}, "
        f"alpha {summary['alpha']:g}, targets {','.join(summary['target_modules'])}, {len(layers)} layers, "
        f"{len(summary['files'])} files, {human_size(summary['size'])}, largest delta norm "
        f"{summary['max_delta_norm']:.3g}"
    )
    return 0
