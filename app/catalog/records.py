"""What the catalog stores: one record per adapter version (app/adapter_record.py), one entry per live
replica, and the validation of a record before it is written."""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from app.errors import InvalidRequest
from app.files import safe_relpath
from app.names import check_name, check_tenant

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class ReplicaInfo:
    replica_id: str
    resident: list[str]  # adapter refs the replica holds in a device slot or its host cache
    free_slots: int
    load: float
    queue_len: int
    kv_usage: float
    heartbeat: float  # unix time (the Redis server's clock) of the last heartbeat
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, e.g. the Serve replica's actor name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaInfo:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def record_body(
    name: str,
    uri: str,
    *,
    files: dict[str, str],
    size: int,
    rank: int,
    alpha: float,
    target_modules: list[str],
    base_model: dict,
    tenant: str | None = None,
    public: bool = False,
    use_rslora: bool = False,
) -> dict[str, Any]:
    """A validated record, without its version (the REGISTER script assigns it)."""
    check_name(name)
    if tenant is not None:
        check_tenant(tenant)
    if not isinstance(uri, str) or not uri.strip():
        raise InvalidRequest("adapter URI must be a non-empty string (s3://..., hf://..., or a folder)")
    if not isinstance(files, dict) or not files:
        raise InvalidRequest("an adapter record needs its files: {filename: sha256}")
    for fname, sha in files.items():
        safe_relpath(fname, where="files")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise InvalidRequest(f"files[{fname!r}] must be a lowercase hex sha256, got {sha!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidRequest(f"rank must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise InvalidRequest(f"alpha must be a positive number, got {alpha!r}")
    if not isinstance(size, int) or size < 0:
        raise InvalidRequest(f"size must be a non-negative integer, got {size!r}")
    return {
        "name": name,
        "uri": uri,
        "files": dict(sorted(files.items())),
        "size": size,
        "rank": rank,
        "alpha": float(alpha),
        "target_modules": sorted(target_modules),
        "base_model": dict(base_model or {}),
        "tenant": tenant,
        "public": bool(public),
        "created": time.time(),
        "use_rslora": bool(use_rslora),
    }
