"""Metrics options (app/metrics.py): on or off, how many adapters and tenants get their own label value, how often
a process publishes its snapshot for the ingress's cluster-wide /metrics. AppConfig's `metrics:` section."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True  # off: nothing is recorded (the overhead benchmark's baseline); /metrics stays up
    # Label values for the busiest adapters and tenants (by recent traffic); the rest are counted as "(other)",
    # so a million adapters cost at most top_adapters series per metric, not a million.
    top_adapters: int = 50
    top_tenants: int = 50
    publish_s: float = 2.0  # how often each process puts its snapshot in the catalog (the scrape's staleness)
    recent_events: int = 50  # recent errors and adapter loads each process keeps for GET /status

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"metrics.enabled must be true or false, got {self.enabled!r}")
        for name in ("top_adapters", "top_tenants", "recent_events"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"metrics.{name} must be a positive integer, got {v!r}")
        p = self.publish_s
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
            raise ValueError(f"metrics.publish_s must be > 0 seconds, got {p!r}")

    @classmethod
    def from_options(cls, options: dict[str, Any] | MetricsConfig | None) -> MetricsConfig:
        if options is None:
            return cls()
        if isinstance(options, MetricsConfig):
            return options
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"metrics: unknown options {unknown}; known: {sorted(known)}")
        return cls(**options)
