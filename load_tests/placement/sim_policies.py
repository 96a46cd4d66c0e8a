"""Routing policies for the placement simulator: ours (app/router/routing/placement.py, called, not copied), Ray Serve's
multiplexed power-of-two router (rewritten from Ray's source, see load_tests/placement/sim.py), random, plain
power-of-two choices, and ours plus pinned replicas of the hottest adapters."""

from __future__ import annotations

import math
from bisect import bisect_left, insort

from load_tests.placement.sim_core import NA, NO_HOLDER, SPILL, TO_HOLDER, RouteCtx, Simulation

RAY_MATCHING_TIMEOUT_S = 1.0  # RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S; Ray draws from [t, 2t)
RAY_PUSH_INTERVAL_S = 0.1  # PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S: replicas report loaded+loading model ids


def _pow2(sim: Simulation, cands) -> int | None:
    """PowerOfTwoChoicesRequestRouter: two distinct random candidates, the shorter queue that has room."""
    n = len(cands)
    if n == 0:
        return None
    if n == 1:
        pair = (cands[0],)
    else:
        i = sim.rng.randrange(n)
        j = sim.rng.randrange(n - 1)
        pair = (cands[i], cands[j + (j >= i)])
    best, best_q, cap = None, math.inf, sim.cfg.max_ongoing
    for r in pair:
        q = sim.ongoing[r]
        if q < cap and q < best_q:
            best, best_q = r, q
    return best


class _Base:
    tick_s: float | None = None
    last_why = NA

    def attach(self, sim: Simulation) -> None:
        self.sim = sim

    def on_assign(self, now: float, r: int, adapter: str, outcome: int) -> None:
        pass

    def on_ongoing(self, r: int) -> None:
        pass

    def on_cache(self, r: int, adapters: tuple[str, ...]) -> None:
        pass

    def on_tick(self, now: float) -> None:
        pass


class RandomPolicy(_Base):
    name = "random"

    def route(self, now: float, ctx: RouteCtx, adapter: str) -> int | None:
        r = self.sim.rng.randrange(self.sim.cfg.replicas)
        return r if self.sim.ongoing[r] < self.sim.cfg.max_ongoing else None


class Pow2Policy(_Base):
    name = "pow2"

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        self._all = list(range(sim.cfg.replicas))

    def route(self, now: float, ctx: RouteCtx, adapter: str) -> int | None:
        return _pow2(self.sim, self._all)


class _Buckets:
    """Replicas bucketed by a small integer key, each bucket a list with O(1) removal and random access."""

    def __init__(self) -> None:
        self.buckets: list[list[int]] = [[]]
        self.key: dict[int, int] = {}
        self._pos: dict[int, int] = {}
        self._min = 0

    def put(self, r: int, k: int) -> None:
        old = self.key.get(r)
        if old == k:
            return
        if old is not None:
            b, p = self.buckets[old], self._pos[r]
            b[p] = b[-1]
            self._pos[b[p]] = p
            b.pop()
        while len(self.buckets) <= k:
            self.buckets.append([])
        b = self.buckets[k]
        self._pos[r] = len(b)
        b.append(r)
        self.key[r] = k
        self._min = min(self._min, k)
        while not self.buckets[self._min]:  # counts move by one or two: the scan is short
            self._min += 1

    def lowest(self) -> list[int]:
        return self.buckets[self._min]


class RayMultiplexPolicy(_Base):
    """Ray Serve 2.60's PowerOfTwoChoicesRequestRouter with MultiplexMixin.apply_multiplex_routing."""

    name = "ray_multiplex"
    tick_s = RAY_PUSH_INTERVAL_S

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        self._all = list(range(sim.cfg.replicas))
        self._holders: dict[str, set[int]] = {}  # _multiplexed_model_id_to_replica_ids, as pushed
        self._fallback: set[str] = set()  # _multiplexed_model_id_fallback_match
        self._pushed: list[set[str]] = [set() for _ in self._all]
        self._changed: dict[int, set[str]] = {}
        self._count = _Buckets()  # replicas by number of pushed model ids: "fewest models"
        for r in self._all:
            self._count.put(r, 0)
            self._changed[r] = set(sim.host[r]) | sim.pinned[r]
        self.on_tick(0.0)  # the controller already knows what a running cluster holds

    def on_cache(self, r: int, adapters: tuple[str, ...]) -> None:
        if adapters:
            self._changed.setdefault(r, set()).update(adapters)

    def on_tick(self, now: float) -> None:
        sim = self.sim
        for r, names in self._changed.items():
            pushed = self._pushed[r]
            for a in names:
                held = a in sim.host[r] or a in sim.loading[r] or a in sim.pinned[r]
                if held and a not in pushed:
                    pushed.add(a)
                    self._holders.setdefault(a, set()).add(r)
                elif not held and a in pushed:
                    pushed.discard(a)
                    self._holders[a].discard(r)
                    if not self._holders[a]:
                        del self._holders[a]
            self._count.put(r, len(pushed))
        self._changed.clear()

    def route(self, now: float, ctx: RouteCtx, adapter: str) -> int | None:
        if ctx.start is None:
            ctx.start = now
        timeout = self.sim.rng.uniform(RAY_MATCHING_TIMEOUT_S, 2 * RAY_MATCHING_TIMEOUT_S)
        holders = self._holders.get(adapter)
        if now - ctx.start < timeout:
            cands = holders
            if (not cands and adapter not in self._fallback) or ctx.tried_first:
                cands = self._count.lowest()
                self._fallback.add(adapter)
            elif cands:
                self._fallback.discard(adapter)
                cands = tuple(cands)
            ctx.tried_first = True
        elif not ctx.tried_fewest:
            cands = self._count.lowest()
            ctx.tried_fewest = True
        else:
            cands = self._all
        r = _pow2(self.sim, cands or ())
        self.last_why = NO_HOLDER if not holders else TO_HOLDER if r in holders else SPILL
        return r


class _LoadIndex:
    """Replicas by busy count, each bucket sorted by index: the k first in rank_replicas' (load, kv, id) order."""

    def __init__(self, levels: int) -> None:
        self.buckets: list[list[int]] = [[] for _ in range(levels)]
        self.key: dict[int, int] = {}

    def put(self, r: int, level: int | None) -> None:
        old = self.key.get(r)
        if old == level:
            return
        if old is not None:
            b = self.buckets[old]
            del b[bisect_left(b, r)]
            del self.key[r]
        if level is not None:
            insort(self.buckets[level], r)
            self.key[r] = level

    def smallest(self, k: int, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The k first replicas not in `skip`."""
        out: list[int] = []
        for b in self.buckets:
            for r in b:
                if r not in skip:
                    out.append(r)
                    if len(out) >= k:
                        return out
        return out
