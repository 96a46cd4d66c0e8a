"""lm-eval-harness against our server vs lm-eval's own HF+PEFT model: the same scores (issue 18).
Run: ./run bench lm_eval_parity [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from load_tests.harness.servers import loraland_serve

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASKS = "loraland_mc,loraland_gen"
ADAPTER = "evalora"
TOL = 1e-4
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "none"}  # fmt: skip


def build_assets(out: Path) -> tuple[Path, Path]:
    from tests.fixtures.models import build_tiny_model
    from tests.fixtures.tiny_adapter import write_tiny_adapter

    model = out / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(model, "llama-gqa")
    adapter = out / "store" / ADAPTER
    write_tiny_adapter(adapter, "llama-gqa", seed=18)
    return model, adapter


@contextlib.contextmanager
def serving_adapter(model: Path, adapter: Path, out: Path) -> Iterator[str]:
    """`loraland serve` on `model` (1 replica, 1 CPU, fp32) with `adapter` registered as ADAPTER; yields its URL."""
    env = {"LORALAND_CACHE_DIR": str(out / "serve-cache"), "OMP_NUM_THREADS": "1"}
    args = ["--adapter-store", str(adapter.parent), "--replica-cpus", "1", "--replica-gpus", "0"]
    args += ["--dtype", "float32"]
    t = time.perf_counter()
    with loraland_serve(model, out / "serve.log", *args, env=env) as url:
        print(f"  loraland serve up in {time.perf_counter() - t:.0f} s at {url}", flush=True)
        r = httpx.post(f"{url}/v1/adapters", json={"name": ADAPTER, "public": True}, timeout=120)
        if r.status_code not in (200, 201):
            raise RuntimeError(f"registering {ADAPTER}: {r.status_code} {r.text}")
        yield url


def lm_eval(
    exe: str,
    out: Path,
    label: str,
    model: str,
    model_args: str,
    *extra: str,
    limit: int | None,
    reuse: bool = False,
) -> dict:
    """One lm_eval run (cwd: the task folder, whose YAMLs name their data files relative to it); its stdout is
    kept in out/label.log, its results and samples under out/label/."""
    cmd = [
        exe,
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASKS,
        "--include_path",
        str(TASK_DIR),
    ]
    cmd += ["--batch_size", "1", "--log_samples", "--output_path", str(out / label), "--seed", "1234", *extra]
    if limit:
        cmd += ["--limit", str(limit)]
    print("$ " + shlex.join(cmd), flush=True)
    t = time.perf_counter()
    log = out / f"{label}.log"
    if reuse and log.is_file() and list((out / label).rglob("results_*.json")):
        print(f"  {label}: reusing {log} and its results", flush=True)
        return {"log": log.read_text(), "results": _results(out / label), "samples": _samples(out / label)}
    with open(log, "w") as f:
        rc = subprocess.call(
            cmd, cwd=TASK_DIR, env={**os.environ, **OFFLINE_ENV}, stdout=f, stderr=subprocess.STDOUT
        )
    text = log.read_text()
    if rc != 0:
        raise RuntimeError(f"lm_eval ({label}) exited {rc}:\n{text[-4000:]}")
    print(f"  {label}: {time.perf_counter() - t:.0f} s", flush=True)
    return {"log": text, "results": _results(out / label), "samples": _samples(out / label)}


def _results(folder: Path) -> dict:
    files = sorted(folder.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(files[-1].read_text())["results"]


def _samples(folder: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for f in sorted(folder.rglob("samples_*.jsonl"), key=lambda p: p.stat().st_mtime):
        task = f.name.split("_20")[0].removeprefix("samples_")  # samples_<task>_<timestamp>.jsonl
        out[task] = {s["doc_id"]: s for s in map(json.loads, f.read_text().splitlines())}
    return out


def table_of(log: str) -> str:
    """lm-eval's printed results table (the markdown lines that start with '|')."""
    return "\n".join(line for line in log.splitlines() if line.startswith("|"))


def compare(a: dict, b: dict) -> tuple[list[str], dict]:
    """Differences between two runs (empty: equal) and the per-sample statistics."""
    problems: list[str] = []
    for task, metrics in a["results"].items():
        for k, v in metrics.items():
            if k == "alias" or "stderr" in k:
                continue
            w = b["results"].get(task, {}).get(k)
            if v != w:
                problems.append(f"{task} {k}: hf {v} vs ours {w}")
    max_ll, n_ll, n_gen, greedy_agree = 0.0, 0, 0, 0
    for task, docs in a["samples"].items():
        other = b["samples"].get(task, {})
        if set(docs) != set(other):
            problems.append(f"{task}: doc ids differ")
        for doc_id, s in docs.items():
            t = other.get(doc_id)
            if t is None:
                continue
            for r, q in zip(s["resps"], t["resps"], strict=True):
                x, y = r[0], q[0]
                if isinstance(x, list | tuple):  # loglikelihood: (logprob, is_greedy)
                    n_ll += 1
                    d = abs(float(x[0]) - float(y[0]))
                    max_ll = max(max_ll, d)
                    if d > TOL:
                        problems.append(f"{task} doc {doc_id}: loglikelihood {x[0]} vs {y[0]} (|d| {d:.2e})")
                    if str(x[1]) == str(y[1]):  # the samples file holds them as strings
                        greedy_agree += 1
                    else:
                        problems.append(f"{task} doc {doc_id}: is_greedy {x[1]} vs {y[1]}")
                else:  # generate_until: the text
                    n_gen += 1
                    if x != y:
                        problems.append(f"{task} doc {doc_id}: generation {x!r} vs {y!r}")
    return problems, {"loglikelihoods": n_ll, "max_abs_diff": max_ll, "is_greedy_equal": greedy_agree,
                      "generations": n_gen}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default="/work/lmeval-venv/bin/lm_eval", help="lm-eval's executable")
    ap.add_argument("--out", type=Path, default=Path("/tmp/lm_eval_parity"))
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--reuse-hf", action="store_true", help="keep the hf runs already in --out (same data)")
    ap.add_argument(
        "--skip-base", action="store_true", help="skip the base-model run (the adapter-matters check)"
    )
    a = ap.parse_args()
    from load_tests.harness.local_stack import require_offline

    require_offline()
    a.out.mkdir(parents=True, exist_ok=True)
    model, adapter = build_assets(a.out)
    runs = {}
    runs["hf"] = lm_eval(a.lm_eval, a.out, "hf", "hf", f"pretrained={model},peft={adapter},dtype=float32",
                         "--device", "cpu", limit=a.limit, reuse=a.reuse_hf)  # fmt: skip
    if not a.skip_base:
        runs["hf-base"] = lm_eval(a.lm_eval, a.out, "hf-base", "hf", f"pretrained={model},dtype=float32",
                                  "--device", "cpu", limit=a.limit, reuse=a.reuse_hf)  # fmt: skip
    with serving_adapter(model, adapter, a.out) as url:
        margs = (
            f"model={ADAPTER},base_url={url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface"
        )
        margs += ",tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=120"
        runs["ours"] = lm_eval(a.lm_eval, a.out, "ours", "local-completions", margs, limit=a.limit)
    problems, stats = compare(runs["hf"], runs["ours"])
    report = ["## lm-eval, hf + peft", table_of(runs["hf"]["log"]), "", "## lm-eval, local-completions → ours",
              table_of(runs["ours"]["log"])]  # fmt: skip
    if "hf-base" in runs:
        _, base_stats = compare(runs["hf-base"], runs["hf"])
        report += ["", "## lm-eval, hf base model (no adapter)", table_of(runs["hf-base"]["log"])]
        differ = base_stats["max_abs_diff"]
        report.append(f"\nbase vs adapter: largest per-sample loglikelihood difference {differ:.4f}")
        if differ < 1e-3:
            problems.append("the adapter does not change the loglikelihoods: the comparison proves nothing")
    report.append(
        f"\nper sample, hf+peft vs ours: {stats['loglikelihoods']} loglikelihoods, largest |difference| "
        f"{stats['max_abs_diff']:.2e} (tolerance {TOL}), is_greedy equal {stats['is_greedy_equal']}/"
        f"{stats['loglikelihoods']}; {stats['generations']} generations"
    )
    report.append("PARITY: OK" if not problems else "PARITY: FAILED\n" + "\n".join(problems[:40]))
    text = "\n".join(report)
    print(text)
    (a.out / "summary.md").write_text(text + "\n")
    (a.out / "stats.json").write_text(json.dumps(stats | {"problems": problems}, indent=1))
    sys.exit(0 if not problems else 1)


if __name__ == "__main__":
    main()
