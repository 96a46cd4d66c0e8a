"""The quotas' fallback while Redis is unreachable: token buckets in one ingress process, each limit divided by
the number of ingress replicas, so the cluster as a whole keeps to about the quota (app/router/http/quotas.py says
when it is used). Pure Python; the caller holds the lock."""

from __future__ import annotations

import time
from collections import Counter

from app.catalog.quotas import Admission, Quota


class LocalBuckets:
    """The fallback: token buckets in this process, each limit divided by the number of ingress replicas."""

    def __init__(self, replicas: int):
        self.replicas = max(1, replicas)
        self._levels: dict[tuple[str, str], tuple[float, float]] = {}  # (scope, limit) -> (level, at)

    def _level(self, key: tuple[str, str], cap: float, now: float) -> float:
        level, at = self._levels.get(key, (cap, now))
        return min(cap, level + (now - at) * cap / 60)

    def admit(
        self, sids: list[str], quotas: dict[str, Quota | None], tokens: int, inflight: Counter
    ) -> Admission:
        now, charges, worst = time.monotonic(), [], None
        for sid in sids:
            q = quotas.get(sid)
            if q is None:
                continue
            for limit, cost in (("requests_per_minute", 1), ("tokens_per_minute", tokens)):
                value = getattr(q, limit)
                if value is None:
                    continue
                if cost > value:
                    return Admission(False, quotas, 0.0, sid, limit, value, impossible=True)
                cap = value / self.replicas
                level = self._level((sid, limit), cap, now)
                need = min(cost, cap)  # a full share admits any request the whole quota could
                if level >= need:
                    charges.append(((sid, limit), level - cost))
                else:
                    wait = (need - level) * 60 / cap
                    if worst is None or wait > worst[0]:
                        worst = (wait, sid, limit, value)
            if q.concurrent is not None and inflight[sid] >= max(1, q.concurrent // self.replicas):
                if worst is None or 1.0 > worst[0]:
                    worst = (1.0, sid, "concurrent", q.concurrent)
        if worst is not None:
            return Admission(False, quotas, *worst)
        for key, level in charges:
            self._levels[key] = (level, now)
        return Admission(True, quotas)

    def settle(self, sids: list[str], quotas: dict[str, Quota | None], tokens_back: int) -> None:
        now = time.monotonic()
        for sid in sids:
            q = quotas.get(sid)
            if q is not None and q.tokens_per_minute is not None and tokens_back:
                cap = q.tokens_per_minute / self.replicas
                key = (sid, "tokens_per_minute")
                self._levels[key] = (min(cap, self._level(key, cap, now) + tokens_back), now)
