"""Placement half of the catalog: replicas beat with what they hold, and drop out when the beats stop.

Each beat stores the replica's info under a Redis TTL and its expiry (server clock) in a sorted set; the
scripts that read or write placement first reap replicas whose expiry passed, removing them from every
adapter's placement set, so a dead replica vanishes without anyone having to notice it died.

Pushed versions: a replica that loaded a version pushed to it (a "staged" event, app/replica/catalog_sync.py)
answers in `warm:<name@v>` (replica id -> "warm" or "failed: why", kept WARM_TTL_S) and with a "warm" event; the
ingress that staged the version waits for the holders' answers before promoting it
(app/router/routing/version_push.py). A replica first answers LOADING (not announced): the ingress then also
waits for a holder its heartbeats did not list yet."""

from __future__ import annotations

import json
import time

from app.catalog.conn import CatalogConnection, guard
from app.catalog.records import ReplicaInfo
from app.errors import InvalidRequest
from app.names import parse_ref
from app.protocol import ReplicaStats

WARM_TTL_S = 300
LOADING = "loading"  # a replica's first answer to a push: it holds the name and is loading the version


class ReplicaDirectory(CatalogConnection):
    """Mixed into Catalog (app/catalog/store.py)."""

    @guard
    def heartbeat(self, stats: ReplicaStats, *, load: float, ttl_s: float = 10.0) -> None:
        """Report a replica alive with its stats (`load`: the fraction of its request capacity in use); it
        drops out of placement ttl_s after its last beat."""
        replica_id = stats.replica_id
        if not isinstance(replica_id, str) or not replica_id:
            raise InvalidRequest("replica_id must be a non-empty string")
        if not ttl_s > 0:
            raise InvalidRequest(f"ttl_s must be positive, got {ttl_s}")
        resident = sorted(set(stats.resident))
        extra: dict = {"device_resident": list(stats.device_resident), "running": stats.running, **stats.node}
        if stats.warmed is not None:
            extra["warmed"] = list(stats.warmed)
        info = {
            "replica_id": replica_id,
            "resident": resident,
            "free_slots": int(stats.free_slots),
            "load": float(load),
            "queue_len": int(stats.queue_len),
            "kv_usage": float(stats.kv_usage),
            "extra": extra,
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

    @guard
    def holders(self, name: str) -> list[str]:
        """Live replicas whose last heartbeat holds some version of `name` (a device slot or host memory)."""
        prefix = f"{name}@"
        return sorted(
            r for r, info in self.replicas().items() if any(a.startswith(prefix) for a in info.resident)
        )

    @guard
    def note_warm(self, ref: str, replica_id: str, outcome: str) -> None:
        """A replica's answer to the pushed version `ref`: "warm" (servable there without a fetch) or
        "failed: why", announced as {"type": "warm", "name", "version", "replica", "ok", "at"}; or LOADING
        (recorded only: the final answer follows)."""
        name, version = parse_ref(ref)
        key = self._k("warm", ref)
        event = {"type": "warm", "name": name, "version": version, "replica": replica_id,
                 "ok": outcome == "warm", "at": time.time()}  # fmt: skip
        pipe = self._r.pipeline()
        pipe.hset(key, replica_id, outcome)
        pipe.expire(key, WARM_TTL_S)
        if outcome != LOADING:
            pipe.publish(self._channel, json.dumps(event))
        pipe.execute()

    @guard
    def warm_acks(self, ref: str) -> dict[str, str]:
        """The answers replicas gave to the pushed version `ref` (replica id -> "warm" or "failed: why")."""
        return dict(self._r.hgetall(self._k("warm", ref)))
