"""AdapterAffinityRouter itself, on stand-ins for Ray's RunningReplica (the simulator and tests/test_placement.py
cover the policy; this covers the router's own state: its memory, stats overruling it, the per-stats cache)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from ray.serve._private.request_router.common import ReplicaQueueLengthCache
from ray.serve._private.request_router.request_router import RequestRouter

from app.names import ModelSpec, parse_model
from app.protocol import ReplicaRequest, ReplicaStats
from app.router.routing import request_router
from app.router.routing.assignments import STATS_LAG_S
from app.router.routing.request_router import AdapterAffinityRouter


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


@dataclass
class FakeReplica:
    replica_id: FakeReplicaID
    routing_stats: ReplicaStats | dict = field(default_factory=dict)  # Serve's {} before the first report
    max_ongoing_requests: int = 48


def stats(rid: str, **fields) -> ReplicaStats:
    """A replica's routing stats (lists given as lists, as a test writes them)."""
    return ReplicaStats(rid, **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def restat(replica: FakeReplica, **changes) -> None:
    """New stats for `replica`: its last ones with `changes` (a new object, as each report is)."""
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
    replica.routing_stats = replace(replica.routing_stats, **changes)


def router_over(replicas: list[FakeReplica]) -> AdapterAffinityRouter:
    """The router without Ray's constructor: the state choose_replicas and on_request_routed read."""
    r = AdapterAffinityRouter.__new__(AdapterAffinityRouter)
    r._replicas = {x.replica_id: x for x in replicas}
    r._replica_queue_len_cache = ReplicaQueueLengthCache()
    r._use_replica_queue_len_cache = True
    r._lazily_fetched_loop = SimpleNamespace(create_task=lambda coro: coro.close())  # Ray's background probes
    r.initialize_state()
    return r


def pending(model_id: str):
    request = ReplicaRequest("r", spec=parse_model(model_id) if model_id else ModelSpec())
    return SimpleNamespace(
        args=[request],
        metadata=SimpleNamespace(multiplexed_model_id=model_id, call_method="generate"),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def choose(router, model_id: str) -> list[list[str]]:
    tiers = asyncio.run(router.choose_replicas(list(router._replicas.values()), pending(model_id)))
    return [[x.replica_id.unique_id for x in t] for t in tiers]


def replicas(n: int, **fields) -> list[FakeReplica]:
    return [FakeReplica(FakeReplicaID(f"r{i}"), stats(f"r{i}", **fields)) for i in range(n)]


def test_holder_first_then_memory_until_newer_stats_say_evicted(monkeypatch):
    reps = replicas(3)
    reps[2].routing_stats = stats("r2", resident=["a@1"], free_slots=0, at=time.time())
    router = router_over(reps)
    assert choose(router, "a@1")[0] == ["r2"]
    # A cold adapter sent to r0: the memory keeps the next request there before r0's stats show it.
    router.on_request_routed(pending("b@1"), reps[0].replica_id, None)
    assert choose(router, "b@1")[0] == ["r0"]
    # r0's stats taken STATS_LAG_S after the send, without b: it was evicted; the memory yields.
    later = time.time() + STATS_LAG_S + 0.5
    reps[0].routing_stats = stats("r0", resident=[], loading=[], free_slots=0, at=later)
    assert choose(router, "b@1")[0] != ["r0"]
    assert router._memory.where("b@1", time.time()) == []


def test_views_are_built_once_per_stats_object(monkeypatch):
    built = []
    real = request_router.view_from_stats
    monkeypatch.setattr(request_router, "view_from_stats", lambda *a, **k: built.append(1) or real(*a, **k))
    reps = replicas(5, resident=[f"x{i}@1" for i in range(50)])
    router = router_over(reps)
    for _ in range(10):
        choose(router, "x3@1")
    assert len(built) == 5  # once per replica, not per request
    reps[1].routing_stats = stats(
        "r1", resident=["y@1"], free_slots=0
    )  # new stats: rebuilt for that one only
    assert choose(router, "y@1")[0] == ["r1"]
    assert len(built) == 6
    # a new in-flight count updates the view (the router's own count is what balances load)
    router._replica_queue_len_cache.update(reps[1].replica_id, 48)
    assert choose(router, "y@1")[0] != ["r1"]  # full: no longer first
    assert len(built) == 6
    # replicas that left without a death notice do not pile up in the cache
    router._replicas = {x.replica_id: x for x in reps[:1]}
    for i in range(20):
        router._views[f"gone{i}"] = (None, 0, False, None)
    choose(router, "y@1")
    assert set(router._views) == {"r0"}


def test_one_decision_at_1000_replicas_is_cheap_once_stats_are_cached():
    """The cost the simulator's note named: building every replica's view per request (~30 ms at 1,000 replicas x
    200 resident adapters). Cached, a decision is the ranking alone."""
    reps = [
        FakeReplica(
            FakeReplicaID(f"r{i:04d}"),
            stats(f"r{i:04d}", resident=[f"a{i}-{j}@1" for j in range(200)], free_slots=i % 3, running=i % 7),
        )
        for i in range(1000)
    ]
    router = router_over(reps)
    choose(router, "a5-5@1")  # builds the sets
    t0 = time.perf_counter()
    for k in range(10):
        assert choose(router, f"a{k}-1@1")[0] == [f"r{k:04d}"]
    per_call = (time.perf_counter() - t0) / 10
    print(f"\nchoose_replicas at 1,000 replicas: {per_call * 1e3:.1f} ms")
    assert per_call < 0.1  # generous: 2 loaded cores; ~5 ms quiet


def ray_picks(router, model_id: str) -> str:
    """The replica Ray's own selection takes from the first tier (its cache first; nothing to probe here)."""
    tiers = asyncio.run(router.choose_replicas(list(router._replicas.values()), pending(model_id)))
    chosen = asyncio.run(RequestRouter._select_from_candidate_replicas(router, tiers[0], 0))
    return chosen.replica_id.unique_id


def test_an_idle_replica_missing_from_rays_cache_is_chosen_from_its_fresh_stats():
    """Ray takes the lowest *cached* queue length and probes uncached replicas only in the background (0.1 s
    deadline, often missed on a busy machine): a busy cached replica would win over an idle uncached one
    forever. The router fills the idle one's entry from its stats, so Ray's own comparison picks it."""
    now = time.time()
    reps = replicas(2, at=now)
    restat(reps[0], running=1)
    router = router_over(reps)
    # a stream in flight there, sent by this router
    router.replica_queue_len_cache.update(reps[0].replica_id, 1)
    assert ray_picks(router, "") == "r1"
    assert router.replica_queue_len_cache.get(reps[1].replica_id) == 0
    # Stats that say it is busy are believed too: two running + one queued there, one request at r0.
    reps2 = replicas(2, at=now)
    restat(reps2[1], running=2, queue_len=1, ongoing=3)
    router2 = router_over(reps2)
    router2.replica_queue_len_cache.update(reps2[0].replica_id, 1)
    assert ray_picks(router2, "") == "r0"
    assert router2.replica_queue_len_cache.get(reps2[1].replica_id) == 3


def test_stale_stats_and_unavailable_replicas_are_left_to_rays_probes():
    now = time.time()
    reps = replicas(3)
    restat(reps[0], at=now - request_router.STATS_FRESH_S - 1)  # stats stopped coming
    restat(reps[1], at=now)  # fresh, but Ray just found the actor unavailable
    restat(reps[2], at=now)
    router = router_over(reps)
    router._unavailable_at[reps[1].replica_id.unique_id] = now
    choose(router, "")
    cache = router.replica_queue_len_cache
    assert cache.get(reps[0].replica_id) is None
    assert cache.get(reps[1].replica_id) is None
    assert cache.get(reps[2].replica_id) == 0
    # once the hold is over, fresh stats seed it again
    router._unavailable_at[reps[1].replica_id.unique_id] = now - request_router.UNAVAILABLE_HOLD_S - 1
    choose(router, "")
    assert cache.get(reps[1].replica_id) == 0


def test_stale_stats_do_not_count_as_load():
    """A CI run: an idle replica's last stats to reach the router were from a burst 9 s earlier (64 running), so it
    looked full and every stream went to the busy one. Stats older than STATS_FRESH_S still say what a replica
    holds, but its load is then the router's own count of requests in flight."""
    now = time.time()
    reps = replicas(2)
    restat(reps[0], running=1, at=now)
    restat(reps[1], running=64, queue_len=10, kv_usage=0.99, resident=["a@1"], at=now - 9)
    router = router_over(reps)
    router.replica_queue_len_cache.update(reps[0].replica_id, 1)  # one stream in flight there
    router.replica_queue_len_cache.update(reps[1].replica_id, 0)  # the burst finished: the router saw it end
    assert ray_picks(router, "") == "r1"
    assert choose(router, "a@1")[0] == ["r1"]  # still known to hold its adapter
    # the same stats, fresh: r1 really is full, and the router believes it
    restat(reps[1], at=time.time())
    assert ray_picks(router, "") == "r0"


def test_a_count_ray_left_high_is_lowered_by_the_replicas_own_newer_count():
    """A quiet-machine run: Ray's cache held 10 requests for an idle replica (ends it never saw), so six streams in a
    row went to the other one. Fresh stats taken after this router's last send there carry the replica's own
    count of generate() calls, which replaces the higher one; stats older than that send do not."""
    now = time.time()
    reps = replicas(2)
    restat(reps[0], ongoing=1, running=1, at=now)
    restat(reps[1], ongoing=0, at=now)
    router = router_over(reps)
    router.replica_queue_len_cache.update(reps[0].replica_id, 1)
    router.replica_queue_len_cache.update(reps[1].replica_id, 10)  # leaked
    router._last_sent[reps[1].replica_id.unique_id] = now - 5
    assert ray_picks(router, "") == "r1"
    assert router.replica_queue_len_cache.get(reps[1].replica_id) == 0
    # a send after the stats were taken: they may not count it, so the router keeps its own count
    router2 = router_over(reps)
    router2.replica_queue_len_cache.update(reps[0].replica_id, 1)
    router2.replica_queue_len_cache.update(reps[1].replica_id, 10)
    router2._last_sent[reps[1].replica_id.unique_id] = now + 1
    assert ray_picks(router2, "") == "r0"
    assert router2.replica_queue_len_cache.get(reps[1].replica_id) == 10
