"""Multi-LoRA cost on workload W (issue 3): P1, P1b, P2, P4, P6 in one run.
Run: ./run bench lora [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from load_tests.harness.adapters import ALL_SEVEN, build_named_adapters
from load_tests.harness.inprocess import add_workload_args, generate_tok_s, interleaved, pick, rss
from load_tests.harness.models import CACHE, bench_model, workload_w


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
            build_named_adapters(model_dir, root / f"mixed-r{r}", 8, r=r, seed=100 + r, prefix=f"m{r}-")
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
    add_workload_args(ap, adapters=200)
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--skip-p4", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    model_dir = bench_model()
    root = CACHE / "bench-adapters"
    qv = build_named_adapters(
        model_dir, root / "qv-r16", a.adapters, r=16, targets=("q_proj", "v_proj"), prefix="qv"
    )
    all7 = build_named_adapters(
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
        many = build_named_adapters(
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
