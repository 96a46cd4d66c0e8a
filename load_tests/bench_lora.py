"""Multi-LoRA cost on workload W (issue 3): one run prints every ratio.

    python -m load_tests.bench_lora [--requests 64] [--new 64] [--skip-peft]

P1  q_proj,v_proj adapters / base            (target >= 0.97)
P1b all seven projections / base             (target >= 0.90)
P2  ours / PEFT mixed-batch generate         (target >= 4x)
P4  1000 vs 5 distinct adapters              (target <= 3% drop)
P6  resident bytes per adapter / tensor bytes, mixed ranks (target <= 1.1)
Peers on the reference machine (2 cores): HF+PEFT fp32 base 218 / q,v 207 / all-seven 165 tok/s;
vLLM CPU 0.32 bf16 base 838 / q,v 124 / all-seven 115 tok/s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from load_tests.bench_adapters import build_bench_adapters as _build
from load_tests.bench_engine import generate_tok_s
from load_tests.models import build_bench_model, workload_w

CACHE = Path.home() / ".cache" / "loraland"
ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_bench_adapters(model_dir, root, n, **kw) -> dict[str, Path]:
    return {p.name: p for p in _build(model_dir, root, n, alpha=kw.pop("alpha", 32), **kw)}


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


def peft_mixed(model_dir, prompts, adapters: dict[str, Path], new: int) -> float:
    """HF+PEFT with every adapter loaded, one mixed batch (`adapter_names`), the same picks as ours."""
    import transformers
    from peft import PeftModel

    ids = pick(list(adapters), len(prompts))
    used = sorted(set(ids))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters[used[0]], adapter_name=used[0])
    for name in used[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return generate_tok_s(model.eval(), prompts, new, adapter_names=ids)


def resident_ratio(model_dir, root: Path) -> tuple[float, float]:
    """(touched pool bytes / tensor bytes, RSS growth / tensor bytes) with mixed ranks resident."""
    from loraland import LLMKernel

    sets = {}
    for r in (4, 8, 12, 16, 32):
        sets.update(
            build_bench_adapters(model_dir, root / f"mixed-r{r}", 8, r=r, seed=100 + r, prefix=f"m{r}-")
        )
    with LLMKernel(model_dir, max_adapters=len(sets), num_kv_blocks=64) as k:
        for name, path in sets.items():
            k.load_adapter(name, path)
        k.complete([[5, 6, 7]] * len(sets), max_tokens=1)  # same shapes through the base model first
        before = rss()
        k.complete([[5, 6, 7]] * len(sets), list(sets), max_tokens=1)
        grown = rss() - before
        touched, own = k.adapter_manager.resident_bytes()
    return touched / own, grown / own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes per run; medians reported")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--skip-p4", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    model_dir = build_bench_model(CACHE / "bench-tinyllama-2l")
    root = CACHE / "bench-adapters"
    qv = build_bench_adapters(
        model_dir, root / "qv-r16", a.adapters, r=16, targets=("q_proj", "v_proj"), prefix="qv"
    )
    all7 = build_bench_adapters(
        model_dir, root / "all7-r16", a.adapters, r=16, targets=ALL_SEVEN, prefix="all7"
    )
    print(
        f"workload W: {a.requests} x {a.prompt_len} prompt + {a.new} new tokens, "
        f"threads={torch.get_num_threads()}, {a.repeats} interleaved passes (medians)"
    )
    n = a.requests
    runs = {"base": [None] * n, "qv": pick(list(qv), n), "all7": pick(list(all7), n)}
    samples = interleaved(model_dir, qv | all7, runs, a)
    if not a.skip_p4:
        many = build_bench_adapters(
            model_dir, root / "qv-r16-1000", 1000, r=16, targets=("q_proj", "v_proj"), seed=7, prefix="many"
        )
        names = list(many)
        samples |= interleaved(
            model_dir, many, {"distinct5": pick(names[:5], n), "distinct1000": pick(names, n)}, a
        )
    if not a.skip_peft:
        samples["peft_qv"] = [peft_mixed(model_dir, workload_w(n, a.prompt_len), qv, a.new)]
    t = {name: statistics.median(v) for name, v in samples.items()}
    touched, grown = resident_ratio(model_dir, root)
    rows = [
        ("base model", "base", ""),
        (f"{a.adapters} q,v r16 adapters", "qv", f"P1 = {t['qv'] / t['base']:.3f} (>= 0.97)"),
        (f"{a.adapters} all-seven r16 adapters", "all7", f"P1b = {t['all7'] / t['base']:.3f} (>= 0.90)"),
    ]
    if "peft_qv" in t:
        rows.append(
            ("HF+PEFT mixed batch, q,v", "peft_qv", f"P2 = ours/PEFT = {t['qv'] / t['peft_qv']:.2f}x (>= 4x)")
        )
    if "distinct5" in t:
        drop = 100 * (1 - t["distinct1000"] / t["distinct5"])
        rows.append(("5 distinct adapters", "distinct5", ""))
        rows.append(("1000 distinct adapters", "distinct1000", f"P4 drop = {drop:.1f}% (<= 3%)"))
    print(f"{'configuration':34} {'out tok/s':>10}  {'passes':24} ratio")
    for label, key, note in rows:
        passes = " ".join(f"{x:.1f}" for x in samples[key])
        print(f"{label:34} {t[key]:10.1f}  {passes:24} {note}")
    print(
        f"P6 resident bytes / tensor bytes, ranks 4-32 mixed: pools {touched:.3f}, RSS growth {grown:.3f} (<= 1.1)"
    )
    if a.json:
        out = {"threads": torch.get_num_threads(), "adapters": a.adapters, "repeats": a.repeats, "tok_s": t}
        out |= {"samples": samples, "p6_pools": touched, "p6_rss": grown}
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
