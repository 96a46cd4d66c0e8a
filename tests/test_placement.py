"""The placement ranking (a pure function) and the router's reading of multiplexed model ids."""

import itertools
import random

import pytest

from app.router.placement import PlacementPolicy, ReplicaView, rank_replicas, view_from_stats
from app.router.request_router import adapters_of


def R(rid, *, resident=(), free=0, ongoing=0, cap=10, kv=0.0, loading=(), queue=0, running=0):
    return ReplicaView(
        rid,
        resident=frozenset(resident),
        free_slots=free,
        ongoing=ongoing,
        max_ongoing=cap,
        kv_usage=kv,
        loading=frozenset(loading),
        queue_len=queue,
        running=running,
    )


def flat(tiers):
    return [rid for tier in tiers for rid in tier]


def test_holder_first_then_free_slots_then_the_rest():
    replicas = [
        R("a", free=0, ongoing=1),
        R("b", resident={"x@1"}, ongoing=5),
        R("c", free=3),
        R("d", free=1, ongoing=2),
    ]
    tiers = rank_replicas(["x@1"], replicas)
    assert tiers == [["b"], ["c", "d"], ["a"]]


def test_base_model_goes_to_least_loaded_and_overloaded_last():
    replicas = [R("a", ongoing=9), R("b", ongoing=2), R("c", ongoing=0), R("d", ongoing=10)]
    assert rank_replicas([], replicas) == [["c", "b"], ["a", "d"]]


def test_overloaded_holder_yields_to_replicas_with_free_slots():
    replicas = [R("hot", resident={"x@1"}, ongoing=9, free=5), R("cold", free=2, ongoing=1)]
    tiers = rank_replicas(["x@1"], replicas)
    assert tiers[0] == ["cold"]
    assert tiers[-1] == ["hot"]  # still tried before failing the request


def test_kv_pressure_counts_as_overload():
    replicas = [R("a", resident={"x@1"}, kv=0.97), R("b", resident={"x@1"}, kv=0.2)]
    assert rank_replicas(["x@1"], replicas)[0] == ["b"]


def test_recent_assignment_and_loading_count_as_holding():
    replicas = [R("a", free=4), R("b", free=4, loading={"y@2"}), R("c", free=4, ongoing=3)]
    assert rank_replicas(["x@1"], replicas, {"x@1": ["c"]})[0] == ["c"]
    assert rank_replicas(["y@2"], replicas)[0] == ["b"]
    # a stale placement entry for a replica that is gone is ignored
    assert rank_replicas(["x@1"], replicas, {"x@1": ["gone"]})[0] == ["a", "b", "c"]


def test_merge_needs_every_term_and_slots_for_the_missing_ones():
    replicas = [
        R("both", resident={"a@1", "b@1"}, ongoing=4),
        R("one", resident={"a@1"}, free=1),
        R("none1", free=1),
        R("none2", free=2, ongoing=1),
    ]
    tiers = rank_replicas(["a@1", "b@1"], replicas)
    assert tiers[0] == ["both"]
    assert tiers[1] == ["one", "none2"]  # none1 lacks room for two loads
    assert tiers[2] == ["none1"]


def test_versions_are_distinct_adapters():
    replicas = [R("old", resident={"x@1"}), R("new", resident={"x@2"})]
    assert rank_replicas(["x@2"], replicas)[0] == ["new"]


def test_cold_adapter_without_free_slots_anywhere_goes_least_loaded():
    replicas = [R("a", ongoing=3), R("b", ongoing=1), R("c", ongoing=2)]
    assert rank_replicas(["z@1"], replicas) == [["b", "c", "a"]]


def test_load_uses_the_larger_of_router_and_replica_counts():
    # The replica reports 9 busy although this router saw only 1 in flight (another router sent them).
    replicas = [R("a", ongoing=1, queue=6, running=3), R("b", ongoing=3)]
    assert rank_replicas([], replicas) == [["b"], ["a"]]


@pytest.mark.parametrize("seed", range(20))
def test_tiers_partition_the_replicas_and_respect_the_tier_size(seed):
    rng = random.Random(seed)
    adapters = [f"ad{i}@1" for i in range(6)]
    replicas = [
        R(
            f"r{i}",
            resident=set(rng.sample(adapters, rng.randint(0, 4))),
            free=rng.randint(0, 3),
            ongoing=rng.randint(0, 12),
            kv=rng.random(),
        )
        for i in range(rng.randint(1, 13))
    ]
    policy = PlacementPolicy(max_per_tier=3)
    need = rng.sample(adapters, rng.randint(0, 2))
    tiers = rank_replicas(need, replicas, policy=policy)
    ids = flat(tiers)
    assert sorted(ids) == sorted(r.replica_id for r in replicas)  # each replica exactly once
    assert all(1 <= len(t) <= 3 for t in tiers)
    by_id = {r.replica_id: r for r in replicas}
    if need and tiers:
        first = tiers[0]
        holders = [r for r in replicas if set(need) <= r.resident and not policy.overloaded(r)]
        if holders:  # a healthy holder always wins over any non-holder
            assert all(set(need) <= by_id[rid].resident for rid in first)
    for t in tiers:  # inside a tier: least loaded first
        loads = [by_id[rid].load for rid in t]
        assert loads == sorted(loads)


def test_ranking_is_deterministic_under_input_order():
    replicas = [R(f"r{i}", free=1) for i in range(5)]
    ranked = {tuple(map(tuple, rank_replicas(["x@1"], list(p)))) for p in itertools.permutations(replicas)}
    assert len(ranked) == 1


def test_view_from_stats_tolerates_missing_stats():
    v = view_from_stats("r1", None, ongoing=2, max_ongoing=4)
    assert (v.resident, v.free_slots, v.load) == (frozenset(), 0, 0.5)
    v = view_from_stats(
        "r2",
        {
            "resident": ["a@1"],
            "free_slots": 3,
            "queue_len": 1,
            "running": 2,
            "kv_usage": 0.5,
            "loading": ["b@1"],
        },
        max_ongoing=6,
    )
    assert v.resident == {"a@1"} and v.loading == {"b@1"} and v.free_slots == 3 and v.load == 0.5


@pytest.mark.parametrize(
    "kwargs", [dict(overload_load=0), dict(overload_kv=0), dict(overload_kv=1.5), dict(max_per_tier=0)]
)
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        PlacementPolicy(**kwargs)


@pytest.mark.parametrize(
    "model_id, adapters",
    [
        ("a@1", ["a@1"]),
        ("org/a@3", ["org/a@3"]),
        ("a@1|b@2", ["a@1", "b@2"]),
        ("a@1*0.7+b@2*0.3", ["a@1", "b@2"]),
        ("a@1*0.5+b@1*0.5|c@4", ["a@1", "b@1", "c@4"]),
        ("x@2*-1+y@1*1e-1", ["x@2", "y@1"]),
    ],
)
def test_adapters_of_multiplexed_ids(model_id, adapters):
    assert adapters_of(model_id) == adapters
