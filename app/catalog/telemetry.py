"""Metric snapshots in the catalog: each LoRA-Land process puts its latest one (app/metrics.py's snapshot(), as
JSON) under its own key with a TTL, and the ingress reads them all to answer GET /metrics and GET /status for the
whole cluster. A process that stops publishing drops out when its key expires; the index set is pruned on read."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from app import metrics
from app.catalog.conn import guard

log = logging.getLogger("loraland.metrics")


class TelemetryBoard:
    """Snapshots over a catalog's Redis connection (a Catalog, or any CatalogConnection)."""

    def __init__(self, catalog: Any):
        self._r, self._k, self.url = catalog._r, catalog._k, catalog.url

    @guard
    def publish(self, process: str, snapshot: dict, ttl_s: float) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self._k("telemetry", process), json.dumps(snapshot), px=max(1, int(ttl_s * 1000)))
        pipe.sadd(self._k("telemetry"), process)
        pipe.execute()

    @guard
    def snapshots(self) -> list[dict]:
        """Every live process's latest snapshot (expired ones leave the index on the way)."""
        processes = sorted(self._r.smembers(self._k("telemetry")))
        if not processes:
            return []
        raw = self._r.mget([self._k("telemetry", p) for p in processes])
        gone = [p for p, r in zip(processes, raw) if r is None]
        if gone:
            self._r.srem(self._k("telemetry"), *gone)
        return [json.loads(r) for r in raw if r is not None]

    @guard
    def remove(self, process: str) -> None:
        """Forget a process now (clean shutdown) instead of at its TTL."""
        self._r.delete(self._k("telemetry", process))
        self._r.srem(self._k("telemetry"), process)


class Publisher:
    """A daemon thread putting this process's snapshot (app/metrics.py) in the catalog every `period_s`; the
    snapshot lives 3 periods, so one missed beat does not make a process vanish from the cluster view.
    `catalog` is a callable returning the Catalog (None, or raising, while Redis is down: the next beat retries)."""

    def __init__(self, catalog: Any, period_s: float):
        self.catalog, self.period_s = catalog, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraland-metrics", daemon=True)
        self._failing = False

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def publish_once(self) -> None:
        cat = self.catalog()
        if cat is not None:
            TelemetryBoard(cat).publish(metrics.PROCESS, metrics.snapshot(), 3 * self.period_s)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.publish_once()
                self._failing = False
            except Exception as e:  # Redis away: /metrics elsewhere misses this process until it is back
                if not self._failing:
                    log.warning(
                        "cannot publish metrics to the catalog (%s); retrying every %ss", e, self.period_s
                    )
                self._failing = True

    def stop(self) -> None:
        self._stop.set()
        try:
            cat = self.catalog()
            if cat is not None:
                TelemetryBoard(cat).remove(metrics.PROCESS)
        except Exception:  # gone at its TTL instead
            pass


def start_process_metrics(
    config: Any, catalog: Callable[[], Any] | None, **identity: str
) -> Publisher | None:
    """Set this process up for the cluster view: apply `config` (a MetricsConfig, a mapping or None), name the
    process (`replica=...` or `ingress=...`) and start publishing its snapshot to what `catalog()` returns (a
    Catalog; None or an exception: not now). Returns the Publisher (None when metrics are off)."""
    from app.config.metrics_config import MetricsConfig

    cfg = MetricsConfig.from_options(config)
    metrics.configure(cfg)
    metrics.identify(**identity)
    if not cfg.enabled or catalog is None:
        return None
    return Publisher(catalog, cfg.publish_s).start()
