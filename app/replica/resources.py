"""What a kernel starts from: the model folder (local, a converted GGUF, or the Hub cache), its tokenizer and
end tokens, and how many KV-cache blocks the memory budget allows."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from app.config.kernel_config import KernelConfig
from app.config.model_config import ModelConfig
from app.replica.kv_cache import KVCache


def resolve_model_path(model_id: str | Path) -> Path:
    """A local folder as is; a .gguf file (or a folder holding only one) converted once and cached
    (app/replica/gguf_import.py); a packaged model's short name (`smollm2-135m`, `gemma3-270m`); otherwise a Hub
    id through huggingface_hub's cache (HF_HUB_OFFLINE honoured)."""
    from app.replica import gguf_import

    if str(model_id) in gguf_import.PACKAGED:
        return gguf_import.import_packaged(str(model_id))
    p = Path(model_id).expanduser()
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return gguf_import.import_gguf(ggufs[0])
        return p
    if p.suffix.lower() == ".gguf" or p.is_file():
        return gguf_import.import_gguf(p)  # a clear ValueError for a missing, unreadable or foreign file
    if str(model_id).startswith((".", "/", "~")):
        raise ValueError(
            f"model {model_id!r} does not exist: give a Hugging Face model folder, a .gguf file, a Hub id "
            f"or one of {', '.join(gguf_import.PACKAGED)}"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(model_id), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        )
    except Exception as e:
        raise ValueError(
            f"cannot resolve model {model_id!r} as a folder or through the Hugging Face Hub cache: {e}"
        ) from e


def load_tokenizer(folder: Path, chat_template: str | None = None) -> Any:
    """The folder's tokenizer; `chat_template` (a file path or a Jinja template string) replaces its template."""
    # The Rust tokenizers library has no per-tokenizer switch for its thread pool, only this variable, read at
    # each use. transformers sends even one prompt through encode_batch, whose pool (a thread per core) would
    # compete with the step loop's torch threads and make any later fork warn. A caller's own value wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise ValueError(
            f"{folder} has no usable tokenizer ({e}): add tokenizer files to the model folder"
        ) from e
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """A --chat-template value: the text of a file, or the template itself (anything with Jinja markup)."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(
            f"chat_template {value!r} is neither a readable file ({e.strerror}) nor a Jinja template string"
        ) from e


def generation_eos_ids(folder: Path) -> tuple[int, ...]:
    """The end tokens of the folder's generation_config.json (eos_token_id: one id or a list); () if none."""
    path = folder / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from e
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


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
