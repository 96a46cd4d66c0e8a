"""Where this router just sent each adapter: the replicas' stats arrive only every few tenths of a second, so
without this a burst of requests for a cold adapter would make every replica fetch it. An assignment counts
for `ttl_s`; an adapter with a live assignment is *warm* (placement.py bounds its holders' load).

Each adapter keeps its replicas oldest first, so a lookup drops expired entries from the front and costs what
the adapter itself holds, whatever the number of adapters remembered (the router looks up only the adapters
of the request in hand). Pure Python: the router and the placement simulator share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from app.protocol import ReplicaStats

# A replica's stats older than an assignment plus this may not show the adapter yet (request in flight, load not
# started); newer stats that show it neither held nor loading mean it was evicted since.
STATS_LAG_S = 2.0


def dropped_since(stats: ReplicaStats, adapter: str, sent_at: float) -> bool:
    """Whether a replica's stats, taken well after `adapter` was sent there, show it neither held nor loading:
    evicted since (the memory would otherwise keep routing there, to a reload, for the rest of its TTL)."""
    if stats.at < sent_at + STATS_LAG_S:
        return False
    return adapter not in stats.resident and adapter not in stats.loading


class AssignmentMemory:
    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._where: dict[str, OrderedDict[Hashable, float]] = {}

    def record(self, adapter: str, replica: Hashable, now: float) -> None:
        """A request for `adapter` was just sent to `replica`."""
        w = self._where.get(adapter)
        if w is None:
            w = self._where[adapter] = OrderedDict()
        w[replica] = now
        w.move_to_end(replica)

    def where(self, adapter: str, now: float) -> list:
        """Replicas `adapter` was sent to within ttl_s before `now`, oldest first (empty: not warm)."""
        return [replica for replica, _ in self.entries(adapter, now)]

    def entries(self, adapter: str, now: float) -> list[tuple[Hashable, float]]:
        """(replica, when it was last sent there) within ttl_s before `now`, oldest first."""
        w = self._where.get(adapter)
        if not w:
            return []
        expired = now - self.ttl_s
        while w and next(iter(w.values())) <= expired:
            w.popitem(last=False)
        if not w:
            del self._where[adapter]
            return []
        return list(w.items())

    def confirmed(
        self, adapter: str, now: float, stats_of: Callable[[Hashable], ReplicaStats | None]
    ) -> list:
        """Replicas `adapter` was sent to within ttl_s, oldest first, less those gone (`stats_of` gives None) and
        those whose newer stats show it dropped (forgotten here). The router and the simulator both call this.
        A live replica that has not reported yet has empty stats (at 0: nothing newer than the send)."""
        out = []
        for replica, sent_at in self.entries(adapter, now):
            stats = stats_of(replica)
            if stats is None:
                continue
            if dropped_since(stats, adapter, sent_at):
                self.forget(adapter, replica)
                continue
            out.append(replica)
        return out

    def forget(self, adapter: str, replica: Hashable) -> None:
        """`replica` no longer holds `adapter` (its stats, newer than the assignment, say so)."""
        w = self._where.get(adapter)
        if w is not None:
            w.pop(replica, None)
            if not w:
                del self._where[adapter]

    def forget_replica(self, replica: Hashable) -> None:
        """`replica` is gone: nothing is remembered as sent there."""
        for w in self._where.values():
            w.pop(replica, None)

    def sweep(self, now: float) -> None:
        """Drop adapters whose newest assignment expired (lookups only clean the adapters they touch)."""
        expired = now - self.ttl_s
        for adapter in [a for a, w in self._where.items() if not w or next(reversed(w.values())) <= expired]:
            del self._where[adapter]

    def __len__(self) -> int:
        return len(self._where)
