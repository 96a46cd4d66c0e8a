"""A replica's side of the catalog: heartbeats carrying its stats, the tenants' weights for fair admission,
adapter events (removed, pinned) by pub/sub, and the reconciliation pass that catches events it missed.

Redis may be down at start or at any time after: the replica serves what it holds, heartbeats retry every
heartbeat_s, and the connection is made again on the next beat.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from app.config.app_config import AppConfig
from app.errors import LoraLandError
from app.protocol import ReplicaStats
from app.replica.adapter_fetch import AdapterFetcher
from app.replica.kernel import LLMKernel
from app.replica.warmup import stale_refs

log = logging.getLogger("loraland.replica")


def connect_catalog(url: str | None) -> Any:
    """The catalog at `url`, or None (none configured, or unreachable now: the heartbeats try again)."""
    if not url:
        return None
    from app.catalog.store import Catalog

    try:
        return Catalog(url)
    except LoraLandError as e:  # serve what we can; heartbeats retry
        log.warning("catalog unreachable at start (%s); serving without placement until it returns", e)
        return None


class CatalogSync:
    """Keeps one replica and the catalog in agreement, on a thread of its own."""

    def __init__(
        self,
        cfg: AppConfig,
        replica_id: str,
        redis_url: str | None,
        catalog: Any,
        kernel: LLMKernel,
        fetcher: AdapterFetcher,
        stats: Callable[[], ReplicaStats],
    ):
        self.cfg, self.replica_id, self.redis_url = cfg, replica_id, redis_url
        self.catalog, self.kernel, self.fetcher, self.stats = catalog, kernel, fetcher, stats
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._tenant_weights: dict[str, float] | None = None  # what the kernel was last given
        self._reconciled = time.monotonic()  # last pass of the TTL fallback for missed catalog events

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="loraland-heartbeat", daemon=True)
        self._thread.start()
        if self.catalog is not None:
            try:
                self._unsubscribe = self.catalog.subscribe(self.on_event)
            except Exception as e:
                log.warning("cannot subscribe to catalog events (%s); removed adapters unload on restart", e)

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.heartbeat_once()
                if failing:
                    log.info("catalog heartbeats are back")
                failing = False
            except Exception as e:
                if not failing:
                    log.warning(
                        "catalog heartbeat failed (%s); still serving, retrying every %ss",
                        e,
                        self.cfg.heartbeat_s,
                    )
                failing = True
            self._stop.wait(self.cfg.heartbeat_s)

    def heartbeat_once(self) -> None:
        if self.catalog is None:
            self.catalog = connect_catalog(self.redis_url)
            if self.catalog is None:
                return
        s = self.stats()
        load = s.busy / max(1, self.cfg.max_ongoing_requests)
        self.catalog.heartbeat(s, load=load, ttl_s=self.cfg.heartbeat_ttl_s)
        self.sync_tenant_weights()
        if time.monotonic() - self._reconciled >= self.cfg.heartbeat_ttl_s:
            self._reconciled = time.monotonic()
            self.reconcile()

    def sync_tenant_weights(self) -> None:
        """Fair shares from the catalog's tenant records (`weight`, 1 when absent); a bad value keeps the old."""
        try:
            rows = self.catalog.list_tenants()
            weights = {t["name"]: float(t["weight"]) for t in rows if t.get("weight") is not None}
            if weights != self._tenant_weights:
                self.kernel.set_tenant_weights(weights)
                self._tenant_weights = weights
        except Exception as e:
            log.warning("tenant weights not updated from the catalog (%s); keeping the previous ones", e)

    def reconcile(self) -> None:
        """Unload held adapters whose record is gone: the fallback when a "removed" event was missed."""
        try:
            for ref in stale_refs(self.catalog, self.fetcher.held):
                name, _, version = ref.rpartition("@")
                log.info("adapter %s is no longer in the catalog; unloading it", ref)
                self.on_event({"type": "removed", "name": name, "version": int(version)})
        except Exception as e:
            log.warning("catalog reconciliation failed (%s); retrying in %ss", e, self.cfg.heartbeat_ttl_s)

    def on_event(self, event: dict) -> None:
        """A catalog change event (Catalog.subscribe's JSON): removed or pinned versions of an adapter."""
        name, kind = event.get("name"), event.get("type")
        versions = event.get("versions") or ([event["version"]] if event.get("version") is not None else None)
        if not isinstance(name, str):
            return
        for ref in self.fetcher.refs_of(name, versions):
            try:
                if kind == "removed":
                    self.fetcher.removed(ref)
                elif kind == "pinned":
                    self.fetcher.pinned(ref, event.get("pinned", True))
            except Exception as e:  # already gone, or in use: the kernel's LRU finishes the job
                log.info("catalog event %s for %s: %s", kind, ref, e)

    async def mark_unloadable(self, ref: str, reason: str) -> None:
        """Record in the catalog that `ref` cannot load on this base model (other replicas stop trying)."""
        if self.catalog is None:
            return
        try:
            await asyncio.to_thread(self.catalog.mark_unloadable, ref, reason)
        except Exception as e:  # this replica still remembers; others find out on their own first load
            log.warning("cannot mark %s unloadable in the catalog (%s)", ref, e)

    def close(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            try:
                self._unsubscribe()
            except Exception:
                pass
        if self.catalog is not None:
            try:
                self.catalog.drop_replica(self.replica_id)
            except Exception:
                pass
