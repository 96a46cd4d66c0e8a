"""The one place that maps environment variables to configuration.

Everything else takes a Settings (or its S3Settings part) as an argument; the only other code that touches the
environment is code that hands it on to child processes (Ray workers, the demo's training process)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


def _default_cache_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loraland"


@dataclass(frozen=True)
class S3Settings:
    """Where the S3 (or S3-compatible) store is and who we are there, from boto3's own variables (AWS_*).

    A field left None is left to boto3's default chain (profiles, config files, instance roles). Frozen and
    hashable: app.catalog.sources.s3_api keeps one client per distinct value."""

    endpoint_url: str | None = None  # AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (MinIO, R2, moto)
    region: str | None = None  # AWS_DEFAULT_REGION (the variable botocore reads)
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    profile: str | None = None
    config_file: str | None = None
    credentials_file: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Settings:
        env = os.environ if env is None else env

        def get(*keys: str) -> str | None:
            return next((env[k] for k in keys if env.get(k)), None)

        return cls(
            endpoint_url=get("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
            region=get("AWS_DEFAULT_REGION"),
            access_key_id=get("AWS_ACCESS_KEY_ID"),
            secret_access_key=get("AWS_SECRET_ACCESS_KEY"),
            session_token=get("AWS_SESSION_TOKEN"),
            profile=get("AWS_PROFILE"),
            config_file=get("AWS_CONFIG_FILE"),
            credentials_file=get("AWS_SHARED_CREDENTIALS_FILE"),
        )


@dataclass(frozen=True)
class Settings:
    """Process-wide settings read from the environment (LORALAND_*, plus boto3's AWS_* as `s3`). Fields not
    given to the constructor take their defaults; `cache_dir` and `s3` default to the process's environment."""

    redis_url: str | None = None
    adapter_path: tuple[Path, ...] = ()
    cache_dir: Path = field(default_factory=lambda: _default_cache_dir(os.environ))
    admin_token: str | None = field(default=None, repr=False)
    max_adapter_bytes: int = 2 << 30
    max_cache_bytes: int = 20 << 30
    allowed_local_roots: tuple[Path, ...] = ()
    s3: S3Settings = field(default_factory=S3Settings.from_env)

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
            s3=S3Settings.from_env(env),
        )
