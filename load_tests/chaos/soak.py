"""Soak: N mixed requests against 2 replicas, every answer checked, and the resources a leak would grow.
Run: ./run bench soak [--help]. Method and results: load_tests/chaos/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx

from load_tests.chaos.chaos import (
    PROMPTS,
    ChaosConfig,
    Req,
    composite_models,
    request_mix,
    send,
    warm_references,
)
from load_tests.harness.local_stack import LocalStack, StackConfig, require_offline


def redis_keys(stack: LocalStack) -> dict[str, int]:
    """Keys by kind: the first two ':' parts ('loraland:adapter', 'loraland:replica', ...)."""
    import redis

    r = redis.Redis.from_url(stack.redis.url)
    kinds: Counter = Counter()
    for key in r.scan_iter(count=1000):
        kinds[":".join(key.decode(errors="replace").split(":")[:2])] += 1
    r.close()
    return dict(sorted(kinds.items()))


def snapshot(stack: LocalStack) -> dict:
    replicas = stack.catalog.replicas()
    return {
        "replicas": {str(pid): v for pid, v in stack.replica_resources().items()},
        "kv_usage": {rid: info.kv_usage for rid, info in replicas.items()},
        "running": {rid: info.extra.get("running") for rid, info in replicas.items()},
        "redis_keys": redis_keys(stack),
    }


def wait_idle(stack: LocalStack, timeout_s: float = 60.0) -> float:
    """Until every replica's heartbeat shows no running or queued request and no KV block in use."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        infos = stack.catalog.replicas().values()
        if infos and all(i.kv_usage == 0 and not i.extra.get("running") and not i.queue_len for i in infos):
            time.sleep(2 * stack.cfg.heartbeat_s)  # one more heartbeat period, so the numbers are fresh
            return time.monotonic() - t0
        time.sleep(0.25)
    return float("inf")


async def drive(
    stack: LocalStack, reqs: list[Req], concurrency: int, timeout_s: float
) -> tuple[Counter, list]:
    outcomes: Counter = Counter()
    notes: Counter = Counter()
    latencies: list[float] = []
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=stack.base, timeout=timeout_s, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                req = queue.get_nowait()
                t0 = time.perf_counter()
                outcome, note = await send(client, stack, req, timeout_s)
                latencies.append(time.perf_counter() - t0)
                outcomes[outcome] += 1
                if note:
                    notes[f"{outcome}:{note}"] += 1
                done = sum(outcomes.values())
                if done % 500 == 0:
                    print(f"  {done}/{len(reqs)} {dict(outcomes)}", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes + Counter({f"note {k}": v for k, v in notes.items()}), latencies


def run_soak(stack: LocalStack, n: int, concurrency: int, warmup: int = 200, seed: int = 0) -> dict:
    rng = random.Random(seed)
    cfg = ChaosConfig(concurrency=concurrency, seed=seed)
    warm_references(stack, faults=())
    every = [*stack.warm, "tiny-llama", *composite_models(stack)]
    warm_reqs = [Req(m, PROMPTS[0], None, False, False, stack.cfg.max_tokens) for m in every]
    warm_reqs += [request_mix(stack, cfg, rng) for _ in range(max(0, warmup - len(warm_reqs)))]
    asyncio.run(drive(stack, warm_reqs, concurrency, 120.0))
    idle_before = wait_idle(stack)
    before = snapshot(stack)
    t0 = time.monotonic()
    outcomes, latencies = asyncio.run(
        drive(stack, [request_mix(stack, cfg, rng) for _ in range(n)], concurrency, 120.0)
    )
    elapsed = time.monotonic() - t0
    idle_after = wait_idle(stack)
    after = snapshot(stack)
    lat = sorted(latencies)
    return {
        "requests": n,
        "concurrency": concurrency,
        "seconds": round(elapsed, 1),
        "req_per_s": round(n / elapsed, 2),
        "latency_p50_s": round(statistics.median(lat), 3),
        "latency_p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3),
        "outcomes": dict(outcomes),
        "idle_wait_s": [round(idle_before, 1), round(idle_after, 1)],
        "before": before,
        "after": after,
    }


def report(result: dict) -> str:
    o = result["outcomes"]
    lines = [
        f"soak: {result['requests']} requests at concurrency {result['concurrency']} in {result['seconds']} s "
        f"({result['req_per_s']} req/s, p50 {result['latency_p50_s']} s, p99 {result['latency_p99_s']} s)",
        f"  ok {o.get('ok', 0)}  wrong {o.get('wrong', 0)}  lost {o.get('lost', 0)}  clean-error "
        f"{o.get('clean', 0)}  abandoned {o.get('abandoned', 0)}",
    ]
    lines += [f"  {k}: {v}" for k, v in o.items() if k.startswith("note ")]
    b, a = result["before"], result["after"]
    for pid in sorted(set(b["replicas"]) | set(a["replicas"])):
        rb, ra = b["replicas"].get(pid), a["replicas"].get(pid)
        if rb and ra:
            lines.append(f"  replica pid {pid}: RSS {rb['rss_mib']:.0f} -> {ra['rss_mib']:.0f} MiB "
                         f"({ra['rss_mib'] - rb['rss_mib']:+.0f}), fds {rb['fds']} -> {ra['fds']}")  # fmt: skip
        else:
            lines.append(f"  replica pid {pid}: {'gone' if rb else 'new'} during the soak")
    lines.append(f"  KV usage before {b['kv_usage']} after {a['kv_usage']}")
    lines.append(f"  Redis keys before {b['redis_keys']}\n             after  {a['redis_keys']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    require_offline()
    with LocalStack(StackConfig()) as stack:
        result = run_soak(stack, args.requests, args.concurrency, args.warmup, args.seed)
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    o = result["outcomes"]
    return 0 if not o.get("wrong") and not o.get("lost") else 1


if __name__ == "__main__":
    raise SystemExit(main())
