"""Metrics overhead on workload W (issue 14): output tok/s over HTTP with metrics on vs off.
Run: ./run bench metrics [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from load_tests.harness import client as cl
from load_tests.harness import stats
from load_tests.harness.adapters import build_named_adapters
from load_tests.harness.models import CACHE, bench_model
from load_tests.harness.workload import build_workload, parse_length, parse_popularity

RESULTS = Path(__file__).resolve().parent / "results"


class Stack:
    def __init__(self, n_adapters: int):
        import uvicorn

        from app.catalog.redis_server import free_port, start_redis
        from app.catalog.store import Catalog
        from app.config.app_config import AppConfig
        from app.replica.deployment import LocalBackend, ReplicaCore
        from app.replica.lora.peft_format import adapter_summary
        from app.router.http.auth import Authenticator
        from app.router.http.ingress import build_api
        from app.router.service import CatalogProxy, IngressService
        from loraland import LLMKernel

        model_dir = bench_model()
        store = CACHE / "bench-adapters" / "qv-r16"
        folders = build_named_adapters(
            model_dir, store, n_adapters, r=16, targets=("q_proj", "v_proj"), prefix="qv"
        )
        self.redis_url, self._stop_redis = start_redis()
        self.catalog = Catalog(self.redis_url)
        kernel_opts = {"max_adapters": 64, "max_batch_size": 64, "max_num_batched_tokens": 4096}
        self.cfg = AppConfig(model=str(model_dir), served_model_name="bench", redis_url=self.redis_url,
                             no_auth=True, kernel=kernel_opts)  # fmt: skip
        self.kernel = LLMKernel(model_dir, self.cfg.kernel)
        self.names = sorted(folders)[:n_adapters]
        for name in self.names:
            info = adapter_summary(folders[name])
            self.catalog.register(
                name, str(folders[name]), files=info["files"], size=info["size"], rank=info["rank"],
                alpha=info["alpha"], target_modules=info["target_modules"],
                base_model=self.kernel.model_config.identity(), public=True,
            )  # fmt: skip
        self.core = ReplicaCore(self.cfg, "bench-0", kernel=self.kernel, catalog=self.catalog)
        self.core.start()  # heartbeats; the metrics publisher is switched per pass below
        proxy = CatalogProxy(self.redis_url, self.catalog)
        self.api = build_api(
            IngressService(self.cfg, LocalBackend(self.core), proxy), Authenticator(proxy, None, no_auth=True)
        )
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.api, host="127.0.0.1", port=self.port, log_level="warning")
        )
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.05)

    def metrics(self, on: bool) -> None:
        from app import metrics
        from app.catalog.telemetry import Publisher
        from app.config.metrics_config import MetricsConfig

        if self.core._metrics is not None:
            self.core._metrics.stop()
            self.core._metrics = None
        metrics.configure(MetricsConfig(enabled=on))
        if on:
            self.core._metrics = Publisher(lambda: self.catalog, MetricsConfig().publish_s).start()

    def close(self) -> None:
        self.server.should_exit = True
        self.core.close()
        self.catalog.close()
        self._stop_redis()


def _scraper(base: str, period_s: float) -> subprocess.Popen:
    """Prometheus's part, as another process (as Prometheus is): GET /metrics every period_s."""
    code = (
        "import sys, time, urllib.request\n"
        "while True:\n"
        "    urllib.request.urlopen(sys.argv[1] + '/metrics', timeout=30).read()\n"
        "    time.sleep(float(sys.argv[2]))\n"
    )
    env = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    return subprocess.Popen([sys.executable, "-c", code, base, str(period_s)], env=env)


def one_pass(stack: Stack, a: argparse.Namespace, salt: str) -> float:
    specs = build_workload(
        base="bench", adapters=stack.names, popularity=parse_popularity("uniform"), num_requests=a.requests,
        prompt_len=parse_length(str(a.prompt_len)), output_len=parse_length(str(a.output_len)),
        seed=a.seed, prompt_salt=salt,
    )  # fmt: skip
    cfg = cl.ClientConfig(f"{stack.base}/v1", stream=True)
    records, duration = asyncio.run(cl.run_requests(cfg, specs, a.requests))
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error_kind} {failed[0].error_detail}")
    return stats.summarize(records, duration)["output_tokens_per_s"]


def costs(n: int = 20_000) -> dict[str, float]:
    """What metrics cost in CPU, measured directly (immune to a busy machine's drift between passes): one
    request's records at the ingress (caller, model, outcome, tokens, TTFT, TPOT, e2e; 50 adapters x 10 tenants
    in the registry), one snapshot (JSON, as published), one cluster /metrics answer over 3 processes."""
    from types import SimpleNamespace

    from app import metrics
    from app.config.metrics_config import MetricsConfig
    from app.protocol import ChoiceDelta
    from app.router.http.metrics import RequestObserver, exposition

    metrics.configure(MetricsConfig())
    specs = [SimpleNamespace(stages=((1,),), canonical=lambda i=i: f"micro{i}@1") for i in range(50)]
    callers = [SimpleNamespace(tenant=f"tenant{i}") for i in range(10)]
    stream = SimpleNamespace(
        choices={0: ChoiceDelta(0, "x", "length", 128, 64)}, first_delta_at=time.monotonic()
    )
    t0 = time.perf_counter()
    for i in range(n):
        obs = RequestObserver()
        obs.caller(callers[i % 10])
        obs.resolved(specs[i % 50])
        obs.finish(200, stream, 1)
    per_request = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(50):
        snap = json.loads(json.dumps(metrics.snapshot()))
    per_snapshot = (time.perf_counter() - t0) / 50
    t0 = time.perf_counter()
    for _ in range(50):
        exposition([snap, snap, snap])
    per_scrape = (time.perf_counter() - t0) / 50
    return {"request_us": per_request * 1e6, "snapshot_ms": per_snapshot * 1e3, "scrape_ms": per_scrape * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m load_tests.serving.bench_metrics", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pairs", type=int, default=3, help="ON/OFF pass pairs (default 3)")
    ap.add_argument("--adapters", type=int, default=10)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scrape-s", type=float, default=5.0, help="scrape interval (the shipped config's: 5)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_metrics.json")
    ap.add_argument(
        "--costs-only", action="store_true", help="only the direct CPU costs (seconds, not minutes)"
    )
    a = ap.parse_args(argv)
    cost = costs()
    print(
        f"metrics CPU cost: {cost['request_us']:.1f} us per request, {cost['snapshot_ms']:.2f} ms per snapshot, "
        f"{cost['scrape_ms']:.2f} ms per /metrics of 3 processes",
        flush=True,
    )
    if a.costs_only:
        return 0
    stack = Stack(a.adapters)
    runs: dict[str, list[float]] = {"on": [], "off": []}
    try:
        stack.metrics(True)
        print(f"warm-up: {one_pass(stack, a, 'warmup'):.1f} output tok/s", flush=True)
        for i in range(a.pairs):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):  # ABBA: no order bias
                stack.metrics(mode == "on")
                scraper = _scraper(stack.base, a.scrape_s) if mode == "on" else None
                tps = one_pass(stack, a, f"{i}-{mode}")
                if scraper is not None:
                    scraper.terminate()
                    scraper.wait(timeout=10)
                runs[mode].append(tps)
                print(f"pass {i} metrics {mode:>3}: {tps:.1f} output tok/s", flush=True)
    finally:
        stack.close()
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    # Each pair ran back to back: its ratio cancels most of a busy machine's drift; the median of them is the
    # number to read when passes differ a lot.
    pair_ratios = [x / y for x, y in zip(runs["on"], runs["off"])]
    # The same costs as a share of one OFF pass's wall time, as if none of it overlapped the engine's work (an
    # upper bound): its requests' records, a snapshot every publish_s, a scrape every scrape_s.
    wall = a.requests * a.output_len / off
    spent = a.requests * cost["request_us"] / 1e6 + (wall / 2.0) * cost["snapshot_ms"] / 1e3
    spent += (wall / a.scrape_s) * cost["scrape_ms"] / 1e3
    result = {"workload": vars(a) | {"out": str(a.out)}, "passes": runs, "median_on": on, "median_off": off,
              "ratio_on_off": on / off, "pair_ratios": pair_ratios,
              "median_pair_ratio": statistics.median(pair_ratios), "costs": cost, "cost_bound_ratio": 1 - spent / wall}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(f"metrics on / off: {on:.1f} / {off:.1f} output tok/s = {on / off:.3f} (median of {a.pairs} each)")
    print(
        f"pairs on/off: {', '.join(f'{r:.3f}' for r in pair_ratios)}; median {statistics.median(pair_ratios):.3f}"
    )
    print(f"bound from the direct costs: >= {1 - spent / wall:.4f} of the throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
