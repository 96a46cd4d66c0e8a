"""The placement simulator's cluster: replicas with adapter caches and batch slots, a workload, an event loop.

Routing policies live in load_tests/placement/sim_policies.py; this module only calls their hooks, so every
policy meets the same replicas, the same request stream and the same clock. The model's numbers and their
sources are in load_tests/placement/RESULTS.md.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np

HIT, JOINED, MISS = 0, 1, 2  # resident on the replica / its load already under way there / a new cold load
# Why a policy chose the replica (policies that track holders say; the others leave NA).
NA, TO_HOLDER, SPILL, NO_HOLDER = (
    0,
    1,
    2,
    3,
)  # router believed it held the adapter / holders known, all passed
_LOAD_DONE, _DONE, _RETRY = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 1000
    adapters: int = 1_000_000
    alpha: float = 1.0
    requests: int = 300_000
    warmup_frac: float = 0.4  # requests before this fraction fill the caches and queues; not measured
    utilization: float = 0.7  # offered load / cluster capacity
    max_ongoing: int = 64  # requests in one replica's batch (AppConfig.max_ongoing_requests)
    device_slots: int = 128  # kernel.max_adapters (serve_config.yaml): what `free_slots` counts
    host_slots: int = 1024  # kernel.max_cpu_adapters (serve_config.yaml): what `resident` lists
    service_s: float = 41.8  # mean time one request holds a batch slot (64 tokens at 98.1/64 tok/s)
    load_s: float = 0.069  # cold adapter load, S3 -> usable (README P5 median)
    load_workers: int = 2  # AdapterManager's loader threads
    # Start from a running cluster: every adapter already on one replica (an even split, hottest kept when a
    # share exceeds host_slots), as affinity routing leaves it once each adapter has been used. Without it
    # the run starts cold and the first request for each adapter is a miss under any policy.
    prefill: bool = True
    stats_period_s: float = 1.0  # AppConfig.routing_stats_period_s
    assignment_ttl_s: float = 30.0  # request_router.ASSIGNMENT_TTL_S
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("replicas", "adapters", "requests", "max_ongoing", "device_slots", "host_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if not 0 < self.utilization <= 1.5:
            raise ValueError(f"utilization must be in (0, 1.5], got {self.utilization}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    @property
    def replica_rate(self) -> float:
        """Requests per second one replica completes with its batch full."""
        return self.max_ongoing / self.service_s

    @property
    def arrival_rate(self) -> float:
        return self.utilization * self.replicas * self.replica_rate


def zipf_popularity(n: int, alpha: float) -> np.ndarray:
    """P(rank k) for k = 0..n-1 (rank 0 the hottest), bounded zipf: numpy's zipf is unbounded and needs alpha > 1."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return w / w.sum()


@dataclass(frozen=True)
class Workload:
    """One request stream, shared by every policy: Poisson arrivals, zipf adapters, exponential service times."""

    arrival_s: list[float]
    adapter: list[str]
    service_s: list[float]
    first_touch: (
        np.ndarray
    )  # bool: no earlier request in the stream used this adapter (a miss for any policy)
    popularity: np.ndarray  # by rank
    adapter_of_rank: np.ndarray  # adapter ids are a permutation of ranks, so ids say nothing about heat

    @classmethod
    def make(cls, cfg: SimConfig) -> Workload:
        rng = np.random.default_rng(cfg.seed)
        p = zipf_popularity(cfg.adapters, cfg.alpha)
        cdf = np.cumsum(p)
        ranks = np.minimum(np.searchsorted(cdf, rng.random(cfg.requests), side="right"), cfg.adapters - 1)
        perm = rng.permutation(cfg.adapters)
        ids = perm[ranks]
        first = np.zeros(cfg.requests, dtype=bool)
        first[np.unique(ids, return_index=True)[1]] = True
        arrivals = np.cumsum(rng.exponential(1.0 / cfg.arrival_rate, cfg.requests))
        service = rng.exponential(cfg.service_s, cfg.requests)
        names: dict[int, str] = {}
        adapter = [names.setdefault(k, f"a{k}") for k in ids.tolist()]
        return cls(arrivals.tolist(), adapter, service.tolist(), first, p, perm)


class RouteCtx:
    """Per-request routing state that survives retries (Ray's RequestRoutingContext)."""

    __slots__ = ("start", "tried_first", "tried_fewest", "attempt")

    def __init__(self) -> None:
        self.start: float | None = None
        self.tried_first = False
        self.tried_fewest = False
        self.attempt = 0


class Policy(Protocol):
    """attach() learns the cluster's state at the start (prefill, pins); the hooks report every change."""

    name: str
    tick_s: float | None
    last_why: int  # NA, TO_HOLDER, SPILL or NO_HOLDER for the last route() that returned a replica

    def attach(self, sim: Simulation) -> None: ...
    def route(self, now: float, ctx: RouteCtx, adapter: str) -> int | None: ...
    def on_assign(self, now: float, r: int, adapter: str, outcome: int) -> None: ...
    def on_ongoing(self, r: int) -> None: ...
    def on_cache(self, r: int, adapters: tuple[str, ...]) -> None: ...
    def on_tick(self, now: float) -> None: ...


def backoff_s(attempt: int) -> float:
    """Ray Serve's router retry sleep (RAY_SERVE_ROUTER_RETRY_*: 25 ms doubling, at most 0.5 s)."""
    return min(0.025 * 2**attempt, 0.5)


class Simulation:
    """Replica state plus the event loop. Policies read `ongoing`, `host`, `loading`, `pinned`, `device`."""

    def __init__(self, cfg: SimConfig, workload: Workload, policy: Policy) -> None:
        R = cfg.replicas
        self.cfg, self.w, self.policy = cfg, workload, policy
        self.rng = random.Random(cfg.seed + 1)
        self.ongoing = [0] * R
        self.host: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(R)]  # LRU, oldest first
        self.device: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(R)]
        self.loading: list[dict[str, float]] = [{} for _ in range(R)]  # adapter -> when its load ends
        self.pinned: list[frozenset[str]] = [frozenset()] * R  # never evicted (hot-adapter replication)
        self._loader_free = [[0.0] * cfg.load_workers for _ in range(R)]
        self.area = [0.0] * R  # integral of ongoing dt: the load accounting
        self._area_t = [0.0] * R
        self.served = [0] * R
        n = len(workload.arrival_s)
        self.replica_of = [-1] * n
        self.delay_s = [math.nan] * n
        self.outcome = [-1] * n
        self.why = [NA] * n
        self.finished = 0
        self.retries = 0
        self._waiting = 0  # requests parked for a routing retry
        self._heap: list[tuple] = []
        self._seq = 0
        self.marks: dict[str, tuple[float, list[float], list[int]]] = {}
        if cfg.prefill:
            self._prefill()

    # ------------------------------------------------------------------ replica side
    def _account(self, r: int, now: float) -> None:
        self.area[r] += self.ongoing[r] * (now - self._area_t[r])
        self._area_t[r] = now

    def _push(self, t: float, kind: int, a, b) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _use_slot(self, r: int, adapter: str) -> None:
        dev = self.device[r]
        if adapter in dev:
            dev.move_to_end(adapter)
            return
        dev[adapter] = None
        if len(dev) > self.cfg.device_slots:
            dev.popitem(last=False)
        else:
            self.policy.on_cache(r, ())  # free_slots changed

    def assign(self, now: float, i: int, r: int) -> None:
        adapter = self.w.adapter[i]
        self._account(r, now)
        self.ongoing[r] += 1
        self.policy.on_ongoing(r)
        host = self.host[r]
        if adapter in host or adapter in self.pinned[r]:
            if adapter in host:
                host.move_to_end(adapter)
            self._use_slot(r, adapter)
            self.outcome[i], start = HIT, now
        elif adapter in self.loading[r]:
            self.outcome[i], start = JOINED, self.loading[r][adapter]
        else:
            free = self._loader_free[r]
            k = min(range(len(free)), key=free.__getitem__)
            start = free[k] = max(now, free[k]) + self.cfg.load_s
            self.loading[r][adapter] = start
            self._push(start, _LOAD_DONE, r, adapter)
            self.policy.on_cache(r, (adapter,))
            self.outcome[i] = MISS
        self.replica_of[i], self.delay_s[i] = r, start - now
        self._push(start + self.w.service_s[i], _DONE, r, i)
        self.policy.on_assign(now, r, adapter, self.outcome[i])

    def _load_done(self, r: int, adapter: str) -> None:
        del self.loading[r][adapter]
        host = self.host[r]
        host[adapter] = None
        changed = [adapter]
        while len(host) > max(1, self.cfg.host_slots - len(self.pinned[r])):
            changed.append(host.popitem(last=False)[0])
        self._use_slot(r, adapter)
        self.policy.on_cache(r, tuple(changed))

    def _done(self, now: float, r: int) -> None:
        self._account(r, now)
        self.ongoing[r] -= 1
        self.served[r] += 1
        self.finished += 1
        self.policy.on_ongoing(r)

    def _prefill(self) -> None:
        cfg, w = self.cfg, self.w
        share = np.random.default_rng(cfg.seed + 2).permutation(cfg.adapters)  # ranks, dealt round-robin
        for r in range(cfg.replicas):
            ranks = np.sort(share[r :: cfg.replicas])[: cfg.host_slots]
            names = [f"a{k}" for k in w.adapter_of_rank[ranks[::-1]].tolist()]  # coldest first: LRU order
            self.host[r] = OrderedDict.fromkeys(names)
            self.device[r] = OrderedDict.fromkeys(names[-cfg.device_slots :])

    def pin(self, pins: dict[int, list[str]]) -> None:
        """Load adapters that are never evicted (hot-adapter replication); call before the first request."""
        for r, names in pins.items():
            self.pinned[r] = frozenset(names)
            host = self.host[r]
            for a in names:
                host.pop(a, None)
            while len(host) > max(1, self.cfg.host_slots - len(names)):
                host.popitem(last=False)

    # ------------------------------------------------------------------ routing
    def _route(self, now: float, i: int, ctx: RouteCtx) -> None:
        adapter = self.w.adapter[i]
        # Ray's routing loop: a failed pass is retried at once, later ones after a growing sleep.
        for _ in range(2 if ctx.attempt == 0 else 1):
            r = self.policy.route(now, ctx, adapter)
            if r is not None:
                self.why[i] = self.policy.last_why
                self.assign(now, i, r)
                return
        self.retries += 1
        self._waiting += 1
        self._push(now + backoff_s(ctx.attempt), _RETRY, i, ctx)
        ctx.attempt += 1

    def _mark(self, name: str, now: float) -> None:
        for r in range(self.cfg.replicas):
            self._account(r, now)
        self.marks[name] = (now, list(self.area), list(self.served))

    def run(self) -> Simulation:
        self.policy.attach(self)
        arrivals, n = self.w.arrival_s, len(self.w.arrival_s)
        warm = int(n * self.cfg.warmup_frac)
        tick_s = self.policy.tick_s
        next_tick = tick_s if tick_s else math.inf
        heap, i = self._heap, 0
        while i < n or heap:
            t_arr = arrivals[i] if i < n else math.inf
            t_ev = heap[0][0] if heap else math.inf
            t = min(t_arr, t_ev)
            # Stats only steer routing: once every request is routed, nothing needs them.
            if next_tick <= t and (i < n or self._waiting):
                self.policy.on_tick(next_tick)
                next_tick += tick_s
                continue
            if t_ev <= t_arr:
                _, _, kind, a, b = heapq.heappop(heap)
                if kind == _DONE:
                    self._done(t, a)
                elif kind == _LOAD_DONE:
                    self._load_done(a, b)
                else:
                    self._waiting -= 1
                    self._route(t, a, b)
                continue
            if i == warm:
                self._mark("warm", t)
            if i == n - 1:
                self._mark("end", t)
            self._route(t, i, RouteCtx())
            i += 1
        return self
