"""The change to app/router/placement.py this simulator recommends, run through the unchanged
`rank_replicas` (policy `proposed`; the diff is in the issue-17 report).

Today a holder is passed over once its load reaches `overload_load` (0.9), whatever the adapter. With ~1,000
adapters per replica, most requests are for adapters seen once in minutes: passing their holder over costs
a cold load for a copy that is never used again, and moves no load for good (the holder stays busy and the
next rare adapter spills too). The proposal:
1. warm adapters (routed within the router's 30 s memory, so a new copy will be used again) pass a holder
   over at `balance` x the cluster's mean load + 1 request: consistent hashing with bounded loads
   (Mirrokni, Thorup, Zadimoghaddam, SODA 2018), which keeps max/mean near `balance` at any utilization;
2. other adapters stay on their holder until it is full (the `warm_s` option of OursPolicy picks a policy
   with overload_load 1.0 for them).
In placement.py the mean would be computed inside rank_replicas from its views (all replicas in the router);
the simulator passes the same mean through `at_mean_load` because it ranks a pruned candidate list.
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
