"""A replica's side of the catalog: heartbeats carrying its stats, the tenants' weights for fair admission,
adapter events by pub/sub (removed, pinned, and new versions pushed), and the reconciliation pass that catches
events it missed. Removed versions' disk cache entries are deleted once unused (AdapterFetcher.prune_files).

Pushed versions (fast swaps): when a name this replica holds gets a new version ("staged" by a runtime LoRA load,
or "registered"), the replica loads it at once, beside the old one (requests pinned to the old version keep being
served by it), and answers "warm" in the catalog (Catalog.note_warm) so the ingress can make it the newest; the
first request for the new version then finds it loaded. The log says how long each push took.

Redis may be down at start or at any time after: the replica serves what it holds, heartbeats retry every
heartbeat_s, and the connection is made again on the next beat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from app.adapter_record import AdapterRecord
from app.catalog.replicas import LOADING
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
        self._subscribe()

    def _subscribe(self) -> None:
        if self.catalog is None or self._unsubscribe is not None:
            return
        try:
            self._unsubscribe = self.catalog.subscribe(self.on_event)
        except Exception as e:
            log.warning("cannot subscribe to catalog events (%s); retrying at the next heartbeat", e)

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
        self._subscribe()  # once: when Redis was away at start, events start with the first heartbeat
        s = self.stats()
        load = s.busy / max(1, self.cfg.max_ongoing_requests)
        self.catalog.heartbeat(s, load=load, ttl_s=self.cfg.heartbeat_ttl_s)
        self.sync_tenant_weights()
        if self.fetcher.doomed:  # removed versions' disk cache entries, once their last request ended
            self._prune_files()
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
        """A catalog change event (Catalog.subscribe's JSON): a new version of an adapter (pushed here when an
        older one is held), or removed or pinned versions."""
        name, kind = event.get("name"), event.get("type")
        versions = event.get("versions") or ([event["version"]] if event.get("version") is not None else None)
        if not isinstance(name, str):
            return
        if kind in ("staged", "registered") and isinstance(event.get("version"), int):
            self.push(name, event["version"], answer=kind == "staged")
            return
        for ref in self.fetcher.refs_of(name, versions):
            try:
                if kind == "removed":
                    self.fetcher.removed(ref)
                elif kind == "pinned":
                    self.fetcher.pinned(ref, event.get("pinned", True))
            except Exception as e:  # already gone, or in use: the kernel's LRU finishes the job
                log.info("catalog event %s for %s: %s", kind, ref, e)
        if kind == "removed":
            self.fetcher.removed_from_catalog(name, versions)
            self._prune_files()

    def _prune_files(self) -> None:
        try:
            self.fetcher.prune_files(self.catalog)
        except Exception as e:  # the next heartbeat tries again
            log.warning("disk cache pruning failed (%s); retrying at the next heartbeat", e)

    def push(self, name: str, version: int, *, answer: bool) -> None:
        """Load `name@version` now if an older version of `name` is held here (on the fetcher's threads; this is
        the listener's); `answer`: tell the catalog when it is servable (the ingress waits for it)."""
        held = self.fetcher.versions_of(name)
        if not held or (not answer and version <= held[-1]):
            return  # not held here (it loads on its first request), or already here or older (a late event)
        t0 = time.monotonic()
        ref = f"{name}@{version}"
        try:
            record = self.catalog.get(ref)
        except Exception as e:  # Redis away: the version loads on its first request
            log.warning("push of %s skipped: cannot read its record (%s)", ref, e)
            return
        if record is None or record.unloadable:
            self._answer(ref, "failed: no loadable record", answer)
            return
        self._answer(ref, LOADING, answer)  # the ingress waits for us even if no heartbeat listed us yet
        self.fetcher.start(record).add_done_callback(lambda f: self._pushed(record, f, t0, answer))

    def _pushed(self, record: AdapterRecord, fut: Future, t0: float, answer: bool) -> None:
        err = "cancelled" if fut.cancelled() else fut.exception()
        outcome = "warm" if err is None else f"failed: {err}"
        log.info("pushed %s: %s %.3fs after its event", record.ref, outcome, time.monotonic() - t0)
        self._answer(record.ref, outcome, answer)

    def _answer(self, ref: str, outcome: str, answer: bool) -> None:
        if not answer or self.catalog is None:
            return
        try:
            self.catalog.note_warm(ref, self.replica_id, outcome)
        except Exception as e:  # the ingress stops waiting at its timeout
            log.warning("cannot answer the push of %s (%s)", ref, e)

    def mark_unloadable(self, ref: str, reason: str) -> None:
        """Record in the catalog that `ref` cannot load on this base model (other replicas stop trying)."""
        if self.catalog is None:
            return
        try:
            self.catalog.mark_unloadable(ref, reason)
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
