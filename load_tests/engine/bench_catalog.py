"""The Redis catalog with 100k adapters: per-call latency of placement lookup, registration, get, heartbeat.
Run: ./run bench catalog [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
import uuid

from app.catalog.redis_server import start_redis
from app.catalog.store import Catalog
from app.protocol import ReplicaStats
from load_tests.harness.stats import percentile

SHA = "ab" * 32


def entry(i: int) -> dict:
    return dict(
        name=f"org{i % 997}/adapter-{i}",
        uri=f"s3://bench-bucket/adapters/{i}/v1",
        files={"adapter_config.json": SHA, "adapter_model.safetensors": SHA},
        size=16 << 20,
        rank=random.choice((8, 16, 32, 64)),
        alpha=16.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        base_model={"architecture": "LlamaForCausalLM", "hidden_size": 2048, "num_layers": 22},
    )


def heartbeat(cat: Catalog, rid: int, held: list[str]) -> None:
    """One replica's heartbeat with `held` resident (the other fields fixed: only the set's size matters here)."""
    stats = ReplicaStats(f"replica-{rid}", resident=tuple(held), free_slots=8, queue_len=2, kv_usage=0.4)
    cat.heartbeat(stats, load=0.5, ttl_s=600)


def timed(fn, args_list) -> list[float]:
    out = []
    for args in args_list:
        t = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=100_000)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--resident", type=int, default=500, help="adapters each replica reports holding")
    ap.add_argument("--samples", type=int, default=5000)
    ap.add_argument("--redis", help="an existing Redis (a fresh namespace is used); default: start one")
    args = ap.parse_args()
    random.seed(0)
    stop = None
    url = args.redis
    if url is None:
        url, stop = start_redis()
    cat = Catalog(url, namespace=f"bench-{uuid.uuid4().hex[:8]}")
    try:
        t = time.perf_counter()
        cat.register_many((entry(i) for i in range(args.adapters)), batch=2000)
        bulk_s = time.perf_counter() - t
        names = [f"org{i % 997}/adapter-{i}" for i in range(args.adapters)]
        # Zipf-like residency: popular adapters sit on many replicas, the tail on few.
        cum = list(itertools.accumulate(1.0 / (r + 1) for r in range(args.adapters)))
        resident = {}
        for rid in range(args.replicas):
            held = set(random.choices(names, cum_weights=cum, k=args.resident))
            resident[rid] = sorted(held)
            heartbeat(cat, rid, sorted(held))
        popular = random.choices(names, cum_weights=cum, k=args.samples)
        uniform = random.choices(names, k=args.samples)
        n_reg = max(1, args.samples // 2)
        swaps = {k: random.choices(names, cum_weights=cum, k=2000) for k in range(args.replicas)}

        def beat(rid: int, changed: int) -> None:
            held = resident[rid]
            if changed:  # a replica loads a few adapters and evicts as many
                held = sorted(set(held[changed:]) | set(random.sample(swaps[rid], changed)))
                resident[rid] = held
            heartbeat(cat, rid, held)

        results = {
            "placement(adapter), zipf adapters": timed(cat.placement, [(a,) for a in popular]),
            "placement(adapter), uniform adapters": timed(cat.placement, [(a,) for a in uniform]),
            "get(name)": timed(cat.get, [(a,) for a in uniform]),
            "register() new version": timed(
                lambda i: cat.register(**entry(i)), [(random.randrange(args.adapters),) for _ in range(n_reg)]
            ),
            "register() new name": timed(
                lambda i: cat.register(**entry(i)), [(args.adapters + i,) for i in range(n_reg)]
            ),
            f"heartbeat({args.resident} resident, unchanged)": timed(
                beat, [(i % args.replicas, 0) for i in range(500)]
            ),
            f"heartbeat({args.resident} resident, 5% changed)": timed(
                beat, [(i % args.replicas, args.resident // 20) for i in range(500)]
            ),
        }
        info = cat._r.info("memory")
        server = cat._r.info("server")["redis_version"]
        print(f"catalog benchmark: {args.adapters} adapters, {args.replicas} replicas x {args.resident} resident, "
              f"redis {server} on {url.split('@')[-1]}")  # fmt: skip
        print(
            f"bulk registration (pipelined, 2000/batch): {bulk_s:.1f} s = {args.adapters / bulk_s:,.0f} adapters/s"
        )
        print(f"redis used_memory: {info['used_memory_human']}")
        print(f"{'operation':40s} {'n':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'mean ms':>8s}")
        for label, samples in results.items():
            ms = [s * 1000 for s in samples]
            p50, p99, mean = percentile(ms, 50), percentile(ms, 99), statistics.fmean(ms)
            print(f"{label:40s} {len(samples):6d} {p50:8.3f} {p99:8.3f} {mean:8.3f}")
    finally:
        cat.close()
        if stop is not None:
            stop()


if __name__ == "__main__":
    main()
