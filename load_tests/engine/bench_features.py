"""What the sampler's features cost (issue 18): W with 25% of requests using logprobs, penalties or a
json_schema response_format, against W with none, in-process.
Run: ./run bench features [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import string
import time
from pathlib import Path

import torch

from load_tests.engine.bench_grammar_engines import SIMPLE as SCHEMA
from load_tests.harness.inprocess import add_workload_args
from load_tests.harness.models import CACHE, TINYLLAMA_2L, bench_model, workload_w

RUNS = ("none", "logprobs", "penalties", "json_schema")


def json_capable_model(base: Path, out_dir: Path) -> Path:
    """The bench model's config and weights (linked) with a word-level vocabulary that spells JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.suffix in (".safetensors",) or f.name in ("config.json", "generation_config.json"):
            target = out_dir / f.name
            if not target.exists():
                target.symlink_to(f.resolve()) if f.suffix == ".safetensors" else shutil.copy(f, target)
    chars = [c for c in string.printable if c not in string.whitespace or c == " "]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {c: 3 + i for i, c in enumerate(chars)}
    vocab |= {f"w{i}": i for i in range(3 + len(chars), TINYLLAMA_2L["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out_dir)
    return out_dir


def options(run: str, i: int, new: int, schema_key: str) -> dict:
    free = {"max_tokens": new, "ignore_eos": True}
    if i % 4 != 0 or run == "none":
        return free
    if run == "logprobs":
        return free | {"logprobs": 5}
    if run == "penalties":
        return free | {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
    return {"max_tokens": new, "response_format": schema_key}


async def one_pass(
    k, prompts: list[list[int]], run: str, new: int, schema_key: str
) -> tuple[float, int, int]:
    """(output tok/s, all output tokens, the grammar rows' output tokens) of one batch."""

    async def one(i: int, p: list[int]) -> int:
        n = 0
        async for d in k.generate(p, None, **options(run, i, new, schema_key)):
            n += len(d.token_ids)
        return n

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t
    grammar = sum(c for i, c in enumerate(counts) if i % 4 == 0) if run == "json_schema" else 0
    return sum(counts) / wall, sum(counts), grammar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--quick", action="store_true", help="16 requests x 16 new tokens, 2 passes")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.new, a.repeats = 16, 16, 2
    from loraland import LLMKernel

    model_dir = json_capable_model(bench_model(), CACHE / "bench-tinyllama-2l-json")
    schema_key = json.dumps(SCHEMA, sort_keys=True, separators=(",", ":"))
    print(
        f"workload W: {a.requests} x {a.prompt_len} prompt + {a.new} new tokens, 25% of requests with the "
        f"feature, threads={torch.get_num_threads()}, {a.repeats} interleaved passes (medians)"
    )
    samples: dict[str, list[float]] = {r: [] for r in RUNS}
    grammar_tokens: list[tuple[int, int]] = []
    with LLMKernel(
        model_dir, max_batch_size=a.requests, max_num_batched_tokens=4096, enable_prefix_caching=False
    ) as k:
        k.grammars.compile(schema_key)  # compiled once, as the first request of a schema would at admission
        # Warm-up: one untimed batch of every run (the first timed pass otherwise paid for first touches).
        for run in RUNS:
            asyncio.run(one_pass(k, workload_w(a.requests, a.prompt_len, seed=999), run, 4, schema_key))
        for r in range(a.repeats):
            prompts = workload_w(a.requests, a.prompt_len, seed=r)
            for run in RUNS[r % len(RUNS) :] + RUNS[: r % len(RUNS)]:
                tok_s, total, gram = asyncio.run(one_pass(k, prompts, run, a.new, schema_key))
                samples[run].append(tok_s)
                if run == "json_schema":
                    grammar_tokens.append((gram, total))
                print(f"  pass {r + 1}: {run:12} {tok_s:7.1f} tok/s ({total} tokens)", flush=True)
    t = {run: statistics.median(v) for run, v in samples.items()}
    print(f"{'run':12} {'out tok/s':>10}  ratio to none  passes")
    for run in RUNS:
        passes = " ".join(f"{x:.1f}" for x in samples[run])
        print(f"{run:12} {t[run]:10.1f}  {t[run] / t['none']:13.3f}  {passes}")
    rows = -(-a.requests // 4)
    for gram, total in grammar_tokens:
        print(
            f"json_schema pass: its {rows} grammar rows produced {gram} tokens (of {total}; at most {rows * a.new})"
        )
    if a.json:
        out = {"threads": torch.get_num_threads(), "requests": a.requests, "new": a.new, "tok_s": t}
        out |= {"samples": samples, "grammar_tokens": grammar_tokens}
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
