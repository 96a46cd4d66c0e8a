"""Placement half of the catalog: replicas beat with what they hold, and drop out when the beats stop.

Each beat stores the replica's info under a Redis TTL and its expiry (server clock) in a sorted set; the
scripts that read or write placement first reap replicas whose expiry passed, removing them from every
adapter's placement set, so a dead replica vanishes without anyone having to notice it died."""

from __future__ import annotations

import json

from app.catalog.conn import CatalogConnection, guard
from app.catalog.records import ReplicaInfo
from app.errors import InvalidRequest


class ReplicaDirectory(CatalogConnection):
    """Mixed into Catalog (app/catalog/store.py)."""

    @guard
    def heartbeat(
        self,
        replica_id: str,
        *,
        resident: list[str],
        free_slots: int,
        load: float,
        queue_len: int,
        kv_usage: float,
        ttl_s: float = 10.0,
        extra: dict | None = None,
    ) -> None:
        """Report a replica alive with what it holds; it drops out of placement ttl_s after its last beat."""
        if not isinstance(replica_id, str) or not replica_id:
            raise InvalidRequest("replica_id must be a non-empty string")
        if not ttl_s > 0:
            raise InvalidRequest(f"ttl_s must be positive, got {ttl_s}")
        resident = sorted(set(resident))
        info = {
            "replica_id": replica_id,
            "resident": resident,
            "free_slots": int(free_slots),
            "load": float(load),
            "queue_len": int(queue_len),
            "kv_usage": float(kv_usage),
            "extra": extra or {},
        }
        ttl_ms = max(1, int(ttl_s * 1000))
        self._scripts["HEARTBEAT"](keys=[], args=[self.ns, replica_id, json.dumps(info), ttl_ms, *resident])

    @guard
    def replicas(self) -> dict[str, ReplicaInfo]:
        """Live replicas by id (expired ones are removed from placement on the way)."""
        flat = self._scripts["REPLICAS"](keys=[], args=[self.ns])
        return {flat[i]: ReplicaInfo.from_dict(json.loads(flat[i + 1])) for i in range(0, len(flat), 2)}

    @guard
    def placement(self, adapter: str | None = None) -> dict[str, list[str]]:
        """adapter -> ids of live replicas holding it. Adapter ids are opaque: whatever the replicas report
        as resident. For one adapter this is a single read-only round trip."""
        if adapter is not None:
            keys = [self._k("placement", adapter), self._k("replicas")]
            ids = sorted(self._scripts["PLACEMENT"](keys=keys, args=[]))
            return {adapter: ids} if ids else {}
        out: dict[str, list[str]] = {}
        for rid, info in sorted(self.replicas().items()):
            for a in info.resident:
                out.setdefault(a, []).append(rid)
        return out

    @guard
    def drop_replica(self, replica_id: str) -> None:
        """Forget a replica now (clean shutdown) instead of waiting for its heartbeat to expire."""
        self._scripts["DROP_REPLICA"](keys=[], args=[self.ns, replica_id])
