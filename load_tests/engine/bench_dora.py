"""DoRA vs plain LoRA on workload W (issue 19): throughput (D1, D1k) and resident bytes (D2).
Run: ./run bench dora [--help]. Method and results: load_tests/engine/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from load_tests.harness.adapters import build_named_adapters
from load_tests.harness.inprocess import add_workload_args, interleaved, pick
from load_tests.harness.models import CACHE, bench_model

MARKER = "loraland_bench_dora.json"


def build_dora_adapters(
    model_dir: Path, out_root: Path, n: int, r: int = 16, seed: int = 0
) -> dict[str, Path]:
    """n PEFT DoRA adapters (q,v, rank r) for the bench model: random A and B (std 0.02, like the plain bench
    adapters) and a magnitude perturbed from PEFT's initial ||W||, so that the factor is not 1. Cached."""
    out_root = Path(out_root)
    dirs = {f"dora{i}": out_root / f"dora{i}" for i in range(n)}

    def settings(i: int) -> dict:
        return {
            "model_dir": str(Path(model_dir).resolve()),
            "r": r,
            "seed": seed + i,
            "targets": ["q_proj", "v_proj"],
        }

    def cached(d: Path, s: dict) -> bool:
        try:
            return (d / "adapter_model.safetensors").is_file() and json.loads((d / MARKER).read_text()) == s
        except (OSError, ValueError):
            return False

    todo = [i for i, d in enumerate(dirs.values()) if not cached(d, settings(i))]
    if not todo:
        return dirs
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], use_dora=True, lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(base, cfg)
    params = [(name, p) for name, p in model.named_parameters() if "lora_" in name]
    init = {name: p.detach().clone() for name, p in params if "magnitude" in name}
    for i in todo:
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, p in params:
                if name in init:
                    p.copy_(init[name] * (1 + 0.1 * torch.randn(p.shape, generator=g)))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        d = list(dirs.values())[i]
        d.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        (d / MARKER).write_text(json.dumps(settings(i)))
    return dirs


def load_times(
    model_dir: Path, plain: dict[str, Path], dora: dict[str, Path], n: int = 8
) -> tuple[float, float]:
    """Median ms to load one plain / one DoRA adapter (read, validate, DoRA factors), on a fresh kernel."""
    from loraland import LLMKernel

    out = []
    with LLMKernel(model_dir, max_adapters=8, num_kv_blocks=16) as k:
        for group in (plain, dora):
            ts = []
            for name, path in list(group.items())[:n]:
                t = time.perf_counter()
                k.load_adapter("t-" + name, path)
                ts.append(1e3 * (time.perf_counter() - t))
            out.append(statistics.median(ts))
    return out[0], out[1]


def slot_bytes(model_dir: Path, plain: dict[str, Path], dora: dict[str, Path]) -> tuple[int, int]:
    """Bytes of one device slot of a plain / a DoRA adapter (the pools' per-slot tensors)."""
    from loraland import LLMKernel

    with LLMKernel(model_dir, max_adapters=4, num_kv_blocks=16) as k:
        names = [next(iter(plain)), next(iter(dora))]
        k.load_adapter(names[0], plain[names[0]])
        k.load_adapter(names[1], dora[names[1]])
        k.complete([[5, 6, 7]] * 2, names, max_tokens=1)
        m = k.adapter_manager
        return tuple(m.entries[m.resolve(n)].slot[0].nbytes_per_slot() for n in names)


def apply_cost(model_dir: Path, plain: dict[str, Path], dora: dict[str, Path], reps: int = 30) -> dict:
    """Median thread CPU ms of LoraBatch.apply(layer 0, "qkv") for 16 distinct plain / DoRA adapters."""
    from app.config.model_config import ModelConfig
    from app.replica.lora.dora import BaseWeights
    from app.replica.lora.manager import AdapterManager
    from app.replica.lora.peft_format import read_adapter
    from app.replica.sequence import Sequence
    from app.sampling_params import SamplingParams

    mc = ModelConfig.from_folder(model_dir)
    m = AdapterManager(
        mc, max_adapters=32, max_cpu_adapters=32, dtype=torch.float32, device=torch.device("cpu"),
        base_weights=BaseWeights(model_dir),
    )  # fmt: skip
    shapes = mc.linear_shapes()
    width = shapes["q_proj"][1] + 2 * shapes["k_proj"][1]
    out: dict[str, float] = {}
    try:
        batches = {}
        for kind, group in (("lora", plain), ("dora", dora)):
            seqs = []
            for i, (name, path) in enumerate(list(group.items())[:16]):
                m.register(name, 1, lambda: None, read_adapter(path, mc, name=name))
                seqs.append(Sequence(i, [1], SamplingParams(), adapter=f"{name}@1"))
            assert all(m.admit(s) for s in seqs)
            seqs.sort(key=m.sort_key)
            for phase, per in (("decode", 1), ("prefill", 128)):
                batches[(kind, phase)] = (m.lora_batch([(s, per) for s in seqs]), 16 * per)
        samples: dict = {k: [] for k in batches}
        for _ in range(reps):
            for key, (batch, T) in batches.items():  # interleaved: drifts hit both kinds alike
                x, y = torch.randn(T, mc.hidden_size), torch.randn(T, width)
                t = time.thread_time()
                batch.apply(0, "qkv", x, y)
                samples[key].append(1e3 * (time.thread_time() - t))
        out = {f"{k}_{p}": statistics.median(v) for (k, p), v in samples.items()}
    finally:
        m.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, adapters=200)
    ap.add_argument("--quick", action="store_true", help="16 requests x 16 new tokens, 2 passes")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--kernel-only", action="store_true", help="D1k and D2 only (no end-to-end passes)")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.new, a.repeats = 16, 16, 2
    model_dir = bench_model()
    root = CACHE / "bench-adapters"
    t0 = time.perf_counter()
    plain = build_named_adapters(
        model_dir, root / "qv-r16", a.adapters, r=16, targets=("q_proj", "v_proj"), prefix="qv"
    )
    dora = build_dora_adapters(model_dir, root / "dora-qv-r16", a.adapters)
    print(f"adapters ready in {time.perf_counter() - t0:.1f} s")
    print(
        f"workload W: {a.requests} x {a.prompt_len} prompt + {a.new} new tokens, "
        f"threads={torch.get_num_threads()}, {a.repeats} interleaved passes (medians)"
    )
    n = a.requests
    runs = {"lora": pick(list(plain), n), "dora": pick(list(dora), n)}
    samples = {} if a.kernel_only else interleaved(model_dir, plain | dora, runs, a)
    t = {name: statistics.median(v) for name, v in samples.items()}
    cost = apply_cost(model_dir, plain, dora)
    plain_b, dora_b = slot_bytes(model_dir, plain, dora)
    load_plain, load_dora = load_times(model_dir, plain, dora)
    if t:
        print(f"{'configuration':34} {'out tok/s':>10}  passes")
        for label, key in (
            (f"{a.adapters} plain LoRA q,v r16", "lora"),
            (f"{a.adapters} DoRA q,v r16", "dora"),
        ):
            print(f"{label:34} {t[key]:10.1f}  {' '.join(f'{x:.1f}' for x in samples[key])}")
        print(f"D1 DoRA / LoRA throughput = {t['dora'] / t['lora']:.3f} (>= 0.95)")
    for phase in ("decode", "prefill"):
        lo, do = cost[f"lora_{phase}"], cost[f"dora_{phase}"]
        print(f"D1k apply(q/k/v) CPU ms, {phase}: LoRA {lo:.3f}, DoRA {do:.3f}, DoRA/LoRA time {do / lo:.3f}")
    print(f"D2 resident bytes per slot: LoRA {plain_b}, DoRA {dora_b}, ratio {dora_b / plain_b:.4f}")
    print(f"load time per adapter (median of 8): LoRA {load_plain:.1f} ms, DoRA {load_dora:.1f} ms")
    if a.json:
        out = {"threads": torch.get_num_threads(), "adapters": a.adapters, "repeats": a.repeats, "tok_s": t}
        out |= {"samples": samples, "slot_bytes": {"lora": plain_b, "dora": dora_b}}
        out |= {"load_ms": {"lora": load_plain, "dora": load_dora}, "apply_cpu_ms": cost}
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
