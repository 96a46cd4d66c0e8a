"""What the catalog stores: one record per adapter version, one entry per live replica."""

from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from app.errors import InvalidRequest
from app.files import safe_relpath
from app.names import check_name, check_tenant

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def manifest_sha256(files: dict[str, str]) -> str:
    """One digest for a whole adapter: sha256 over its sorted 'sha256  name' lines (sha256sum's format), so two
    folders with the same files in any order hash alike and changing any byte of any file changes it."""
    lines = "".join(f"{sha}  {name}\n" for name, sha in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


@dataclass
class AdapterRecord:
    name: str
    version: int
    uri: str
    files: dict[str, str]  # filename -> sha256 hex
    size: int  # bytes, all files
    rank: int
    alpha: float
    target_modules: list[str]
    base_model: dict[str, Any]  # ModelConfig.identity() when known: architecture, hidden_size, num_layers
    tenant: str | None
    public: bool
    created: float
    pinned: bool = False
    use_rslora: bool = False
    # Why a replica could not load this version on the served base model (AdapterRegistry.mark_unloadable),
    # e.g. a shape that does not fit; requests for it fail at once with this reason. None: loadable so far.
    unloadable: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def sha256(self) -> str:
        return manifest_sha256(self.files)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ref"] = self.ref
        d["sha256"] = self.sha256
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


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
