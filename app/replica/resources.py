"""What a kernel starts from: the model folder (local or the Hub cache), its tokenizer, and how many KV-cache
blocks the memory budget allows."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from app.config.kernel_config import KernelConfig
from app.config.model_config import ModelConfig
from app.replica.kv_cache import KVCache


def resolve_model_path(model_id: str | Path) -> Path:
    """A local folder as is; otherwise a Hub id through huggingface_hub's cache (HF_HUB_OFFLINE honoured)."""
    p = Path(model_id).expanduser()
    if p.is_dir():
        return p
    if p.exists() or str(model_id).startswith((".", "/", "~")):
        raise ValueError(f"model {model_id!r} is not a folder: give a Hugging Face model folder or Hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(str(model_id), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        )
    except Exception as e:
        raise ValueError(
            f"cannot resolve model {model_id!r} as a folder or through the Hugging Face Hub cache: {e}"
        ) from e


def load_tokenizer(folder: Path) -> Any:
    # The Rust tokenizers library has no per-tokenizer switch for its thread pool, only this variable, read at
    # each use. transformers sends even one prompt through encode_batch, whose pool (a thread per core) would
    # compete with the step loop's torch threads and make any later fork warn. A caller's own value wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise ValueError(
            f"{folder} has no usable tokenizer ({e}): add tokenizer files to the model folder"
        ) from e


def available_memory(device: torch.device) -> int:
    """Free device memory on CUDA; MemAvailable on CPU (8 GiB when /proc/meminfo cannot be read)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_blocks(
    cfg: KernelConfig, mc: ModelConfig, dtype: torch.dtype, max_model_len: int, *, free: int, weights: int
) -> int:
    """As many KV blocks as fit in gpu_memory_utilization of the `free` bytes once the `weights` (bytes,
    already loaded) are counted, capped by what the running sequences can use."""
    per_block = KVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype)
    # More blocks than every running sequence at full length (x2 for the prefix cache) is waste on CPU.
    cap = 2 * cfg.max_batch_size * -(-max_model_len // cfg.block_size)
    n = min(cap, (int(cfg.gpu_memory_utilization * free) - weights) // per_block)
    if n < 1:
        raise ValueError(
            "no memory left for the KV cache: raise gpu_memory_utilization or pass num_kv_blocks"
        )
    return n
