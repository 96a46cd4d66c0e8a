"""Workload W through the engine vs HF transformers `generate` on the same requests.
Run: ./run bench engine [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from load_tests.harness.inprocess import Ours, add_workload_args, generate_tok_s
from load_tests.harness.models import bench_model, workload_w


class HF:
    """transformers `generate` on the whole batch at once (same prompts, greedy, exactly new_tokens each)."""

    def __init__(self, model_dir, dtype: str):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).eval()
        with torch.no_grad():
            self.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)

    def run(self, prompts, new_tokens) -> float:
        return generate_tok_s(self.model, prompts, new_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    add_workload_args(ap, repeats=None)
    ap.add_argument(
        "--repeats", type=int, default=3, help="interleaved passes (ours, HF, ours, ...); medians"
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--gemm",
        default="auto",
        choices=["auto", "aten", "onednn", "mkl"],
        help="our linears on CPU: auto (measured per shape and M, app/replica/linear.py) or one kernel for all",
    )
    a = ap.parse_args()
    if a.gemm != "auto":
        from app.replica.linear import GemmTuner, TunerConfig, set_default_tuner

        set_default_tuner(GemmTuner(None, TunerConfig(candidates=(a.gemm,))))
    model_dir = bench_model()
    print(
        f"workload: {a.requests} x {a.prompt_len} prompt + {a.new} new tokens, threads={torch.get_num_threads()}, "
        f"{a.repeats} interleaved passes (medians)"
    )
    rows = []
    for dtype in a.dtypes.split(","):
        ours_s, hf_s = [], []
        with Ours(model_dir, a.requests, dtype) as ours:
            hf = None if a.no_hf else HF(model_dir, dtype)
            for r in range(a.repeats):
                prompts = workload_w(a.requests, a.prompt_len, seed=r)
                ours_s.append(ours.run(prompts, a.new))
                if hf is not None:
                    hf_s.append(hf.run(prompts, a.new))
                print(
                    f"  pass {r + 1}: ours {ours_s[-1]:.1f}, HF {hf_s[-1] if hf_s else float('nan'):.1f} tok/s"
                )
        o, h = statistics.median(ours_s), (statistics.median(hf_s) if hf_s else None)
        rows.append(
            {"dtype": dtype, "ours_tok_s": o, "hf_tok_s": h, "ours_samples": ours_s, "hf_samples": hf_s}
        )
        print(f"{'dtype':10} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8}")
        print(f"{dtype:10} {o:11.1f} {h or float('nan'):9.1f} {o / (h or float('nan')):8.2f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
