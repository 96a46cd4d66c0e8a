"""The placement simulator's replica model against a real 2-replica stack, on one request stream.
Run: ./run bench real_check [--help]. Method and results: load_tests/placement/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from load_tests.placement.sim import RESULTS, run_one
from load_tests.placement.sim_core import MISS, SimConfig, Workload

MAX_ONGOING = 48  # LocalStack's max_ongoing_requests
STATS_PERIOD_S = 0.5  # LocalStack's routing_stats_period_s
NOMINAL_SERVICE_S = 1.0  # only fixes the arrival rate of the stream before the real run measures service


def stream_config(a: argparse.Namespace, service_s: float, load_s: float) -> SimConfig:
    """The simulator's config for the real run: its arrival rate stays `a.rate` whatever `service_s` is."""
    return SimConfig(
        replicas=2,
        adapters=a.adapters,
        alpha=a.alpha,
        requests=a.requests,
        warmup_frac=0.0,
        utilization=a.rate * service_s / (2 * MAX_ONGOING),
        max_ongoing=MAX_ONGOING,
        device_slots=a.device_slots,
        host_slots=a.host_slots,
        service_s=service_s,
        load_s=load_s,
        prefill=False,  # the stack starts with empty caches
        stats_period_s=STATS_PERIOD_S,
        seed=a.seed,
    )


_COUNTER = re.compile(r"^loraland_adapter_(?:loads|reloads)(?:_total)?\{([^}]*)\}\s+([0-9.eE+-]+)$")


def cold_loads(metrics_text: str) -> dict[str, float]:
    """Replica id -> adapter loads + reloads in a /metrics scrape."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _COUNTER.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            rid = labels.get("replica", "?")
            out[rid] = out.get(rid, 0.0) + float(m.group(2))
    return out


async def replay(stack, w: Workload, max_tokens: int, timeout_s: float) -> list[dict]:
    """Send each request at its arrival time (non-streaming); record replica, status and latency."""
    import httpx

    headers = {"Authorization": f"Bearer {stack.api_key}"}
    names = {a: f"ad{int(a[1:]):02d}" for a in set(w.adapter)}
    out: list[dict] = [{} for _ in w.adapter]
    async with httpx.AsyncClient(base_url=stack.base, timeout=timeout_s) as client:

        async def one(i: int) -> None:
            body = {"model": names[w.adapter[i]], "prompt": f"request {i}:", "max_tokens": max_tokens,
                    "temperature": 0}  # fmt: skip
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json=body, headers=headers)
                out[i] = {"status": r.status_code, "replica": r.headers.get("x-loraland-replica", ""),
                          "latency_s": time.perf_counter() - t0}  # fmt: skip
            except httpx.HTTPError as e:
                out[i] = {"status": 0, "replica": "", "error": type(e).__name__}

        start = time.perf_counter()
        tasks = []
        for i, t in enumerate(w.arrival_s):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
    return out


def scrape(stack) -> str:
    import httpx

    from load_tests.harness.local_stack import ADMIN

    r = httpx.get(stack.base + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    r.raise_for_status()
    return r.text


def real_run(a: argparse.Namespace, w: Workload) -> dict:
    from load_tests.harness.local_stack import LocalStack, StackConfig, require_offline

    require_offline()
    cfg = StackConfig(replicas=2, adapters=a.adapters, cold=0, max_adapters=a.device_slots,
                      max_cpu_adapters=a.host_slots, max_tokens=a.max_tokens)  # fmt: skip
    with LocalStack(cfg) as stack:
        publish_wait = 5.0  # metrics snapshots reach the catalog every 2 s (MetricsConfig.publish_s)
        time.sleep(publish_wait)
        before = cold_loads(scrape(stack))
        t0 = time.perf_counter()
        recs = asyncio.run(replay(stack, w, a.max_tokens, timeout_s=120))
        wall = time.perf_counter() - t0
        time.sleep(publish_wait)
        after = cold_loads(scrape(stack))
        load_s = _mean_load_s(scrape(stack))
    ok = [r for r in recs if r.get("status") == 200]
    loads = {rid: after.get(rid, 0.0) - before.get(rid, 0.0) for rid in after}
    served: dict[str, int] = {}
    for r in ok:
        served[r["replica"]] = served.get(r["replica"], 0) + 1
    n, cold = len(recs), sum(loads.values())
    return {
        "requests": n,
        "ok": len(ok),
        "wall_s": wall,
        "hit_rate": 1 - cold / n,
        "cold_loads": cold,
        "cold_loads_by_replica": dict(sorted(loads.items(), key=lambda kv: -kv[1])),
        "served_by_replica": served,
        "served_shares": sorted((c / len(ok) for c in served.values()), reverse=True),
        "latency_s_mean": statistics.fmean(r["latency_s"] for r in ok),
        "load_s_mean": load_s,
    }


def _mean_load_s(metrics_text: str) -> float | None:
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("loraland_adapter_load_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("loraland_adapter_load_seconds_count"):
            count += float(line.split()[-1])
    return total / count if count else None


def sim_run(cfg: SimConfig, w: Workload) -> dict:
    row, sim = run_one(cfg, "ours", w)
    n = sum(sim.served)
    misses = [0] * cfg.replicas
    for r, outcome in zip(sim.replica_of, sim.outcome):
        misses[r] += outcome == MISS
    return {
        "requests": row["requests"],
        "hit_rate": row["hit_rate"],
        "cold_loads": row["cold_loads"],
        "cold_loads_by_replica": sorted(misses, reverse=True),
        "served_shares": sorted((s / n for s in sim.served), reverse=True),
        "load_max_over_mean": row["load_max_over_mean"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m load_tests.placement.real_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--adapters", type=int, default=40)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second")
    ap.add_argument("--device-slots", type=int, default=4)
    ap.add_argument("--host-slots", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "placement_real_check.json")
    a = ap.parse_args(argv)
    nominal = stream_config(a, NOMINAL_SERVICE_S, 0.05)
    w = Workload.make(nominal)
    print(
        f"{a.requests} requests at {a.rate}/s over {len({*w.adapter})} of {a.adapters} adapters (zipf {a.alpha})"
    )
    real = real_run(a, w)
    print("real:", json.dumps({k: v for k, v in real.items()}, indent=1), flush=True)
    cfg = stream_config(a, real["latency_s_mean"], real["load_s_mean"] or 0.05)
    w_sim = Workload.make(cfg)
    assert w_sim.adapter == w.adapter  # the same stream: adapters drawn before arrivals and service times
    sim = sim_run(cfg, w_sim)
    print("sim: ", json.dumps(sim, indent=1))
    diff_hit = abs(sim["hit_rate"] - real["hit_rate"]) / max(1e-9, real["hit_rate"])
    diff_share = abs(sim["served_shares"][0] - real["served_shares"][0]) / max(1e-9, real["served_shares"][0])
    verdict = {
        "hit_rate_rel_diff": diff_hit,
        "busiest_replica_share_rel_diff": diff_share,
        "within_10pct": diff_hit <= 0.10 and diff_share <= 0.10,
    }
    print("check:", json.dumps(verdict))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "sim_config": asdict(cfg), "real": real,
                                 "sim": sim, **verdict}, indent=1))  # fmt: skip
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
