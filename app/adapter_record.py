"""One adapter version as the catalog records it: what the ingress resolves a `model` term to, and what
crosses Ray inside a `ReplicaRequest` so the replica can fetch and verify the files without asking Redis."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any


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
