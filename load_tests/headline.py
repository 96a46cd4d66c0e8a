"""The headline table: workload W's stages (engine, lora, serving, cold, vllm, w2) in turn, then one table.
Run: ./run bench headline [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from load_tests.harness.adapters import bench_assets
from load_tests.harness.servers import loraland_serve, vllm_serve
from load_tests.harness.workload import WORKLOAD_W_ARGS
from load_tests.serving import bench_w2

STAGES = ("engine", "lora", "serving", "cold", "vllm", "w2")


def _run(mod: str, *args: str) -> None:
    print(f"\n$ python -m {mod} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", mod, *args], check=True)


def serving(out: Path, n: int) -> None:
    import httpx

    model_dir, store = bench_assets(n)
    env = {"LORALAND_CACHE_DIR": str(out / f"cache-{os.getpid()}")}
    # The same engine settings as the in-process stages (bench_engine, bench_lora), so P7 compares like with like.
    args = ["--adapter-store", str(store), "--max-adapters", "64", "--max-batch-size", "64"]
    args += ["--max-num-batched-tokens", "4096"]
    with loraland_serve(model_dir, out / "serve.log", *args, env=env) as url:
        with httpx.Client(base_url=url, timeout=120) as c:
            for i in range(n):
                r = c.post("/v1/adapters", json={"name": f"qv{i}"})
                if r.status_code not in (200, 201):
                    raise RuntimeError(f"registering qv{i}: {r.status_code} {r.text}")
        sweep = ",".join(str(k) for k in sorted({10, n}))
        _run(
            "load_tests.serving.bench_serving",
            "--base-url",
            f"{url}/v1",
            "--model",
            "base",
            *WORKLOAD_W_ARGS,
            "--adapter-prefix",
            "qv",
            "--num-adapters",
            sweep,
            "--popularity",
            "uniform",
            "--baseline",
            "--repeats",
            "2",
            "--label",
            "ours",
            "--out",
            str(out / "serving.json"),
            "--plot-dir",
            str(out / "plots"),
        )


def vllm(out: Path, n: int, venv: Path, dtype: str) -> None:
    model_dir, store = bench_assets(n)
    threads = os.cpu_count() or 1  # what our replica gets by default (one replica, all cores)
    cpus = f"0-{threads - 1}"
    adapters = {f"qv{i}": store / f"qv{i}" for i in range(n)}
    common = ["--model", "base", *WORKLOAD_W_ARGS, "--timeout", "3600"]
    with vllm_serve(venv, model_dir, out / "vllm_base.log", dtype=dtype, cpus=cpus) as url:
        _run(
            "load_tests.serving.bench_serving",
            "--base-url",
            f"{url}/v1",
            *common,
            "--popularity",
            "base",
            "--label",
            "vllm",
            "--out",
            str(out / "vllm_base.json"),
        )
    with vllm_serve(venv, model_dir, out / "vllm_lora.log", adapters=adapters, dtype=dtype, cpus=cpus) as url:
        _run(
            "load_tests.serving.bench_serving",
            "--base-url",
            f"{url}/v1",
            *common,
            "--adapter-prefix",
            "qv",
            "--num-adapters",
            str(n),
            "--popularity",
            "uniform",
            "--baseline",
            "--label",
            "vllm+lora",
            "--out",
            str(out / "vllm_lora.json"),
            "--plot-dir",
            str(out / "plots_vllm"),
        )
    (out / "vllm.json").write_text(json.dumps({"dtype": dtype, "cpus": cpus, "venv": str(venv)}))


# ------------------------------------------------------------------------------------------ the table
def _load(out: Path, name: str) -> dict | None:
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _run_by(result: dict | None, pop: str, n: int | None = None) -> dict | None:
    """The summary of the run with this popularity (and adapter count) in a bench_serving result."""
    for r in (result or {}).get("runs", []):
        if r["popularity"].startswith(pop) and (n is None or r["num_adapters"] == n):
            return r["summary"]
    return None


def _tps(s: dict | None) -> float | None:
    return s["output_tokens_per_s"] if s else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary_rows(out: Path) -> list[tuple[str, str, str]]:
    """(measurement, result, target) for every stage whose JSON is in out."""
    rows: list[tuple[str, str, str]] = []
    eng, lora, srv, cold = (_load(out, k) for k in ("engine", "lora", "serving", "cold"))
    vb, vl, vcfg = (_load(out, k) for k in ("vllm_base", "vllm_lora", "vllm"))
    if eng:
        for r in eng["rows"]:
            hf = r["hf_tok_s"]
            ratio = f" = {r['ours_tok_s'] / hf:.2f}x" if hf else ""
            rows.append(
                (
                    f"engine vs HF generate, {r['dtype']}",
                    f"{r['ours_tok_s']:.1f} vs {hf or 0:.1f} tok/s{ratio}",
                    "",
                )
            )
    if lora:
        t, n = lora["tok_s"], lora["adapters"]
        rows.append(
            (
                f"P1 {n} q,v r16 adapters / base",
                f"{t['qv']:.1f} / {t['base']:.1f} = {t['qv'] / t['base']:.3f}",
                ">= 0.97",
            )
        )
        rows.append(
            (
                f"P1b {n} all-seven / base",
                f"{t['all7']:.1f} / {t['base']:.1f} = {t['all7'] / t['base']:.3f}",
                ">= 0.90",
            )
        )
        if "peft_qv" in t:
            rows.append(
                (
                    "P2 ours / HF+PEFT mixed batch",
                    f"{t['qv']:.1f} / {t['peft_qv']:.1f} = {t['qv'] / t['peft_qv']:.2f}x",
                    ">= 4x",
                )
            )
        if "distinct1000" in t:
            drop = 100 * (1 - t["distinct1000"] / t["distinct5"])
            rows.append(
                (
                    "P4 1000 vs 5 distinct adapters",
                    f"{t['distinct1000']:.1f} vs {t['distinct5']:.1f}: {drop:.1f}% drop",
                    "<= 3%",
                )
            )
        rows.append(
            (
                "P6 resident / tensor bytes, ranks 4-32",
                f"pools {lora['p6_pools']:.3f}, RSS {lora['p6_rss']:.3f}",
                "<= 1.1",
            )
        )
    n = srv["runs"][-1]["num_adapters"] if srv else None
    ours_base, ours_n = _run_by(srv, "base"), _run_by(srv, "uniform", n)
    if ours_base and ours_n:
        c = next(c for c in srv["comparisons"] if c["run"] == srv["runs"][-1]["label"])
        rows.append(
            (
                f"seed: HTTP, {n} adapters uniform vs base, 64 conc.",
                f"{_tps(ours_n):.1f} vs {_tps(ours_base):.1f} tok/s ({c['output_tokens_per_s_change_pct']:+.1f}%), "
                f"p99 TPOT {c['tpot_p99_change_ms']:+.1f} ms, p99 E2E {c['e2e_p99_change_ms']:+.0f} ms",
                "seed (A100): -3%, +5 ms",
            )
        )
        sweep = [f"{r['num_adapters']}: {_tps(r['summary']):.1f}" for r in srv["runs"] if r["num_adapters"]]
        rows.append(("HTTP tok/s by number of adapters", ", ".join(sweep), ""))
    if ours_n and lora:
        p7 = _ratio(_tps(ours_n), lora["tok_s"]["qv"])
        rows.append(
            (
                "P7 HTTP / engine-direct, q,v adapters",
                f"{_tps(ours_n):.1f} / {lora['tok_s']['qv']:.1f} = {p7:.2f}",
                ">= 0.90",
            )
        )
    if cold:
        p5, it = cold["p5"], cold["interference"]
        ex = [p["cold_ttft_ms"] - p["warm_ttft_ms"] for p in p5["probes"]]
        mb = cold["config"]["adapter_mb"]
        rows.append(
            (
                f"P5 cold (S3) - warm TTFT, {mb:.1f} MB adapter",
                f"median {sorted(ex)[len(ex) // 2]:.1f} ms, max {max(ex):.1f} ms ({len(ex)} adapters)",
                "<= 50 ms",
            )
        )
        pct = it["tpot_p99_cold_vs_warm_pct"]
        rows.append(
            (
                f"p99 TPOT while {cold['config']['burst']} cold loads run",
                ("n/a" if pct is None else f"{pct:+.1f}% vs the same burst warm")
                + f", {it['background_failed']} of {it['background_requests']} failed",
                "<= +10%",
            )
        )
    vl_n, vl_base, vb_base = _run_by(vl, "uniform"), _run_by(vl, "base"), _run_by(vb, "base")
    tag = f"vLLM CPU {vcfg['dtype']}, cores {vcfg['cpus']}" if vcfg else "vLLM CPU"
    if vb_base or vl_n:
        parts = [f"no-LoRA server {_tps(vb_base):.1f}" if vb_base else None]
        parts.append(f"LoRA server base {_tps(vl_base):.1f}" if vl_base else None)
        parts.append(f"{n or '?'} adapters {_tps(vl_n):.1f}" if vl_n else None)
        rows.append((f"{tag}, HTTP, tok/s", ", ".join(p for p in parts if p), ""))
    if ours_n and vl_n:
        rows.append(("P3 ours / vLLM, both with adapters", f"{_tps(ours_n) / _tps(vl_n):.2f}x", ">= 5x"))
    if ours_n and vb_base:
        rows.append(("ours with adapters / vLLM base only", f"{_tps(ours_n) / _tps(vb_base):.2f}", ">= 1.0"))
    return rows


def print_summary(rows: list[tuple[str, str, str]], file=None) -> None:
    w0 = max([len(r[0]) for r in rows] + [11])
    w1 = max([len(r[1]) for r in rows] + [6])
    print(f"\n{'measurement':{w0}}  {'result':{w1}}  target", file=file)
    for name, result, target in rows:
        print(f"{name:{w0}}  {result:{w1}}  {target}", file=file)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(STAGES), help="comma-separated stages (default: all)")
    ap.add_argument("--adapters", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("load_tests/serving/results"))
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "/work/vllm-venv")))
    ap.add_argument(
        "--vllm-dtype", default="float32", help="float32 is vLLM CPU's faster dtype on AVX2-only CPUs"
    )
    a = ap.parse_args(argv)
    stages = [s for s in a.only.split(",") if s]
    if bad := set(stages) - set(STAGES):
        ap.error(f"unknown stage(s) {sorted(bad)}; choose from {', '.join(STAGES)}")
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out.resolve()
    for stage in stages:
        if stage == "engine":
            _run("load_tests.engine.bench_engine", "--dtypes", "float32", "--json", str(out / "engine.json"))
        elif stage == "lora":
            _run(
                "load_tests.engine.bench_lora",
                "--adapters",
                str(a.adapters),
                "--json",
                str(out / "lora.json"),
            )
        elif stage == "serving":
            serving(out, a.adapters)
        elif stage == "cold":
            _run("load_tests.serving.bench_cold", "--out", str(out))
        elif stage == "vllm":
            if (a.vllm_venv / "bin" / "python").is_file():
                vllm(out, a.adapters, a.vllm_venv, a.vllm_dtype)
            else:
                print(f"\nvllm: skipped, no venv at {a.vllm_venv} (see load_tests/serving/vllm_peer.md)")
        elif stage == "w2":
            _run("load_tests.serving.bench_w2", "--out", str(out), "--vllm-venv", str(a.vllm_venv))
    rows = summary_rows(out) + bench_w2.summary_rows(out)
    print_summary(rows)
    (out / "summary.json").write_text(
        json.dumps([dict(zip(("measurement", "result", "target"), r)) for r in rows], indent=1)
    )
    print(f"\nwrote {out / 'summary.json'} (per-stage JSON, logs and plots beside it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
