"""Cold adapters over HTTP: P5, the extra TTFT of an adapter only in S3, and the TPOT others see meanwhile.
Run: ./run bench cold [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from load_tests.harness import client as cl
from load_tests.harness.adapters import ALL_SEVEN, build_bench_adapters
from load_tests.harness.models import CACHE, bench_model
from load_tests.harness.servers import loraland_serve, moto_s3
from load_tests.harness.stats import distribution, percentile
from load_tests.harness.workload import RequestSpec, make_prompt

BUCKET = "loraland-bench"


@dataclass
class Window:
    """A stretch of the run (seconds on the client's perf_counter) and what it was."""

    kind: str  # quiet | warm_burst | cold_burst
    start: float
    end: float


@dataclass
class Background:
    """Finished background requests, with absolute token times."""

    records: list[tuple[float, cl.RequestRecord]] = field(
        default_factory=list
    )  # (absolute send time, record)

    def token_times(self) -> list[list[float]]:
        return [[t0 + t for t in rec.chunk_times] for t0, rec in self.records if rec.ok]


def window_stats(streams: list[list[float]], windows: list[Window]) -> dict[str, dict]:
    """Per window kind: the gaps between consecutive tokens of one stream that end inside a window of that kind
    (ITL), and the TPOT of every stream whose decode overlaps such a window. Latencies in ms."""
    out: dict[str, dict] = {}
    for kind in sorted({w.kind for w in windows}):
        ws = [w for w in windows if w.kind == kind]
        gaps, tpots = [], []
        for ts in streams:
            if len(ts) < 2:
                continue
            if any(ts[0] < w.end and ts[-1] > w.start for w in ws):
                tpots.append((ts[-1] - ts[0]) / (len(ts) - 1))
            gaps += [b - a for a, b in zip(ts, ts[1:]) if any(w.start <= b <= w.end for w in ws)]
        out[kind] = {
            "seconds": sum(w.end - w.start for w in ws),
            "itl_ms": distribution(gaps),
            "tpot_ms": distribution(tpots),
        }
    return out


def change_pct(stats: dict[str, dict], base: str, other: str, metric: str = "tpot_ms", q: str = "p99"):
    b, o = stats.get(base, {}).get(metric, {}).get(q), stats.get(other, {}).get(metric, {}).get(q)
    return None if not b or o is None else (o / b - 1.0) * 100.0


LOAD_LINE = re.compile(r"loaded adapter (\S+) from (\S+) in ([0-9.]+)s")


def load_times(log: Path) -> dict[str, float]:
    """ref -> seconds the replica took to fetch + install it, from its log lines."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {m[1]: float(m[3]) for m in LOAD_LINE.finditer(text)}


# ---------------------------------------------------------------------------------------------- the run
def push_adapters(redis_url: str, model_dir: Path, dirs: dict[str, Path], env: dict) -> None:
    import boto3

    from app.cli import main as cli

    os.environ.update(env)  # the uploads below read AWS_* as the server does
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    for name, d in dirs.items():
        argv = ["--redis", redis_url, "adapters", "push", name, str(d), "--to", f"s3://{BUCKET}/{name}"]
        if cli([*argv, "--model", str(model_dir), "--no-progress"]) != 0:
            raise RuntimeError(f"pushing {name} failed")


async def one(c: httpx.AsyncClient, cfg: cl.ClientConfig, model: str, prompt, max_tokens: int, idx=0):
    spec = RequestSpec(idx, model, prompt, len(prompt.split()), max_tokens, None)
    rec = await cl.send_one(c, cfg, spec, time.perf_counter())
    if not rec.ok:
        raise RuntimeError(f"request on {model} failed: {rec.error_kind} {rec.error_detail}")
    return rec


async def measure(a, base_url: str, cold: list[str], warm: list[str], log: Path) -> dict:
    cfg = cl.ClientConfig(base_url=f"{base_url}/v1", timeout=300)
    rng = random.Random(a.seed)

    def prompt() -> str:
        return make_prompt(rng, a.prompt_len, "text")

    async with cl.make_client(cfg, None) as c:
        for m in ["base", *warm]:  # warm-up: the engine's first steps, the background adapters resident
            await one(c, cfg, m, prompt(), 4)
        first = cold.pop(0)
        t = await one(c, cfg, first, prompt(), 4)
        first_of_shape = {"adapter": first, "ttft_ms": t.ttft * 1000}
        probes, cold = cold[: a.probes], cold[a.probes :]
        p5 = []
        for name in probes:
            c1 = await one(c, cfg, name, prompt(), 4)
            w1 = await one(c, cfg, name, prompt(), 4)
            p5.append({"adapter": name, "cold_ttft_ms": c1.ttft * 1000, "warm_ttft_ms": w1.ttft * 1000})
        base_ttft = [(await one(c, cfg, "base", prompt(), 4)).ttft * 1000 for _ in range(3)]

        # ---- interference
        bg, stop, windows = Background(), asyncio.Event(), []

        async def worker(i: int) -> None:
            k = i
            while not stop.is_set():
                t0 = time.perf_counter()
                spec = RequestSpec(k, warm[k % len(warm)], prompt(), a.prompt_len, a.output_len, None)
                rec = await cl.send_one(c, cfg, spec, t0)
                bg.records.append((t0, rec))
                k += a.background

        async def burst(kind: str, names: list[str]) -> None:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(c, cfg, n, prompt(), a.burst_tokens) for n in names))
            windows.append(Window(kind, t0, time.perf_counter()))

        workers = [asyncio.create_task(worker(i)) for i in range(a.background)]
        await asyncio.sleep(a.settle_s)  # let the loop reach steady state before any window
        for r in range(a.rounds):
            t0 = time.perf_counter()
            await asyncio.sleep(a.quiet_s)
            windows.append(Window("quiet", t0, time.perf_counter()))
            await burst("warm_burst", [probes[(r * a.burst + i) % len(probes)] for i in range(a.burst)])
            await asyncio.sleep(a.gap_s)
            names, cold = cold[: a.burst], cold[a.burst :]
            await burst("cold_burst", names)
            await asyncio.sleep(a.gap_s)
        stop.set()
        await asyncio.gather(*workers)

    streams = bg.token_times()
    win = window_stats(streams, windows)
    failed = sum(1 for _, r in bg.records if not r.ok)
    extra = [p["cold_ttft_ms"] - p["warm_ttft_ms"] for p in p5]
    loads = load_times(log)
    return {
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        "first_of_shape": first_of_shape,
        "p5": {
            "probes": p5,
            "extra_ttft_ms": distribution([x / 1000 for x in extra]),
            "base_ttft_ms_median": sorted(base_ttft)[1],
            "replica_load_s": {k: v for k, v in loads.items() if k.split("@")[0] in probes},
        },
        "interference": {
            "windows": win,
            "background_requests": len(bg.records),
            "background_failed": failed,
            "tpot_p99_cold_vs_warm_pct": change_pct(win, "warm_burst", "cold_burst"),
            "tpot_p99_cold_vs_quiet_pct": change_pct(win, "quiet", "cold_burst"),
            "itl_p99_cold_vs_warm_pct": change_pct(win, "warm_burst", "cold_burst", "itl_ms"),
        },
    }


def report(r: dict) -> str:
    p5, it = r["p5"], r["interference"]
    e = p5["extra_ttft_ms"]
    lines = [
        f"cold adapter: rank {r['config']['rank']} x 7 modules, {r['config']['adapter_mb']:.1f} MB, from S3 (moto, loopback)",
        f"P5 extra TTFT cold - warm: median {percentile([p['cold_ttft_ms'] - p['warm_ttft_ms'] for p in p5['probes']], 50):.1f} ms,"
        f" max {e['max']:.1f} ms over {e['count']} adapters (target <= 50 ms); warm TTFT median "
        f"{percentile([p['warm_ttft_ms'] for p in p5['probes']], 50):.1f} ms, base {p5['base_ttft_ms_median']:.1f} ms",
        f"first adapter of its shape (pool created): TTFT {r['first_of_shape']['ttft_ms']:.1f} ms",
    ]
    if p5["replica_load_s"]:
        ms = sorted(v * 1000 for v in p5["replica_load_s"].values())
        lines.append(
            f"replica-side fetch+install (its log): median {percentile(ms, 50):.1f} ms, max {ms[-1]:.1f} ms"
        )
    lines.append(f"background: {it['background_requests']} requests, {it['background_failed']} failed")
    lines.append(f"{'window':<12}{'seconds':>8}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p50':>9}{'ITL p99':>9}")
    for kind in ("quiet", "warm_burst", "cold_burst"):
        w = it["windows"].get(kind)
        if w:
            t, i = w["tpot_ms"], w["itl_ms"]
            lines.append(
                f"{kind:<12}{w['seconds']:>8.1f}{t['p50'] or 0:>10.1f}{t['p99'] or 0:>10.1f}{i['p50'] or 0:>9.1f}{i['p99'] or 0:>9.1f}"
            )

    def pct(x):
        return "n/a" if x is None else f"{x:+.1f}%"

    lines.append(
        f"p99 TPOT during ten cold loads vs the same burst warm: {pct(it['tpot_p99_cold_vs_warm_pct'])} "
        f"(target <= +10%); vs quiet: {pct(it['tpot_p99_cold_vs_quiet_pct'])}; p99 ITL cold vs warm: "
        f"{pct(it['itl_p99_cold_vs_warm_pct'])}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=24, help="cold adapters' rank, all seven modules")
    ap.add_argument("--probes", type=int, default=5, help="adapters measured for P5")
    ap.add_argument("--burst", type=int, default=10, help="cold loads at once per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--background", type=int, default=16, help="background streams in flight")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64, help="background requests' output tokens")
    ap.add_argument("--burst-tokens", type=int, default=8, help="output tokens of each burst request")
    ap.add_argument("--quiet-s", type=float, default=4.0)
    ap.add_argument("--gap-s", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("load_tests/serving/results"))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)

    from app.catalog.redis_server import start_redis

    model_dir = bench_model()
    n_cold = 1 + a.probes + a.rounds * a.burst
    cold = build_bench_adapters(
        model_dir, CACHE / "bench-adapters" / f"all7-r{a.rank}", n_cold, a.rank, ALL_SEVEN, prefix="cold"
    )
    warm = build_bench_adapters(model_dir, CACHE / "bench-adapters" / "qv-r16", 8, 16, prefix="qv")
    a.adapter_mb = (cold[0] / "adapter_model.safetensors").stat().st_size / 1e6
    dirs = {d.name: d for d in [*cold, *warm]}
    redis_url, stop_redis = start_redis()
    try:
        with moto_s3(a.out / "moto.log") as aws:
            push_adapters(redis_url, model_dir, dirs, aws)
            log = a.out / "serve_cold.log"
            env = {**aws, "LORALAND_CACHE_DIR": str(a.out / f"cache-{os.getpid()}")}
            args = ["--redis", redis_url, "--max-adapters", "64", "--max-batch-size", "64"]
            with loraland_serve(model_dir, log, *args, env=env) as url:
                r = asyncio.run(measure(a, url, [d.name for d in cold], [d.name for d in warm], log))
    finally:
        stop_redis()
    (a.out / "cold.json").write_text(json.dumps(r, indent=2))
    print(report(r))
    print(f"wrote {a.out / 'cold.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
