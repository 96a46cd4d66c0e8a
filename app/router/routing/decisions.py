"""The router's decisions as a metric: how each request landed, from what the router knew when it chose."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from app import metrics
from app.protocol import ReplicaStats


def decision(
    adapters: list[str], stats: ReplicaStats | None, placement: Mapping[str, Collection[str]], uid: str
) -> str:
    """How a request for `adapters` lands on the replica with `stats` (its routing stats) and id `uid`: "held"
    (it holds or is loading every one, or the router just sent them there), "free_slot" (room to load the
    missing ones without evicting), "any" (an eviction may follow), or "base" (no adapter)."""
    if not adapters:
        return "base"
    have = set(stats.resident) | set(stats.loading) if stats is not None else set()
    missing = [a for a in adapters if a not in have and uid not in placement.get(a, ())]
    if not missing:
        return "held"
    free = stats.free_slots if stats is not None else 0
    return "free_slot" if free >= len(missing) else "any"


def record_decision(
    adapters: list[str], stats: ReplicaStats | None, placement: Mapping[str, Collection[str]], uid: str
) -> None:
    if metrics.enabled():
        metrics.ROUTER_DECISIONS.labels(decision(adapters, stats, placement, uid)).inc()
