"""`./run bench`: the benchmark table on the TinyLlama-width 2-layer random model (workload W).

    python -m load_tests.bench_all [--skip-engine] [--skip-lora] [--skip-serving] [--out DIR]

1. engine vs HF transformers (load_tests.bench_engine, fp32)
2. multi-LoRA ratios P1, P1b, P2, P4, P6 (load_tests.bench_lora)
3. over HTTP: `loraland serve` (1 replica, --no-auth) with 200 rank-16 q,v adapters registered from a local
   adapter store; load_tests.bench_serving with 64 concurrent requests x 128 prompt x 64 output tokens, each on
   a random adapter, against the same server on the base model (the seed's experiment), and HTTP vs
   engine-direct throughput on the same workload (P7).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from load_tests.bench_lora import CACHE, build_bench_adapters
from load_tests.models import build_bench_model


def _run(mod: str, *args: str) -> None:
    print(f"\n$ python -m {mod} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", mod, *args], check=True)


def serving(out: Path, n_adapters: int, port: int = 8765) -> dict:
    model_dir = build_bench_model(CACHE / "bench-tinyllama-2l")
    store = CACHE / "bench-adapters" / "qv-r16"
    build_bench_adapters(model_dir, store, n_adapters, r=16, targets=("q_proj", "v_proj"), prefix="qv")
    env = {**os.environ, "LORALAND_CACHE_DIR": str(out / "cache")}
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        "base",
        "--replicas",
        "1",
        "--port",
        str(port),
        "--no-auth",
        "--adapter-store",
        str(store),
        "--max-adapters",
        "64",
        "--max-batch-size",
        "64",
    ]
    srv = subprocess.Popen(cmd, env=env, stdout=open(out / "serve.log", "w"), stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if srv.poll() is not None:
                raise RuntimeError(f"loraland serve exited ({srv.returncode}); see {out / 'serve.log'}")
            time.sleep(1)
        with httpx.Client(base_url=base_url, timeout=120) as c:
            for i in range(n_adapters):
                r = c.post("/v1/adapters", json={"name": f"qv{i}"})
                if r.status_code not in (200, 201):
                    raise RuntimeError(f"registering qv{i}: {r.status_code} {r.text}")
        result = out / "serving.json"
        _run(
            "load_tests.bench_serving",
            "--base-url",
            f"{base_url}/v1",
            "--model",
            "base",
            "--adapter-prefix",
            "qv",
            "--num-adapters",
            str(n_adapters),
            "--popularity",
            "uniform",
            "--baseline",
            "--concurrency",
            "64",
            "--num-requests",
            "64",
            "--prompt-len",
            "128",
            "--output-len",
            "64",
            "--warmup-runs",
            "1",
            "--out",
            str(result),
            "--plot-dir",
            str(out / "plots"),
            "--no-progress",
        )
        return json.loads(result.read_text())
    finally:
        srv.send_signal(2)
        try:
            srv.wait(timeout=60)
        except subprocess.TimeoutExpired:
            srv.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-lora", action="store_true")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--adapters", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("load_tests/results"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.skip_engine:
        _run("load_tests.bench_engine", "--dtypes", "float32")
    if not a.skip_lora:
        _run("load_tests.bench_lora", "--adapters", str(a.adapters))
    if not a.skip_serving:
        serving(a.out, a.adapters)


if __name__ == "__main__":
    main()
