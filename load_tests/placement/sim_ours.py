"""Our policy in the simulator: app/router/routing/request_router.py's AdapterAffinityRouter around the real
`placement.rank_replicas` and `placement.view_from_stats`, with what that router sees: replica stats up to
`stats_period_s` old, its own in-flight counts, and its 30 s memory of where it just sent each adapter, less what
newer stats show dropped since (`AssignmentMemory.confirmed`, the router's own call). That memory is also what
makes an adapter warm: routed within it, so the bounded-load rule applies to it.

rank_replicas over all 1,000 replicas (what the real router does per request) costs milliseconds, too slow
for 10^6 decisions on one core, so each decision ranks only the replicas that can matter. rank_replicas orders
by (load, kv_usage, id) and its tiers are the first `max_per_tier` (m) of: holders that are not overloaded
(`PlacementPolicy.overloaded` with the cluster's mean load, passed to every call as `mean_load`),
then non-holders with free slots, then slices of the rest. Hence:
1. the m least-loaded holders, ranked alone, return the full call's first tier whenever that is the hit tier;
2. else the m least-loaded holders, the m least-loaded non-holders with free slots and the K = 3m
   least-loaded replicas return the full call's tiers up to and including its first slice of the rest;
3. if no replica in those tiers has room, the full call over every replica decides.
`exact=True` always makes the full call; the tests check that both route every request identically.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import replace

from app.protocol import ReplicaStats
from app.router.routing import placement  # the module, so a test can spy on placement.rank_replicas
from app.router.routing.assignments import AssignmentMemory
from load_tests.placement.sim_core import (
    NO_HOLDER,
    SPILL,
    TO_HOLDER,
    RouteCtx,
    SimConfig,
    Simulation,
    Workload,
)
from load_tests.placement.sim_policies import _Base, _LoadIndex

STATS_GROUPS = 10  # replicas report at staggered times: a tenth of them every stats_period_s / 10


class OursPolicy(_Base):
    def __init__(
        self,
        policy: placement.PlacementPolicy | None = None,
        *,
        exact: bool = False,
        pins: dict[int, list[str]] | None = None,
        name: str = "ours",
        prune_k: int | None = None,
    ) -> None:
        self.policy = policy or placement.PlacementPolicy()
        self.exact, self.pins, self.name = exact, pins or {}, name
        m = self.policy.max_per_tier
        self.k = prune_k or 3 * m
        if self.k < 3 * m:
            raise ValueError(f"prune_k must be >= 3 * max_per_tier ({3 * m}), got {self.k}")
        self.n_exact = (self.k - 2 * m) // m
        self.calls = self.full_calls = 0

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        cfg = sim.cfg
        self.tick_s = cfg.stats_period_s / STATS_GROUPS
        R, width = cfg.replicas, len(str(cfg.replicas - 1))
        # Zero-padded ids: string order is index order, so _LoadIndex's tie-break is rank_replicas' own.
        self.rid = [f"r{r:0{width}d}" for r in range(R)]
        self.index = {rid: r for r, rid in enumerate(self.rid)}
        # Each replica's last routing stats, as the router holds them (replaced whole at each report).
        self.snap = [ReplicaStats(self.rid[r], free_slots=cfg.device_slots) for r in range(R)]
        self.views: list[placement.ReplicaView | None] = [None] * R
        self.holders: dict[str, set[int]] = {}  # adapter -> replicas whose last stats list it
        self._changed: dict[int, set[str]] = {}  # adapters to re-check at a replica's next stats
        # The router's own memory of where it sent each adapter (replica indexes here, unique ids there).
        self.memory = AssignmentMemory(sim.cfg.assignment_ttl_s)
        self._all = _LoadIndex(cfg.max_ongoing + 1)
        self.key_sum = 0  # sum of the router's busy counts: the cluster's mean load
        self._free = _LoadIndex(cfg.max_ongoing + 1)
        self.catalog: dict[str, list[str]] = {}  # placement the catalog knows (pinned copies)
        for r, names in self.pins.items():
            for a in names:
                self.catalog.setdefault(a, []).append(self.rid[r])
        sim.pin(self.pins)
        for r in range(R):  # every replica's first stats
            self._changed[r] = set(sim.host[r]) | sim.pinned[r]
            self._report(r, 0.0)
        self._group = 0
        self._ticks = 0

    # ------------------------------------------------------------------ what the router knows
    def _key(self, r: int) -> int:
        return max(self.sim.ongoing[r], self.snap[r].running)

    def _set_key(self, r: int, key: int) -> None:
        self.key_sum += key - self._all.key.get(r, 0)
        self._all.put(r, key)

    def mean_load(self) -> float:
        """The cluster's mean ReplicaView.load, as rank_replicas computes it over every replica."""
        return self.key_sum / (self.sim.cfg.replicas * self.sim.cfg.max_ongoing)

    def _report(self, r: int, now: float) -> None:
        """Replica r's record_routing_stats(), taken at `now`, reaches the router."""
        sim, s = self.sim, self.snap[r]
        changed = self._changed.pop(r, None)
        if changed is not None:
            res = frozenset(sim.host[r])
            if sim.pinned[r]:
                res |= sim.pinned[r]
            loading = frozenset(sim.loading[r])
            free = sim.cfg.device_slots - len(sim.device[r])
            s = replace(s, resident=tuple(res), loading=tuple(loading), free_slots=free)
            for a in changed:
                held, hs = a in res or a in loading, self.holders.get(a)
                if held:
                    if hs is None:
                        self.holders[a] = {r}
                    else:
                        hs.add(r)
                elif hs is not None:
                    hs.discard(r)
                    if not hs:
                        del self.holders[a]
        s = self.snap[r] = replace(s, running=sim.ongoing[r], at=now)
        self.views[r] = None
        key = self._key(r)
        self._set_key(r, key)
        self._free.put(r, key if s.free_slots > 0 else None)

    def on_cache(self, r: int, adapters: tuple[str, ...]) -> None:
        self._changed.setdefault(r, set()).update(adapters)

    def on_ongoing(self, r: int) -> None:
        self.views[r] = None
        key = self._key(r)
        self._set_key(r, key)
        if r in self._free.key:
            self._free.put(r, key)

    def on_tick(self, now: float) -> None:
        for r in range(self._group, self.sim.cfg.replicas, STATS_GROUPS):
            self._report(r, now)
        self._group = (self._group + 1) % STATS_GROUPS
        self._ticks += 1
        if self._ticks % 100 == 0:  # forget expired assignments (the router sweeps once a TTL)
            self.memory.sweep(now)

    def on_assign(self, now: float, r: int, adapter: str, outcome: int) -> None:
        self.memory.record(adapter, r, now)  # AdapterAffinityRouter.on_request_routed

    def view(self, r: int) -> placement.ReplicaView:
        v = self.views[r]
        if v is None:
            v = self.views[r] = placement.view_from_stats(
                self.rid[r], self.snap[r], ongoing=self.sim.ongoing[r], max_ongoing=self.sim.cfg.max_ongoing
            )
        return v

    # ------------------------------------------------------------------ routing
    def _select(self, tiers: list[list[str]]) -> int | None:
        """Ray's probe of each tier in turn: the shortest queue with room, the first one on ties."""
        ongoing, cap = self.sim.ongoing, self.sim.cfg.max_ongoing
        for tier in tiers:
            best, best_q = None, math.inf
            for rid in tier:
                r = self.index[rid]
                q = ongoing[r]
                if q < cap and q < best_q:
                    best, best_q = r, q
            if best is not None:
                return best
        return None

    def _rank(self, adapter: str, rs, known: list[str], warm: tuple[str, ...]) -> list[list[str]]:
        views = [self.view(r) for r in rs]
        return placement.rank_replicas(
            [adapter], views, {adapter: known}, self.policy, warm=warm, mean_load=self.mean_load()
        )

    def full_call(self, adapter: str, known: list[str], warm: tuple[str, ...] = ()) -> list[list[str]]:
        return self._rank(adapter, range(self.sim.cfg.replicas), known, warm)

    def route(self, now: float, ctx: RouteCtx, adapter: str) -> int | None:
        cand = set(self.holders.get(adapter, ()))
        known = list(self.catalog.get(adapter, ()))
        # AdapterAffinityRouter._recent_placement: the memory, less what newer stats show evicted since.
        w = self.memory.confirmed(adapter, now, self.snap.__getitem__)
        if w:
            rid = self.rid
            known.extend(rid[r] for r in w)
            cand.update(w)
        self.calls += 1
        # Warm: the router's memory still holds an assignment of it (AdapterAffinityRouter's `warm`).
        r = self._decide(adapter, cand, known, (adapter,) if w else ())
        held = cand
        self.last_why = NO_HOLDER if not held else TO_HOLDER if r in held else SPILL
        return r

    def _decide(self, adapter: str, held: set[int], known: list[str], warm: tuple[str, ...]) -> int | None:
        if self.exact:
            self.full_calls += 1
            return self._select(self.full_call(adapter, known, warm))
        policy = self.policy
        mean = self.mean_load() if policy.bounded([adapter], warm) else None
        m, key = policy.max_per_tier, self._all.key
        # The hit tier is the m least-loaded holders. Ranked alone, they come back first exactly when that
        # tier is not empty (none of them overloaded), and then the full call's first tier is the same list.
        top = heapq.nsmallest(m, held, key=lambda r: (key[r], r)) if len(held) > m else list(held)
        if top:
            first = self._rank(adapter, top, known, warm)[0]
            if all(not policy.overloaded(self.view(self.index[rid]), mean) for rid in first):
                r = self._select([first])
                if r is not None:
                    return r
        # Add the m least-loaded non-holders with free slots (the room tier) and the k least-loaded replicas
        # (the first rest slices).
        cand = set(top)
        cand.update(self._free.smallest(m, skip=held))
        cand.update(self._all.smallest(self.k))
        if len(cand) < self.sim.cfg.replicas:
            r = self._select(self._rank(adapter, cand, known, warm)[: self.n_exact])
            if r is not None:
                return r
        self.full_calls += 1
        return self._select(self.full_call(adapter, known, warm))

    def full_call_cost_s(self, samples: int = 200) -> float:
        """Seconds one rank_replicas call over every replica takes (what the real router pays per request)."""
        names = self.sim.w.adapter[-samples:]
        t0 = time.perf_counter()
        for a in names:
            self.views = [None] * self.sim.cfg.replicas  # the router builds every view per call
            self.full_call(a, [])
        return (time.perf_counter() - t0) / max(1, len(names))


def hot_pins(cfg: SimConfig, w: Workload, share: float = 0.5) -> dict[int, list[str]]:
    """Pin each adapter whose traffic exceeds `share` of one replica on ceil(rate / (share * rate_1)) replicas,
    spread by a greedy least-pinned-traffic fill. Popularity is the workload's own (an oracle; in production
    the catalog's request counters)."""
    lam, mu = cfg.arrival_rate, cfg.replica_rate
    heap = [(0.0, r) for r in range(cfg.replicas)]
    pins: dict[int, list[str]] = {}
    for rank, p in enumerate(w.popularity.tolist()):
        rate = p * lam
        copies = min(cfg.replicas, math.ceil(rate / (share * mu)))
        if copies < 2:
            break
        name = f"a{int(w.adapter_of_rank[rank])}"
        taken = [heapq.heappop(heap) for _ in range(copies)]
        for load, r in taken:
            pins.setdefault(r, []).append(name)
            heapq.heappush(heap, (load + rate / copies, r))
    return pins
