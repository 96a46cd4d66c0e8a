"""Workload W through the engine vs HF transformers `generate` on the same requests.

    python -m load_tests.bench_engine [--dtypes float32,bfloat16] [--requests 64] [--new 64]

64 requests x 128 prompt tokens x 64 new tokens, greedy, submitted at once, TinyLlama-width 2-layer model.
Peers measured on the reference machine (2 cores): transformers fp32 218 tok/s; vLLM CPU 0.32 bf16 838 tok/s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from load_tests.models import build_bench_model, workload_w

CACHE = Path.home() / ".cache" / "loraland" / "bench-tinyllama-2l"


def run_ours(model_dir, prompts, new_tokens, dtype) -> float:
    from loraland import LLMKernel

    with LLMKernel(model_dir, dtype=dtype, max_batch_size=len(prompts), max_num_batched_tokens=4096) as k:
        k.complete([prompts[0][:16]], max_tokens=2, ignore_eos=True)  # warm-up
        t = time.perf_counter()
        outs = k.complete(prompts, max_tokens=new_tokens, ignore_eos=True)
        dt = time.perf_counter() - t
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return sum(len(o.token_ids) for o in outs) / dt


def run_hf(model_dir, prompts, new_tokens, dtype) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids[:1, :16], max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    model_dir = build_bench_model(CACHE)
    prompts = workload_w(a.requests, a.prompt_len)
    print(
        f"workload: {a.requests} x {a.prompt_len} prompt + {a.new} new tokens, threads={torch.get_num_threads()}"
    )
    print(f"{'dtype':10} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8}")
    rows = []
    for dtype in a.dtypes.split(","):
        ours = run_ours(model_dir, prompts, a.new, dtype)
        hf = None if a.no_hf else run_hf(model_dir, prompts, a.new, dtype)
        rows.append({"dtype": dtype, "ours_tok_s": ours, "hf_tok_s": hf})
        print(
            f"{dtype:10} {ours:11.1f} {hf or float('nan'):9.1f} {ours / (hf or float('nan')):8.2f}",
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
