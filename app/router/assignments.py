"""Where this router just sent each adapter: the replicas' stats arrive only every few tenths of a second, so
without this a burst of requests for a cold adapter would make every replica fetch it. An assignment counts
for `ttl_s`; an adapter with a live assignment is *warm* (placement.py bounds its holders' load).

Each adapter keeps its replicas oldest first, so a lookup drops expired entries from the front and costs what
the adapter itself holds, whatever the number of adapters remembered (the router looks up only the adapters
of the request in hand). Pure Python: the router and the placement simulator share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


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
