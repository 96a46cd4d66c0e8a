"""Activated LoRA (issue 33): five checker adapters over one long conversation the base model already served.
Run: ./run bench alora [--quick] [--model smollm2-135m] [--passes 3] [--context 1500]; aLoRA vs LoRA TTFT.
Method and results: load_tests/serving/RESULTS.md (alora)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import time
from pathlib import Path

import torch

from load_tests.harness.models import CACHE, bench_model

INVOCATION = [29901, 29902, 29903]  # "<check>" as the checkers were trained to see it
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def model_folder(name: str) -> Path:
    """The bench model ("bench": TinyLlama width, 2 random layers) or a packaged real one (smollm2-135m)."""
    if name == "bench":
        return bench_model()
    from app.replica.resources import resolve_model_path

    return resolve_model_path(name)


def write_adapter(out: Path, model: Path, seed: int, rank: int, alora: bool) -> Path:
    """A PEFT-format LoRA folder (what save_pretrained writes) on q/k/v/o of `model`, random weights; alora:
    with alora_invocation_tokens. The same seed gives the same weights either way."""
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = json.loads((model / "config.json").read_text())
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads) * cfg.get("head_dim", h // heads)
    outs = {"q_proj": heads * cfg.get("head_dim", h // heads), "k_proj": kv, "v_proj": kv, "o_proj": h}
    ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": outs["q_proj"]}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in MODULES:
            key = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, ins[m], generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(outs[m], rank, generator=g) * 0.02
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(MODULES),
        "lora_dropout": 0.0,
        "bias": "none",
        "alora_invocation_tokens": INVOCATION if alora else None,
    }
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def reuse(k) -> list[int]:
    """The aLoRA checkers' base-KV tokens so far, summed: [reused, prefilled] (what /metrics exports)."""
    return [sum(v[i] for v in k.stats().alora_kv.values()) for i in (0, 1)]


async def timed(k, prompt: list[int], adapter: str | None, max_tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT, total seconds, tokens) of one streamed request."""
    t0 = time.perf_counter()
    ttft, toks = None, []
    async for d in k.generate(prompt, adapter, max_tokens=max_tokens, ignore_eos=True):
        if ttft is None and d.token_ids:
            ttft = time.perf_counter() - t0
        toks += d.token_ids
    return ttft, time.perf_counter() - t0, toks


def run(args) -> dict:
    from loraland import LLMKernel

    model = model_folder(args.model)
    vocab = min(29000, json.loads((model / "config.json").read_text())["vocab_size"])
    root = CACHE / "bench-alora" / args.model
    checkers = [f"chk{i}" for i in range(args.checkers)]
    for i, c in enumerate(checkers):
        write_adapter(root / f"{c}-alora", model, seed=100 + i, rank=args.rank, alora=True)
        write_adapter(root / f"{c}-lora", model, seed=100 + i, rank=args.rank, alora=False)
    results = {"model": args.model, "context": args.context, "checkers": args.checkers, "rank": args.rank}
    results["passes"] = []
    with LLMKernel(model, dtype="float32", num_kv_blocks=args.kv_blocks, max_adapters=2 * args.checkers) as k:
        for c in checkers:
            k.load_adapter(f"{c}-alora", root / f"{c}-alora")
            k.load_adapter(f"{c}-lora", root / f"{c}-lora")

        async def one_pass(p: int) -> dict:
            rng = random.Random(p)
            conv = [rng.randrange(3, vocab) for _ in range(args.context)]
            t0 = time.perf_counter()
            _, _, answer = await timed(k, conv, None, args.answer)
            t_base = time.perf_counter() - t0
            rows = {"alora": [], "lora": []}
            hits0, kv0 = k.engine.scheduler.alloc.hits, reuse(k)
            questions = [[rng.randrange(3, vocab) for _ in range(args.question)] for _ in checkers]
            for kind in ("alora", "lora"):
                for c, q in zip(checkers, questions):
                    prompt = conv + answer + INVOCATION + q
                    ttft, total, _ = await timed(k, prompt, f"{c}-{kind}", args.max_tokens)
                    rows[kind].append({"ttft_s": round(ttft, 4), "total_s": round(total, 4)})
                if kind == "alora":
                    hits = k.engine.scheduler.alloc.hits - hits0
                    kv = [a - b for a, b in zip(reuse(k), kv0)]
            ttft = {kd: sum(r["ttft_s"] for r in rows[kd]) / len(rows[kd]) for kd in rows}
            total = {kd: sum(r["total_s"] for r in rows[kd]) for kd in rows}
            out = {
                "pass": p,
                "base_answer_s": round(t_base, 3),
                "alora_base_block_hits": hits,
                "alora_base_kv_tokens": {"reused": kv[0], "prefilled": kv[1]},  # the replica's metric
                "checks": rows,
                "ttft_mean_s": {kd: round(v, 4) for kd, v in ttft.items()},
                "total_s": {kd: round(v, 3) for kd, v in total.items()},
                "ttft_ratio": round(ttft["alora"] / ttft["lora"], 3),
                "total_ratio": round(total["alora"] / total["lora"], 3),
            }
            print(
                f"pass {p}: TTFT aLoRA {ttft['alora'] * 1e3:.0f} ms vs LoRA {ttft['lora'] * 1e3:.0f} ms "
                f"(ratio {out['ttft_ratio']}), {len(checkers)} checks {total['alora']:.2f} s vs {total['lora']:.2f} s "
                f"(ratio {out['total_ratio']}), base blocks reused {hits}, tokens reused / prefilled {kv}",
                flush=True,
            )
            return out

        async def main():
            # warm-up: one short request per kind so pools exist and first-call costs are not measured
            for c in checkers:
                for kind in ("alora", "lora"):
                    await timed(k, INVOCATION + [5, 6, 7], f"{c}-{kind}", 1)
            for p in range(args.passes):
                results["passes"].append(await one_pass(p))

        asyncio.run(main())
    ps = results["passes"]
    results["ttft_ratio_max"] = max(p["ttft_ratio"] for p in ps)
    results["total_ratio_max"] = max(p["total_ratio"] for p in ps)
    results["goal_met"] = results["ttft_ratio_max"] <= 0.2 and results["total_ratio_max"] <= 0.3
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 pass, 3 checkers, a 600-token conversation")
    ap.add_argument("--model", default="bench", help="bench (TinyLlama width, 2 layers) or smollm2-135m")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--checkers", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--answer", type=int, default=16, help="tokens the base model answers the conversation with"
    )
    ap.add_argument("--question", type=int, default=12, help="tokens of each checker's question")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens each checker answers")
    ap.add_argument("--kv-blocks", type=int, default=None, help="default: 2048 (bench), 512 (a real model)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.kv_blocks is None:  # a 30-layer model's block is 11x the bench model's: 512 is ~380 MB in fp32
        args.kv_blocks = 2048 if args.model == "bench" else 512
    if args.quick:
        args.passes, args.checkers, args.context = 1, 3, 600
    res = run(args)
    print(json.dumps({k: v for k, v in res.items() if k != "passes"}))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
