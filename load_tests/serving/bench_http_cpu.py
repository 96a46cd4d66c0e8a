"""Where the CPU goes when workload W is served over HTTP, per process; with --adapters N also P7
(HTTP / engine-direct output tok/s).
Run: ./run bench http_cpu [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from load_tests.harness.adapters import bench_assets
from load_tests.harness.servers import loraland_serve
from load_tests.harness.workload import WORKLOAD_W_ARGS


def role(p: psutil.Process) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "gone"
    for key, name in (
        ("LoraReplica", "replica"),
        ("Ingress", "ingress"),
        ("ProxyActor", "serve proxy"),
        ("ServeController", "serve controller"),
        ("raylet", "raylet"),
        ("gcs_server", "gcs"),
        ("app.cli", "loraland serve (driver)"),
    ):
        if key in cmd:
            return name
    return "other ray/" + (p.name() or "?")


def cpu_by_role(root: psutil.Process) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    procs = [root, *root.children(recursive=True)]
    for p in psutil.process_iter():  # Ray's daemons are not always the driver's descendants
        try:
            if "ray" in " ".join(p.cmdline()) and p not in procs:
                procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            t = p.cpu_times()
            out[role(p)] += t.user + t.system
        except psutil.Error:
            pass
    return out


def engine_direct(n: int) -> float:
    """W's output tok/s in-process (bench_lora's measurement): n q,v adapters picked uniformly, or the base.
    The first of two runs is untimed, like the HTTP runs' warm-up (first calls of each GEMM shape pack and JIT)."""
    from load_tests.harness.inprocess import interleaved, pick

    model_dir, store = bench_assets(max(n, 10))
    adapters = {f"qv{i}": store / f"qv{i}" for i in range(n)}
    ids = pick(list(adapters), 64) if n else [None] * 64
    a = argparse.Namespace(requests=64, prompt_len=128, new=64, repeats=2)
    return interleaved(model_dir, adapters, {"engine": ids}, a)["engine"][-1]


def _print_split(spent: dict[str, float]) -> None:
    total = sum(spent.values())
    for r, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        if s > 0.05:
            print(f"  {r:28} {s:7.2f} CPU s  {100 * s / total:5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=0, help="0: the base model; N: uniform over N adapters")
    ap.add_argument("--engine-direct", action="store_true", help=argparse.SUPPRESS)  # the child's job
    a = ap.parse_args()
    if a.engine_direct:
        print(json.dumps({"tok_s": engine_direct(a.adapters)}))
        return
    model_dir, store = bench_assets(max(a.adapters, 10))
    out = Path(tempfile.mkdtemp(prefix="httpcpu-"))
    args = ["--adapter-store", str(store), "--max-adapters", "64", "--max-batch-size", "64"]
    args += ["--max-num-batched-tokens", "4096"]
    env = {"LORALAND_CACHE_DIR": str(out / "cache")}
    pick = ["--popularity", "base"]
    if a.adapters:
        pick = ["--adapter-prefix", "qv", "--num-adapters", str(a.adapters), "--popularity", "uniform"]
    ratios = []
    with loraland_serve(model_dir, out / "serve.log", *args, env=env) as url:
        if a.adapters:
            import httpx

            with httpx.Client(base_url=url, timeout=120) as c:
                for i in range(a.adapters):
                    r = c.post("/v1/adapters", json={"name": f"qv{i}"})
                    if r.status_code not in (200, 201):
                        raise RuntimeError(f"registering qv{i}: {r.status_code} {r.text}")
            # Engine-direct holds every adapter in memory before it is timed: so does the server after this run
            # (each adapter once, W's shapes: every GEMM shape is packed and tuned before the first pass, too).
            subprocess.run(
                [sys.executable, "-m", "load_tests.serving.bench_serving", "--base-url", f"{url}/v1", "--model", "base",
                 *WORKLOAD_W_ARGS, "--num-requests", str(a.adapters), "--warmup-runs", "0", "--adapter-prefix", "qv",
                 "--num-adapters", str(a.adapters), "--popularity", "distinct"],
                capture_output=True, check=True,
            )  # fmt: skip
        server = next(
            p
            for p in psutil.process_iter()
            if "app.cli" in " ".join(p.cmdline() or []) and "serve" in p.cmdline()
        )
        for k in range(a.passes):
            engine = None
            if a.adapters:
                before = cpu_by_role(server)
                child = subprocess.run(
                    [sys.executable, "-m", "load_tests.serving.bench_http_cpu", "--engine-direct",
                     "--adapters", str(a.adapters)],
                    capture_output=True, text=True, check=True, env={**os.environ, **env},
                )  # fmt: skip
                engine = json.loads(child.stdout.strip().splitlines()[-1])["tok_s"]
                idle = sum(cpu_by_role(server).values()) - sum(before.values())
            before = cpu_by_role(server)
            t, ru = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
            client = subprocess.run(
                [sys.executable, "-m", "load_tests.serving.bench_serving", "--base-url", f"{url}/v1", "--model", "base",
                 *WORKLOAD_W_ARGS, *pick, "--label", "ours", "--out", str(out / f"pass{k}.json")],
                capture_output=True, text=True,
            )  # fmt: skip
            wall = time.monotonic() - t
            after = cpu_by_role(server)
            ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
            after["client (bench_serving)"] = ru2.ru_utime + ru2.ru_stime - ru.ru_utime - ru.ru_stime
            res = json.loads((out / f"pass{k}.json").read_text())
            tok_s = round(res["runs"][-1]["summary"]["output_tokens_per_s"], 1)
            print(
                f"pass {k + 1}: wall {wall:.1f}s, output {tok_s} tok/s over HTTP, client rc {client.returncode}"
            )
            if engine is not None:
                ratios.append(tok_s / engine)
                print(
                    f"  engine-direct {engine:.1f} tok/s (idle server meanwhile: {idle:.2f} CPU s); "
                    f"P7 = {tok_s:.1f} / {engine:.1f} = {ratios[-1]:.3f}"
                )
            print("  CPU of the HTTP pass (warm-up run + timed run), by process:")
            _print_split({r: round(after[r] - before.get(r, 0.0), 2) for r in after})
    if ratios:
        print("P7 per pass: " + " / ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
