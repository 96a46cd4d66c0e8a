"""Placement at scale: a discrete-event simulator of R replicas x A adapters under zipf traffic.
Run: ./run bench sim [--help]. Method and results: load_tests/placement/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from app.router.routing.placement import PlacementPolicy
from load_tests.placement.sim_core import (
    HIT,
    JOINED,
    MISS,
    NO_HOLDER,
    SPILL,
    TO_HOLDER,
    SimConfig,
    Simulation,
    Workload,
)
from load_tests.placement.sim_ours import OursPolicy, hot_pins
from load_tests.placement.sim_policies import Pow2Policy, RandomPolicy, RayMultiplexPolicy

POLICIES = ("ours", "ours_hot", "ray_multiplex", "pow2", "random")
# Also (--policies): the placement policy before issue 17, for comparison.
MORE_POLICIES = ("ours_v1",)
V1_POLICY = PlacementPolicy(overload_load=0.9, balance=None)
RESULTS = Path(__file__).parent / "results"
GOAL_HIT, GOAL_BALANCE, GOAL_FEWER_COLD = 0.95, 1.2, 0.30


def make_policy(name: str, cfg: SimConfig, w: Workload, *, exact: bool = False):
    if name in ("ours", "ours_hot"):
        pins = hot_pins(cfg, w) if name == "ours_hot" else None
        return OursPolicy(exact=exact, pins=pins, name=name)
    if name == "ours_v1":
        return OursPolicy(V1_POLICY, exact=exact, name=name)
    if name == "ray_multiplex":
        return RayMultiplexPolicy()
    if name == "pow2":
        return Pow2Policy()
    if name == "random":
        return RandomPolicy()
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES + MORE_POLICIES)}")


def check_invariants(sim: Simulation) -> None:
    """Every request routed once, served and accounted; raise AssertionError naming what broke."""
    n = len(sim.w.arrival_s)
    assert min(sim.replica_of) >= 0, "a request was never routed"
    assert sim.finished == n == sum(sim.served), f"finished {sim.finished}, served {sum(sim.served)} of {n}"
    assert not any(sim.ongoing), "requests still counted on replicas after the run"
    assert not any(sim.loading), "adapter loads still under way after the run"
    counts = np.bincount(np.asarray(sim.outcome), minlength=3)
    assert counts.sum() == n and min(sim.outcome) >= 0, "an outcome is missing"
    if not sim.cfg.prefill:
        pinned = set().union(*sim.pinned)
        first = [i for i in np.flatnonzero(sim.w.first_touch).tolist() if sim.w.adapter[i] not in pinned]
        assert all(sim.outcome[i] == MISS for i in first), (
            "a first touch of an unpinned adapter was not a miss"
        )
    busy = sum(sim.delay_s) + sum(sim.w.service_s)  # each request occupies its replica from routing to done
    assert math.isclose(sum(sim.area), busy, rel_tol=1e-6), f"load integral {sum(sim.area)} != {busy}"
    for r in range(sim.cfg.replicas):
        assert len(sim.host[r]) + len(sim.pinned[r]) <= max(sim.cfg.host_slots, len(sim.pinned[r]) + 1)
        assert len(sim.device[r]) <= sim.cfg.device_slots


def summarize(sim: Simulation) -> dict:
    cfg, w = sim.cfg, sim.w
    warm = int(len(w.arrival_s) * cfg.warmup_frac)
    (t0, area0, served0), (t1, area1, served1) = sim.marks["warm"], sim.marks["end"]
    dur = t1 - t0
    out = np.asarray(sim.outcome[warm:])
    first_mask = w.first_touch[warm:]
    first = int(first_mask.sum())
    n = len(out)
    hits, joined, misses = (int((out == k).sum()) for k in (HIT, JOINED, MISS))
    later_misses = int((out[~first_mask] == MISS).sum())  # pinned adapters make some first touches hits
    why = np.asarray(sim.why[warm:])[out == MISS]
    load = (np.asarray(area1) - np.asarray(area0)) / dur / cfg.max_ongoing
    served = np.asarray(served1) - np.asarray(served0)
    delay_ms = np.asarray(sim.delay_s[warm:]) * 1000.0
    return {
        "requests": n,
        "window_s": dur,
        "hit_rate": (hits + joined) / n,
        "resident_hit_rate": hits / n,
        "hit_rate_excl_first_touch": 1 - later_misses / max(1, n - first),
        "first_touch_frac": first / n,
        "cold_loads": misses,
        "cold_loads_per_s": misses / dur,
        "avoidable_cold_loads_per_s": later_misses / dur,
        # Where the cold loads came from, for policies that know holders: the router's view was stale,
        # it passed over the holders (overloaded or full), or it knew of none.
        "cold_at_believed_holder_per_s": int((why == TO_HOLDER).sum()) / dur,
        "cold_spill_per_s": int((why == SPILL).sum()) / dur,
        "cold_no_holder_per_s": int((why == NO_HOLDER).sum()) / dur,
        "load_mean": float(load.mean()),
        "load_max": float(load.max()),
        "load_max_over_mean": float(load.max() / load.mean()),
        "load_p99_over_mean": float(np.percentile(load, 99) / load.mean()),
        "served_max_over_mean": float(served.max() / served.mean()),
        "queue_delay_ms_p50": float(np.percentile(delay_ms, 50)),
        "queue_delay_ms_p99": float(np.percentile(delay_ms, 99)),
        "queue_delay_ms_max": float(delay_ms.max()),
        "router_retries": sim.retries,
        "replica_loads": load.tolist(),
    }


def run_one(cfg: SimConfig, name: str, w: Workload, *, exact: bool = False) -> tuple[dict, Simulation]:
    policy = make_policy(name, cfg, w, exact=exact)
    t0 = time.perf_counter()
    sim = Simulation(cfg, w, policy).run()
    wall = time.perf_counter() - t0
    check_invariants(sim)
    row = {"policy": name, "alpha": cfg.alpha, "wall_s": wall, **summarize(sim)}
    if isinstance(policy, OursPolicy):
        row["rank_calls"], row["full_rank_calls"] = policy.calls, policy.full_calls
        row["full_rank_call_ms"] = 1000.0 * policy.full_call_cost_s(50)
        row["router_memory_adapters"] = len(policy.memory)  # adapters the router remembers at the end
    return row, sim


COLUMNS = [
    ("alpha", "alpha", "{:.1f}"),
    ("policy", "policy", "{}"),
    ("hit%", "hit_rate", "{:.1%}"),
    ("max/mean", "load_max_over_mean", "{:.2f}"),
    ("mean load", "load_mean", "{:.2f}"),
    ("cold/s", "cold_loads_per_s", "{:.1f}"),
    ("spill/s", "cold_spill_per_s", "{:.2f}"),
    ("stale/s", "cold_at_believed_holder_per_s", "{:.2f}"),
    ("p99 q ms", "queue_delay_ms_p99", "{:.0f}"),
    ("wall s", "wall_s", "{:.0f}"),
]
# Starting cold, first touches are misses for every policy: these say what the rest did.
COLD_START_COLUMNS = [
    ("hit% !1st", "hit_rate_excl_first_touch", "{:.1%}"),
    ("1st-touch%", "first_touch_frac", "{:.1%}"),
    ("avoidable/s", "avoidable_cold_loads_per_s", "{:.2f}"),
]


def table(rows: list[dict], *, cold_start: bool = False) -> str:
    cols = COLUMNS[:3] + COLD_START_COLUMNS + COLUMNS[3:] if cold_start else COLUMNS
    cells = [[h for h, _, _ in cols]] + [[f.format(r[k]) for _, k, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(wd) for c, wd in zip(line, widths)) for line in cells)


def goals(rows: list[dict], *, cold_start: bool = False, alpha: float = 1.0) -> list[str]:
    """The issue's figures at alpha = 1.0, each line saying met / NOT met with the numbers."""
    by = {r["policy"]: r for r in rows if r["alpha"] == alpha}
    ray = by.get("ray_multiplex")
    hit_key = "hit_rate_excl_first_touch" if cold_start else "hit_rate"
    cold_key = "avoidable_cold_loads_per_s" if cold_start else "cold_loads_per_s"
    lines = []
    for name, o in by.items():
        if not name.startswith("ours"):
            continue
        checks = [
            (f"{hit_key} {o[hit_key]:.1%} >= {GOAL_HIT:.0%}", o[hit_key] >= GOAL_HIT),
            (
                f"max/mean load {o['load_max_over_mean']:.2f} <= {GOAL_BALANCE}",
                o["load_max_over_mean"] <= GOAL_BALANCE,
            ),
        ]
        if ray is not None:
            change = o[cold_key] / max(1e-9, ray[cold_key]) - 1
            checks.append(
                (
                    f"{cold_key} {o[cold_key]:.2f} vs ray_multiplex {ray[cold_key]:.2f} ({change:+.0%}), "
                    f"needs <= -{GOAL_FEWER_COLD:.0%}",
                    change <= -GOAL_FEWER_COLD,
                )
            )
        lines.extend(f"  {name} @ alpha {alpha}: {text}: {'met' if ok else 'NOT met'}" for text, ok in checks)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m load_tests.placement.sim", description=__doc__.split("\n")[0]
    )
    d = SimConfig()
    ap.add_argument("--quick", action="store_true", help="50 replicas x 20,000 adapters x 20,000 requests")
    ap.add_argument("--replicas", type=int, default=d.replicas)
    ap.add_argument("--adapters", type=int, default=d.adapters)
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--alphas", default="0.8,1.0,1.2")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--utilization", type=float, default=d.utilization)
    ap.add_argument("--host-slots", type=int, default=d.host_slots)
    ap.add_argument("--device-slots", type=int, default=d.device_slots)
    ap.add_argument("--max-ongoing", type=int, default=d.max_ongoing)
    ap.add_argument("--service-s", type=float, default=d.service_s)
    ap.add_argument("--load-s", type=float, default=d.load_s)
    ap.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--cold-start",
        action="store_true",
        help="start with empty caches (default: each adapter on one replica)",
    )
    ap.add_argument("--exact", action="store_true", help="ours calls rank_replicas with every replica (slow)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.replicas, a.adapters, a.requests = 50, 20_000, 20_000
    base = SimConfig(
        replicas=a.replicas,
        adapters=a.adapters,
        requests=a.requests,
        utilization=a.utilization,
        host_slots=a.host_slots,
        device_slots=a.device_slots,
        max_ongoing=a.max_ongoing,
        service_s=a.service_s,
        load_s=a.load_s,
        warmup_frac=a.warmup_frac,
        seed=a.seed,
        prefill=not a.cold_start,
    )
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    rows = []
    for alpha in (float(x) for x in a.alphas.split(",")):
        cfg = replace(base, alpha=alpha)
        w = Workload.make(cfg)
        for name in policies:
            row, _ = run_one(cfg, name, w, exact=a.exact)
            rows.append(row)
            print(table([row], cold_start=a.cold_start).splitlines()[1], flush=True)
    print()
    print(
        f"{base.replicas} replicas x {base.adapters} adapters, {base.requests} requests, utilization "
        f"{base.utilization}, {base.replica_rate:.2f} req/s per replica, measured after the first "
        f"{base.warmup_frac:.0%}; {'empty caches at start' if a.cold_start else 'each adapter on one replica at start'}"
    )
    print(table(rows, cold_start=a.cold_start))
    lines = goals(rows, cold_start=a.cold_start)
    if lines:
        print("issue 17 goals:")
        print("\n".join(lines))
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"config": asdict(base), "alphas": a.alphas, "rows": rows}
    (a.out / "placement_sim.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out / 'placement_sim.json'}")
    if not a.no_plots:
        from load_tests.placement.sim_plots import plot

        print(f"wrote {plot(rows, a.out / 'placement_sim.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
