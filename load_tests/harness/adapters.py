"""Random rank-r PEFT LoRA adapters for the bench model (load_tests/harness/models.py), saved by peft itself.

    python -m load_tests.harness.adapters --model-dir DIR --out-root DIR -n 200 [--rank 16] [--targets q_proj,v_proj]

Folders are OUT_ROOT/{prefix}{i} (qv0 .. qv199 by default), each adapter_config.json + adapter_model.safetensors.
Both A and B are random (peft would start B at zero, an adapter that changes nothing and that a server could
skip), so every adapter really computes. Cached: a folder made with the same settings is not rebuilt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

MARKER = "loraland_bench_adapter.json"
ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_bench_adapters(
    model_dir: Path,
    out_root: Path,
    n: int,
    r: int = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    prefix: str = "qv",
    alpha: int | None = None,
) -> list[Path]:
    """n PEFT adapter folders under out_root for the model in model_dir; returns their paths in order."""
    out_root = Path(out_root)
    dirs = [out_root / f"{prefix}{i}" for i in range(n)]

    def settings(i: int) -> dict:
        return {
            "model_dir": str(Path(model_dir).resolve()),
            "r": r,
            "alpha": alpha or 2 * r,
            "targets": sorted(targets),
            "seed": seed + i,
        }

    todo = [i for i, d in enumerate(dirs) if not _cached(d, settings(i))]
    if not todo:
        return dirs
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha or 2 * r,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, cfg)
    lora = [(name, p) for name, p in model.named_parameters() if "lora_" in name]
    for i in todo:
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for _, p in lora:
                # std chosen so the delta is comparable to the 0.02-std base weights, not a no-op
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        dirs[i].mkdir(parents=True, exist_ok=True)
        model.save_pretrained(dirs[i], safe_serialization=True)
        (dirs[i] / MARKER).write_text(json.dumps(settings(i)))
    return dirs


def build_named_adapters(model_dir: Path, root: Path, n: int, **kw) -> dict[str, Path]:
    """build_bench_adapters keyed by folder name (alpha 32 unless given): what a kernel loads them as."""
    return {p.name: p for p in build_bench_adapters(model_dir, root, n, alpha=kw.pop("alpha", 32), **kw)}


def bench_assets(n: int) -> tuple[Path, Path]:
    """The bench model and a store of n rank-16 q,v adapters qv0.. (workload W's), both cached."""
    from load_tests.harness.models import CACHE, bench_model

    model_dir = bench_model()
    store = CACHE / "bench-adapters" / "qv-r16"
    build_bench_adapters(model_dir, store, n, r=16, targets=("q_proj", "v_proj"), prefix="qv")
    return model_dir, store


def _cached(d: Path, settings: dict) -> bool:
    try:
        return (d / "adapter_model.safetensors").is_file() and json.loads(
            (d / MARKER).read_text()
        ) == settings
    except (OSError, ValueError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out-root", type=Path, required=True)
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--prefix", default="qv")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    for d in build_bench_adapters(
        a.model_dir, a.out_root, a.n, a.rank, tuple(a.targets.split(",")), a.seed, a.prefix
    ):
        print(d)


if __name__ == "__main__":
    main()
