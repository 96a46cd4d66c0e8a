"""The Redis catalog, one client of it: the adapter registry (app/catalog/registry.py), tenants and API keys
(tenants.py), quotas (quotas.py), replica placement with heartbeats (replicas.py), and change events on pub/sub
(here). Redis is the source of truth; writes that must agree run as Lua scripts (lua.py), so they are atomic."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from app.adapter_record import AdapterRecord
from app.catalog.conn import guard, redact_url
from app.catalog.quotas import QuotaStore
from app.catalog.records import ReplicaInfo
from app.catalog.registry import AdapterRegistry
from app.catalog.replicas import ReplicaDirectory
from app.catalog.tenants import TenantDirectory, hash_api_key
from app.config.settings import Settings

__all__ = ["AdapterRecord", "Catalog", "ReplicaInfo", "hash_api_key", "redact_url"]

log = logging.getLogger(__name__)


class Catalog(AdapterRegistry, TenantDirectory, ReplicaDirectory, QuotaStore):
    """One client of the catalog; thread-safe (redis-py pools connections). Connects (and pings) at once, so a
    wrong URL fails here with CatalogUnavailable rather than on first use."""

    def __init__(self, url: str, namespace: str = "loraland") -> None:
        super().__init__(url, namespace)
        self._subs: list[Callable[[], None]] = []
        self._ping()

    @classmethod
    def from_settings(cls, settings: Settings) -> Catalog | None:
        return cls(settings.redis_url) if settings.redis_url else None

    @guard
    def _ping(self) -> None:
        self._r.ping()

    @guard
    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call `callback(event)` from a background thread for each change event; returns stop().

        Events: {"type": "registered"|"removed"|"pinned", "name", "version", ...} for adapters and
        {"type": "key_rotated"|"tenant_deleted", "tenant"} for API keys. Redis pub/sub is fire-and-forget:
        events published while a subscriber is disconnected are lost, so a subscriber that must be exact
        re-reads the catalog after a reconnect, or bounds how long it trusts what it cached (the ingress's
        key cache: app/router/http/auth.py)."""

        def on_message(msg: dict) -> None:
            try:
                event = json.loads(msg["data"])
                event.setdefault("version", None)
                callback(event)
            except Exception:  # a faulty callback must not kill the listener thread
                log.exception("catalog event callback failed on %r", msg.get("data"))

        last_warning = [0.0]

        def on_error(exc: BaseException, pubsub: Any, thread: Any) -> None:
            # Retried every ~0.5 s for as long as Redis is away: say so once a minute, not at every retry.
            now = time.monotonic()
            if now - last_warning[0] >= 60:
                last_warning[0] = now
                log.warning("catalog event listener lost Redis at %s (%s); retrying", self.url, exc)
            time.sleep(0.5)

        pubsub = self._r.pubsub()
        pubsub.subscribe(**{self._channel: on_message})
        # Return only once Redis confirmed the subscription: an event published right after must arrive.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            msg = pubsub.get_message(timeout=0.5)
            if msg is not None and msg["type"] == "subscribe":
                break
        else:
            pubsub.close()
            raise redis.TimeoutError(f"no confirmation of SUBSCRIBE {self._channel}")
        thread = pubsub.run_in_thread(sleep_time=0.2, daemon=True, exception_handler=on_error)
        lock = threading.Lock()
        stopped = False

        def stop() -> None:
            nonlocal stopped
            with lock:
                if stopped:
                    return
                stopped = True
            thread.stop()
            thread.join(timeout=2)
            try:
                pubsub.close()
            except Exception:  # already closed by the thread, or Redis gone: nothing to release
                pass

        self._subs.append(stop)
        return stop

    def close(self) -> None:
        for stop in self._subs:
            stop()
        self._subs.clear()
        self._r.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
