"""Workload W in-process: our engine's and transformers' output tok/s on the same batches, and interleaved
runs on one kernel (each run leads a pass in turn, so the machine's drifts hit every run alike)."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from load_tests.harness.models import workload_w


def add_workload_args(
    ap: argparse.ArgumentParser, adapters: int | None = None, repeats: int | None = 3
) -> None:
    """Workload W's shape as arguments (--requests, --prompt-len, --new), and --adapters / --repeats where the
    benchmark has them (None: it has not)."""
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    if adapters is not None:
        ap.add_argument("--adapters", type=int, default=adapters)
    if repeats is not None:
        ap.add_argument(
            "--repeats", type=int, default=repeats, help="interleaved passes per run; medians reported"
        )


class Ours:
    """The engine on workload-shaped batches (prefix caching off: every pass has fresh prompts anyway)."""

    def __init__(self, model_dir, max_batch: int, dtype: str, num_kv_blocks: int | None = None):
        """num_kv_blocks: the KV cache's size (default: the engine sizes it from the free memory, which a peer's
        resident copy of a large model leaves too little of)."""
        from loraland import LLMKernel

        kv = {} if num_kv_blocks is None else {"num_kv_blocks": num_kv_blocks}
        self.k = LLMKernel(
            model_dir,
            dtype=dtype,
            max_batch_size=max_batch,
            max_num_batched_tokens=4096,
            enable_prefix_caching=False,
            **kv,
        )
        self.k.complete([[5, 6, 7]], max_tokens=2, ignore_eos=True)  # warm-up

    def run(self, prompts, new_tokens) -> float:
        t = time.perf_counter()
        outs = self.k.complete(prompts, max_tokens=new_tokens, ignore_eos=True)
        dt = time.perf_counter() - t
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return sum(len(o.token_ids) for o in outs) / dt

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.k.close()


def generate_tok_s(model, prompts, new_tokens: int, **kw) -> float:
    """Output tok/s of one `generate` over the whole batch: greedy, exactly new_tokens each (kw: e.g. PEFT's
    adapter_names)."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def throughput(k, prompts, ids, new) -> float:
    k.complete([prompts[0][:8]], [ids[0]], max_tokens=2, ignore_eos=True)  # warm-up (and first install)
    t = time.perf_counter()
    outs = k.complete(prompts, ids, max_tokens=new, ignore_eos=True)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def interleaved(model_dir, adapters: dict[str, Path], runs: dict, a) -> dict[str, list[float]]:
    """tok/s of each named run (name -> the adapter per request), all on one kernel holding `adapters`,
    pass by pass (A B C, B C A, C A B, ...) so that the machine's drifts in speed hit every run alike. Each pass
    has its own prompts; prefix caching is off, so no run is served from another's KV."""
    from loraland import LLMKernel

    samples: dict[str, list[float]] = {name: [] for name in runs}
    with LLMKernel(
        model_dir,
        max_batch_size=a.requests,
        max_num_batched_tokens=4096,
        max_adapters=max(a.requests, 8),
        max_cpu_adapters=max(len(adapters), 1),
        enable_prefix_caching=False,
    ) as k:
        for name, path in adapters.items():
            k.load_adapter(name, path)
        names = list(runs)
        for r in range(a.repeats):
            prompts = workload_w(a.requests, a.prompt_len, seed=r)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each run leads a pass in turn
                ids = runs[name]
                samples[name].append(throughput(k, prompts, ids, a.new))
                print(f"  pass {r + 1}: {name:14} {samples[name][-1]:7.1f} tok/s", flush=True)
    return samples


def pick(names: list[str], n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(names) for _ in range(n)]
