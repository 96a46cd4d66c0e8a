"""GEMM kernels per linear shape and row count: GFLOP/s of each candidate and the dispatcher's pick.
Run: ./run bench gemm [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from app.replica.linear import KERNELS, default_tuner
from app.replica.models import MAX_ROWS, MAX_SAMPLED_ROWS

HIDDEN, INTER, HEADS, KV_HEADS, D, VOCAB = 2048, 5632, 32, 4, 64, 32000
SHAPES = {  # name -> (out, in)
    "qkv": ((HEADS + 2 * KV_HEADS) * D, HIDDEN),
    "o": (HIDDEN, HEADS * D),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}


def candidates(w: torch.Tensor, ms: list[int], hints: bool) -> dict[str, object]:
    runs = {}
    for name, kern in KERNELS.items():
        try:
            runs[name] = kern.bind(kern.pack(w), w, None)
        except RuntimeError as e:
            print(f"  {name}: unavailable ({e})")
    if hints and "onednn" in runs:
        op = torch.ops.mkldnn._linear_pointwise
        for m in ms:
            p = torch.ops.mkldnn._reorder_linear_weight(w, m)
            runs[f"onednn@{m}"] = lambda x, p=p: op(x, p, None, "none", [], "")
    return runs


def bench_shape(w: torch.Tensor, ms: list[int], rounds: int, hints: bool) -> dict[int, dict[str, float]]:
    n, k = w.shape
    runs = candidates(w, ms, hints)
    out = {}
    for m in ms:
        x = torch.randn(m, k, dtype=w.dtype)
        mine = {nm: r for nm, r in runs.items() if "@" not in nm or nm == f"onednn@{m}"}
        for r in mine.values():
            r(x)  # warm-up
        samples: dict[str, list[float]] = {nm: [] for nm in mine}
        for _ in range(rounds):
            for nm, r in mine.items():
                s = time.perf_counter()
                r(x)
                samples[nm].append(time.perf_counter() - s)
        out[m] = {
            nm.split("@")[0] + ("@M" if "@" in nm else ""): 2 * m * n * k / statistics.median(v) / 1e9
            for nm, v in samples.items()
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,8,64,256,512,2048,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hints", action="store_true", help="also oneDNN packed with each M as its row hint")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    ms = [int(m) for m in a.ms.split(",")]
    tuner = default_tuner()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype}, {a.rounds} interleaved rounds "
        f"(medians), GFLOP/s; plans from {tuner.path}"
    )
    rows = []
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, dtype=dtype) / k**0.5
        plan = tuner.plan(w, None, MAX_SAMPLED_ROWS if name == "lm_head" else MAX_ROWS)
        res = bench_shape(w, ms, a.rounds, a.hints)
        cols = list(next(iter(res.values())))
        print(f"\n{name} [{n} x {k}]  plan: bounds {list(plan.bounds)} kernels {list(plan.kernels)}")
        print(
            f"{'M':>6} "
            + " ".join(f"{c:>9}" for c in cols)
            + f" {'best':>9} {'picked':>9} {'picked/best':>11}"
        )
        for m, g in res.items():
            best = max(g, key=g.get)
            picked = plan.kernel_for(m)
            print(
                f"{m:6d} "
                + " ".join(f"{g[c]:9.1f}" for c in cols)
                + f" {best:>9} {picked:>9} {g[picked] / g[best]:11.2f}",
                flush=True,
            )
            rows.append({"shape": name, "n": n, "k": k, "m": m, "gflops": g, "picked": picked, "best": best})
    if a.json:
        a.json.write_text(json.dumps({"threads": a.threads, "dtype": a.dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
