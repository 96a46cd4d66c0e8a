"""The Serve application's configuration: one frozen dataclass, built from `serve run` / YAML args or the CLI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import PurePath
from typing import Any

from app.config.kernel_config import KernelConfig
from app.config.metrics_config import MetricsConfig

ROUTER_KEYS = frozenset({"overload_load", "overload_kv", "max_per_tier", "assignment_ttl_s", "balance"})
# Ray Serve 2.60's AutoscalingConfig fields (ray.serve.config); Serve validates the values again at deploy.
AUTOSCALING_KEYS = frozenset(
    {"min_replicas", "initial_replicas", "max_replicas", "target_ongoing_requests", "metrics_interval_s",
     "look_back_period_s", "smoothing_factor", "upscale_smoothing_factor", "downscale_smoothing_factor",
     "upscaling_factor", "downscaling_factor", "downscale_delay_s", "downscale_to_zero_delay_s",
     "upscale_delay_s", "aggregation_function", "policy"}
)  # fmt: skip


@dataclass(frozen=True)
class AppConfig:
    """Everything the ingress and replica deployments need; validated once, here."""

    model: str
    served_model_name: str | None = None  # the id clients put in `model`; default: the model folder's name
    replicas: int = 1
    replica_num_cpus: float = 1.0
    # torch intra-op threads per replica; None: the replica's CPUs rounded down, at least 1 (Ray's own
    # OMP_NUM_THREADS rule, made explicit so a fractional reservation still gets a thread and it shows).
    replica_threads: int | None = None
    replica_num_gpus: float = 0.0
    ingress_num_cpus: float = 0.5
    ingress_replicas: int = 1
    # Per replica. The kernel batches these requests together, so this bounds its queue, not a thread count.
    max_ongoing_requests: int = 64
    max_queued_requests: int = 1024  # per handle: beyond this callers get 429 + Retry-After
    redis_url: str | None = None
    adapter_store: str | None = None  # a folder or s3://bucket/prefix where `POST /v1/adapters {name}` looks
    cache_dir: str | None = None
    no_auth: bool = False
    admin_token: str | None = None  # usually from LORALAND_ADMIN_TOKEN in the ingress's environment
    # The kernel's options; YAML and `serve run` give a dict (only the keys they set), turned into this.
    kernel: KernelConfig = field(default_factory=KernelConfig)
    router: dict[str, Any] = field(default_factory=dict)
    # Serve autoscaling of the replicas on queue length (requests running + queued per replica), e.g.
    # {min_replicas: 1, max_replicas: 8, target_ongoing_requests: 16}; None: a fixed `replicas`.
    autoscaling: dict[str, Any] | None = None
    # Adapters a new replica loads before it takes traffic (pinned ones, then those most replicas hold), so a
    # scale-up or a replacement does not meet its first requests with a storm of cold loads. 0: none.
    warm_adapters: int = 8
    # A mapping in YAML: app/config/metrics_config.py.
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    heartbeat_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    routing_stats_period_s: float = 1.0
    request_timeout_s: float = 300.0
    # A larger HTTP body gets 413 before it is read (Content-Length) or as soon as it passes the limit (chunked).
    # 4 MiB holds a 128k-token prompt as text or as token ids several times over.
    max_request_bytes: int = 4 << 20
    # prompts x n of one request; beyond it 400, so one request cannot fill the queue every tenant shares.
    max_sequences_per_request: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model: required, a Hugging Face model folder or Hub id")
        optional = ("replica_threads",) if self.replica_threads is not None else ()
        for name in (
            "replicas",
            "ingress_replicas",
            "max_ongoing_requests",
            "max_queued_requests",
            "max_request_bytes",
            "max_sequences_per_request",
            *optional,
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("replica_num_cpus", "replica_num_gpus", "ingress_num_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        for name in ("heartbeat_s", "heartbeat_ttl_s", "routing_stats_period_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_s ({self.heartbeat_s}), "
                "or live replicas would flicker out of the placement"
            )
        if isinstance(self.kernel, dict):
            try:
                object.__setattr__(self, "kernel", KernelConfig.from_options(self.kernel))
            except (TypeError, ValueError) as e:
                raise ValueError(f"kernel: {e}") from None
        elif not isinstance(self.kernel, KernelConfig):
            raise ValueError(f"kernel: a mapping of LLMKernel options, got {type(self.kernel).__name__}")
        if not isinstance(self.metrics, MetricsConfig):
            try:
                object.__setattr__(self, "metrics", MetricsConfig.from_options(self.metrics))
            except (TypeError, ValueError) as e:
                raise ValueError(f"metrics: {e}") from None
        if self.autoscaling is not None:
            _check_autoscaling(self.autoscaling)
        warm = self.warm_adapters
        if not isinstance(warm, int) or isinstance(warm, bool) or warm < 0:
            raise ValueError(f"warm_adapters: must be an integer >= 0, got {self.warm_adapters!r}")
        bad = sorted(set(self.router) - ROUTER_KEYS)
        if bad:
            raise ValueError(f"router: unknown keys {bad}; the router accepts {sorted(ROUTER_KEYS)}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: {self.redis_url!r} is not a redis:// rediss:// or unix:// URL")

    @property
    def threads(self) -> int:
        """torch threads a replica runs with."""
        return self.replica_threads or max(1, int(self.replica_num_cpus))

    @property
    def model_name(self) -> str:
        """The id the base model answers to in `model` and in GET /v1/models."""
        if self.served_model_name:
            return self.served_model_name
        return PurePath(self.model.rstrip("/")).name if self.model.startswith(("/", ".", "~")) else self.model

    @property
    def base_ids(self) -> frozenset[str]:
        return frozenset({self.model_name, self.model})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AppConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown application args {unknown}; known: {sorted(known)}")
        return cls(**d)


def _check_autoscaling(a: Any) -> None:
    if not isinstance(a, dict):
        raise ValueError(f"autoscaling: a mapping of Serve autoscaling_config keys, got {type(a).__name__}")
    bad = sorted(set(a) - AUTOSCALING_KEYS)
    if bad:
        raise ValueError(f"autoscaling: unknown keys {bad}; Serve accepts {sorted(AUTOSCALING_KEYS)}")
    lo, hi = a.get("min_replicas", 1), a.get("max_replicas", 1)
    for name, v in (("min_replicas", lo), ("max_replicas", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"autoscaling.{name}: must be an integer >= 0, got {v!r}")
    if hi < max(1, lo):
        raise ValueError(f"autoscaling.max_replicas ({hi}) must be >= min_replicas ({lo}) and >= 1")
    target = a.get("target_ongoing_requests", 2)
    if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
        raise ValueError(f"autoscaling.target_ongoing_requests: must be > 0, got {target!r}")


def coerce_args(args: dict[str, Any]) -> dict[str, Any]:
    """`serve run app.main:app_builder replicas=2 no_auth=true` passes strings: turn them into field types."""
    out: dict[str, Any] = {}
    kinds = {f.name: str(f.type) for f in fields(AppConfig)}
    for key, value in args.items():
        kind = kinds.get(key, "")
        if isinstance(value, str):
            if "None" in kind and value.lower() in ("", "none", "null"):
                value = None
            elif kind.startswith("bool"):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(f"{key}: expected true or false, got {value!r}")
                value = value.lower() in ("true", "1", "yes")
            elif kind.startswith("int"):
                value = int(value)
            elif kind.startswith("float"):
                value = float(value)
            elif kind.startswith(("dict", "KernelConfig", "MetricsConfig")):
                import json

                value = json.loads(value)
        out[key] = value
    return out
