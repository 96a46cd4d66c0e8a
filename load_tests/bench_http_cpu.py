"""Where the CPU goes when workload W is served over HTTP: CPU seconds per process of `loraland serve` (the
replica, the ingress, Serve's proxy and controller, Ray's own daemons) and of the client, for one pass.

    python -m load_tests.bench_http_cpu [--passes 2]

The replica's share is the work in-process serving would do too; everything else is the price of HTTP and of the
actor hops (issue 13's P7). Run it alone: on 2 cores every other process's CPU comes out of the replica's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from load_tests.bench_all import WORKLOAD, _bench_assets
from load_tests.servers import loraland_serve


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2)
    a = ap.parse_args()
    model_dir, store = _bench_assets(10)
    out = Path(tempfile.mkdtemp(prefix="httpcpu-"))
    args = ["--adapter-store", str(store), "--max-adapters", "64", "--max-batch-size", "64"]
    args += ["--max-num-batched-tokens", "4096"]
    with loraland_serve(model_dir, out / "serve.log", *args) as url:
        server = next(
            p
            for p in psutil.process_iter()
            if "app.cli" in " ".join(p.cmdline() or []) and "serve" in p.cmdline()
        )
        for k in range(a.passes):
            before = cpu_by_role(server)
            t = time.monotonic()
            client = subprocess.run(
                [sys.executable, "-m", "load_tests.bench_serving", "--base-url", f"{url}/v1", "--model", "base",
                 *WORKLOAD, "--popularity", "base", "--label", "ours", "--out", str(out / f"pass{k}.json")],
                capture_output=True, text=True,
            )  # fmt: skip
            wall = time.monotonic() - t
            after = cpu_by_role(server)
            res = json.loads((out / f"pass{k}.json").read_text())
            tok_s = round(res["runs"][0]["summary"]["output_tokens_per_s"], 1)
            spent = {r: round(after[r] - before.get(r, 0.0), 2) for r in after}
            total = sum(spent.values())
            print(f"pass {k + 1}: wall {wall:.1f}s, output {tok_s} tok/s, client rc {client.returncode}")
            for r, s in sorted(spent.items(), key=lambda kv: -kv[1]):
                if s > 0.05:
                    print(f"  {r:28} {s:7.2f} CPU s  {100 * s / total:5.1f}%")


if __name__ == "__main__":
    main()
