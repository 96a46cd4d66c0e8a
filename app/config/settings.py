"""The one place that maps environment variables to configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


def _default_cache_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loraland"


@dataclass(frozen=True)
class Settings:
    """Process-wide settings read from the environment (LORALAND_*, plus boto3/HF's own variables)."""

    redis_url: str | None = None
    adapter_path: tuple[Path, ...] = ()
    cache_dir: Path = field(default_factory=lambda: _default_cache_dir(os.environ))
    admin_token: str | None = None
    max_adapter_bytes: int = 2 << 30
    max_cache_bytes: int = 20 << 30
    allowed_local_roots: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if self.max_adapter_bytes <= 0 or self.max_cache_bytes <= 0:
            raise ValueError("LORALAND_MAX_ADAPTER_BYTES and LORALAND_MAX_CACHE_BYTES must be positive")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env

        def paths(key: str) -> tuple[Path, ...]:
            return tuple(Path(p).expanduser() for p in env.get(key, "").split(":") if p)

        return cls(
            redis_url=env.get("LORALAND_REDIS_URL") or None,
            adapter_path=paths("LORALAND_ADAPTER_PATH"),
            cache_dir=Path(env["LORALAND_CACHE_DIR"]).expanduser()
            if env.get("LORALAND_CACHE_DIR")
            else _default_cache_dir(env),
            admin_token=env.get("LORALAND_ADMIN_TOKEN") or None,
            max_adapter_bytes=int(env.get("LORALAND_MAX_ADAPTER_BYTES", 2 << 30)),
            max_cache_bytes=int(env.get("LORALAND_MAX_CACHE_BYTES", 20 << 30)),
            allowed_local_roots=paths("LORALAND_LOCAL_ROOTS"),
        )
