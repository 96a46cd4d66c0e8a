"""Where a request should run: a pure ranking of replicas for a set of adapters.

Tiers, best first:
  1. replicas that already hold every adapter the request needs and are not overloaded (a cache hit);
  2. replicas with enough free adapter slots to load the missing ones without evicting, least loaded first;
  3. every other replica, least loaded first (a load here may evict the replica's least recently used adapter,
     and an overloaded holder still beats failing the request).
Within a tier the order is by load; Ray Serve then probes the first few and takes the shortest queue.

"Overloaded" depends on the adapter (consistent hashing with bounded loads: Mirrokni, Thorup, Zadimoghaddam,
SODA 2018). For a *warm* adapter (the router routed it within its memory, so a new copy will be used again) and
for the base model, a replica is overloaded at `balance` x the cluster's mean load + 1 request: a hot adapter's
holders shed load onto the least-loaded replicas with room, which then hold it too (hot adapters replicate
themselves), and max/mean load stays near `balance` at any utilization. Any other adapter stays on its holder
until `overload_load` (default: full): with ~1,000 adapters per replica most requests are for adapters seen once
in minutes, and passing their holder over would cost a cold load for a copy that is never used again while
moving no load for good. load_tests/placement_sim.py measures both rules at 1,000 replicas.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from app.protocol import ReplicaStats


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows about one replica (from `record_routing_stats()` and its own queue counts)."""

    replica_id: str
    resident: frozenset[str] = frozenset()
    free_slots: int = 0
    queue_len: int = 0  # waiting inside the replica's kernel
    running: int = 0  # sequences in the kernel's batch
    ongoing: int = 0  # requests the router has sent and not seen finish
    max_ongoing: int = 1
    kv_usage: float = 0.0
    loading: frozenset[str] = field(default_factory=frozenset)

    @cached_property  # read several times per ranking; the view is frozen
    def load(self) -> float:
        """Fraction of the replica's request capacity in use (the larger of the two views of it)."""
        busy = max(self.ongoing, self.running + self.queue_len)
        return busy / max(1, self.max_ongoing)


@dataclass(frozen=True)
class PlacementPolicy:
    """Thresholds; frozen so the router, the simulator and the tests share one validated set."""

    overload_load: float = 1.0  # load at which any holder stops being preferred (1.0: only when full)
    overload_kv: float = 0.95  # KV cache fraction at which a holder stops being preferred
    max_per_tier: int = 4  # Ray probes every replica of a tier: keep it small
    # Warm adapters and the base model: overloaded at balance x mean load + 1 request. None: no such bound.
    balance: float | None = 1.2

    def __post_init__(self) -> None:
        if not 0 < self.overload_load:
            raise ValueError(f"overload_load must be > 0, got {self.overload_load}")
        if not 0 < self.overload_kv <= 1:
            raise ValueError(f"overload_kv must be in (0, 1], got {self.overload_kv}")
        if self.max_per_tier < 1:
            raise ValueError(f"max_per_tier must be >= 1, got {self.max_per_tier}")
        if self.balance is not None and self.balance < 1:
            raise ValueError(f"balance must be >= 1 (or None to turn the bound off), got {self.balance}")

    def bounded(self, adapters: Collection[str], warm: Collection[str]) -> bool:
        """Whether the bounded-load rule applies to a request for `adapters` (empty = the base model)."""
        return self.balance is not None and all(a in warm for a in adapters)

    def overloaded(self, r: ReplicaView, mean_load: float | None = None) -> bool:
        """`mean_load`: the cluster's mean load when the bounded-load rule applies to this request, else None."""
        if r.load >= self.overload_load or r.kv_usage >= self.overload_kv:
            return True
        if mean_load is None or self.balance is None:
            return False
        return r.load >= self.balance * mean_load + 1 / max(1, r.max_ongoing)


def _holders(
    adapter: str, replicas: Mapping[str, ReplicaView], placement: Mapping[str, Collection[str]]
) -> set[str]:
    held = {rid for rid, r in replicas.items() if adapter in r.resident or adapter in r.loading}
    held.update(rid for rid in placement.get(adapter, ()) if rid in replicas)
    return held


def rank_replicas(
    adapters: Iterable[str],
    replicas: Sequence[ReplicaView],
    placement: Mapping[str, Collection[str]] | None = None,
    policy: PlacementPolicy = PlacementPolicy(),
    *,
    warm: Collection[str] = (),
    mean_load: float | None = None,
) -> list[list[str]]:
    """Rank replica ids into tiers for a request needing `adapters` (empty = the base model).

    `placement` maps an adapter to replica ids known to hold it from other sources (the catalog, or
    requests this router just sent there and whose load the stats don't show yet). `warm` names the
    adapters the router routed recently (the bounded-load rule applies when the request needs only warm
    ones). `mean_load` is the cluster's mean `ReplicaView.load`; None computes it from `replicas`, which is
    right when they are every replica (the router); a caller ranking a subset passes the cluster's.
    """
    by_id = {r.replica_id: r for r in replicas}
    needed = list(dict.fromkeys(a for a in adapters if a))
    placement = placement or {}
    mean: float | None = None
    if by_id and policy.bounded(needed, warm):
        mean = mean_load if mean_load is not None else sum(r.load for r in by_id.values()) / len(by_id)

    def over(rid: str) -> bool:
        return policy.overloaded(by_id[rid], mean)

    # Ties broken by id so the ranking is deterministic (tests, and stable affinity). Keys once per call.
    keys = {rid: (r.load, r.kv_usage, rid) for rid, r in by_id.items()}

    def order(ids: Iterable[str]) -> list[str]:
        return sorted(ids, key=keys.__getitem__)

    holds_all: set[str] = set(by_id)
    missing: dict[str, int] = dict.fromkeys(by_id, 0)
    for a in needed:
        held = _holders(a, by_id, placement)
        holds_all &= held
        for rid in by_id:
            if rid not in held:
                missing[rid] += 1

    tiers: list[list[str]] = []
    taken: set[str] = set()
    if needed:
        hit = [rid for rid in holds_all if not over(rid)]
        room = [
            rid
            for rid in by_id
            if rid not in holds_all and by_id[rid].free_slots >= missing[rid] and not over(rid)
        ]
        for tier in (hit, room):
            ranked = order(tier)[: policy.max_per_tier]
            if ranked:
                tiers.append(ranked)
                taken.update(ranked)
    else:
        calm = order(rid for rid in by_id if not over(rid))[: policy.max_per_tier]
        if calm:
            tiers.append(calm)
            taken.update(calm)
    rest = order(rid for rid in by_id if rid not in taken)
    # The fallback tier is probed in slices so a big cluster is not probed all at once.
    for i in range(0, len(rest), policy.max_per_tier):
        tiers.append(rest[i : i + policy.max_per_tier])
    return tiers


def view_from_stats(
    replica_id: str,
    stats: ReplicaStats | None,
    *,
    ongoing: int = 0,
    max_ongoing: int = 1,
    with_load: bool = True,
) -> ReplicaView:
    """The router's view of a replica from its last `record_routing_stats()` (None: nothing reported yet, so
    it holds nothing and is idle). Without `with_load` (stats too old to say how busy it is now) only what it
    holds counts; its load is then the router's own count, `ongoing`."""
    if stats is None:
        return ReplicaView(replica_id, ongoing=ongoing, max_ongoing=max_ongoing)
    return ReplicaView(
        replica_id=replica_id,
        resident=frozenset(stats.resident),
        free_slots=stats.free_slots,
        queue_len=stats.queue_len if with_load else 0,
        running=stats.running if with_load else 0,
        ongoing=ongoing,
        max_ongoing=max_ongoing,
        kv_usage=stats.kv_usage if with_load else 0.0,
        loading=frozenset(stats.loading),
    )
