"""A candidate change to app/router/placement.py, run through the unchanged `rank_replicas` as a subclass
(`--policies ours_bounded`). Tried and not recommended: it balances load (max/mean ~1.13) but spills more
requests to non-holders, so more cold loads than today's policy and several times Ray's.

Today a holder stops being preferred at an absolute load (`overload_load`, 0.9). Near that utilization most
holders cross it often and every crossing becomes a cold load elsewhere; well below it, one holder of a hot
adapter can run at 0.9 while the mean is 0.6 (max/mean 1.5). Consistent hashing with bounded loads
(Mirrokni, Thorup, Zadimoghaddam, SODA 2018) bounds a holder relative to the mean instead: it stays preferred
while its load is below `balance` x the cluster's mean load plus one request. In placement.py the mean would
be computed inside rank_replicas from its views (all replicas in the router); the simulator passes the same
mean through `at_mean_load` because it hands rank_replicas a pruned candidate list.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.router.placement import PlacementPolicy, ReplicaView


@dataclass(frozen=True)
class BoundedLoadPolicy(PlacementPolicy):
    balance: float = 1.2  # a holder is overloaded at balance x mean load (+1 request), not at overload_load
    mean_load: float = 0.0  # the cluster's mean ReplicaView.load at this call

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.balance < 1:
            raise ValueError(f"balance must be >= 1, got {self.balance}")

    def at_mean_load(self, mean_load: float) -> BoundedLoadPolicy:
        return replace(self, mean_load=mean_load)

    def overloaded(self, r: ReplicaView) -> bool:
        limit = self.balance * self.mean_load + 1 / max(1, r.max_ongoing)
        return r.load >= limit or r.kv_usage >= self.overload_kv
