"""The placement simulator (load_tests/placement/sim*.py) on a small cluster: its accounting holds, our policy
really goes through app.router.routing.placement, and its candidate pruning changes no decision."""

import json
from dataclasses import replace

import pytest

from app.router.routing import placement
from load_tests.placement import sim
from load_tests.placement.sim import POLICIES, check_invariants, run_one
from load_tests.placement.sim_core import HIT, JOINED, MISS, SimConfig, Simulation, Workload
from load_tests.placement.sim_ours import OursPolicy, hot_pins

# 20 replicas of 16 batch slots and 64 host slots for 2,000 adapters: caches are too small to hold every
# adapter, so evictions, spills and retries all happen within a few thousand requests.
SMALL = SimConfig(
    replicas=20,
    adapters=2_000,
    requests=3_000,
    max_ongoing=16,
    device_slots=16,
    host_slots=64,
    service_s=4.0,
    utilization=0.85,
    warmup_frac=0.3,
)


@pytest.fixture(scope="module")
def workload():
    return Workload.make(SMALL)


@pytest.fixture(scope="module")
def runs(workload):
    return {name: run_one(SMALL, name, workload) for name in POLICIES}


@pytest.mark.parametrize("name", POLICIES)
def test_every_request_is_served_once_and_accounted(runs, workload, name):
    row, sim = runs[name]
    check_invariants(sim)  # also run inside run_one; here its failures get the test's name
    n = SMALL.requests
    assert sim.finished == n and sum(sim.served) == n
    counts = [sim.outcome.count(k) for k in (HIT, JOINED, MISS)]
    assert sum(counts) == n
    # Cold loads are exactly the misses, and each one put its adapter on that replica (or it was evicted since).
    assert row["cold_loads"] == sum(1 for o in sim.outcome[int(n * SMALL.warmup_frac) :] if o == MISS)
    assert 0 < row["load_mean"] <= 1 and row["load_max"] <= 1 + 1e-9
    assert row["load_max_over_mean"] >= 1
    assert 0 <= row["hit_rate"] <= 1
    assert row["queue_delay_ms_p99"] >= 0


@pytest.mark.parametrize("name", ["ours", "ray_multiplex"])
def test_cold_start_misses_every_first_touch(name):
    cfg = replace(SMALL, prefill=False, requests=1_500)
    row, sim = run_one(cfg, name, Workload.make(cfg))  # check_invariants checks each first touch missed
    assert row["hit_rate"] <= 1 - row["first_touch_frac"] + 1e-9
    assert row["cold_loads_per_s"] > row["avoidable_cold_loads_per_s"] > 0


def test_affinity_policies_hit_more_than_oblivious_ones():
    # At 60% utilization no holder is pushed off for load, so routing by adapter must pay off plainly.
    cfg = replace(SMALL, utilization=0.6)
    w = Workload.make(cfg)
    hit = {name: run_one(cfg, name, w)[0]["hit_rate"] for name in ("ours", "ray_multiplex", "random", "pow2")}
    for smart in ("ours", "ray_multiplex"):
        for dumb in ("random", "pow2"):
            assert hit[smart] > hit[dumb] + 0.2, hit


def test_ours_calls_app_router_placement(monkeypatch, workload):
    calls = {"rank": 0, "view": 0}
    real_rank, real_view = placement.rank_replicas, placement.view_from_stats

    def rank(*a, **k):
        calls["rank"] += 1
        return real_rank(*a, **k)

    def view(*a, **k):
        calls["view"] += 1
        return real_view(*a, **k)

    monkeypatch.setattr(placement, "rank_replicas", rank)
    monkeypatch.setattr(placement, "view_from_stats", view)
    cfg = replace(SMALL, requests=500)
    policy = OursPolicy()
    sim = Simulation(cfg, Workload.make(cfg), policy).run()
    check_invariants(sim)
    assert calls["rank"] >= policy.calls >= cfg.requests  # one ranking per routing attempt, at least
    assert calls["view"] > 0


@pytest.mark.parametrize("name", ["ours", "ours_hot", "ours_v1"])
def test_pruned_candidates_decide_exactly_like_the_full_call(name):
    """Ours passes rank_replicas a subset of replicas for speed; the full call must route identically."""
    # More replicas than one pruned candidate list, and full: requests wait for a free batch slot.
    cfg = replace(SMALL, replicas=48, utilization=1.3, requests=2_000)
    w = Workload.make(cfg)
    fast_row, fast = run_one(cfg, name, w)
    full_row, full = run_one(cfg, name, w, exact=True)
    assert fast.replica_of == full.replica_of
    assert fast.outcome == full.outcome
    assert fast.delay_s == full.delay_s
    assert full.policy.full_calls == full.policy.calls
    # Pruned calls decided most requests; the full call ran for the rest (all first tiers full).
    assert fast.policy.calls - fast.policy.full_calls > cfg.requests / 2
    assert fast_row["router_retries"] > 0  # the run reached saturation, where pruning is hardest


def test_hot_pins_spread_hot_adapters_and_never_evict_them(workload):
    pins = hot_pins(SMALL, workload)
    copies = {}
    for names in pins.values():
        assert len(names) == len(set(names))
        for a in names:
            copies[a] = copies.get(a, 0) + 1
    hottest = f"a{int(workload.adapter_of_rank[0])}"
    assert copies[hottest] >= 2 and copies[hottest] == max(copies.values())
    _, sim = run_one(SMALL, "ours_hot", workload)
    for r, names in pins.items():
        assert sim.pinned[r] == frozenset(names)


def test_cli_quick_writes_json_and_table(tmp_path, capsys):
    rc = sim.main(
        [
            "--replicas",
            "10",
            "--adapters",
            "500",
            "--requests",
            "600",
            "--alphas",
            "1.0",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "placement_sim.json").read_text())
    assert {r["policy"] for r in doc["rows"]} == set(POLICIES)
    assert (tmp_path / "placement_sim.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "ray_multiplex" in out and "issue 17 goals" in out


def test_real_check_replays_one_stream_and_reads_cold_loads():
    """load_tests/placement/real_check.py (the real 2-replica run is a benchmark, not a test): the stream it
    replays does not change when the measured service time does, and it sums loads + reloads per replica."""
    import argparse

    from load_tests.placement.real_check import cold_loads, stream_config

    a = argparse.Namespace(
        requests=300, adapters=40, alpha=1.0, rate=8.0, device_slots=4, host_slots=8, seed=0
    )
    w1 = Workload.make(stream_config(a, 1.0, 0.05))
    w2 = Workload.make(stream_config(a, 0.3, 0.02))
    assert w1.adapter == w2.adapter
    assert w1.arrival_s == pytest.approx(w2.arrival_s)
    assert len(w1.arrival_s) / w1.arrival_s[-1] == pytest.approx(8.0, rel=0.2)
    text = "\n".join(
        [
            "# TYPE loraland_adapter_loads counter",
            'loraland_adapter_loads_total{adapter="a",source="s3",replica="r1"} 3',
            'loraland_adapter_loads_total{adapter="b",source="disk",replica="r2"} 1',
            'loraland_adapter_reloads_total{adapter="a",replica="r1"} 2.0',
            'loraland_adapter_load_seconds_count{source="s3",replica="r1"} 3',
        ]
    )
    assert cold_loads(text) == {"r1": 5.0, "r2": 1.0}
