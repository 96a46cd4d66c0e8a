"""LLMKernel: the seed's public API — one resident base model serving many LoRA adapters."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from app.errors import InvalidRequest
from app.model_config import ModelConfig
from app.replica.engine import Delta, Engine, EngineConfig
from app.replica.kv_cache import KVCache
from app.replica.model import Model, resolve_dtype
from app.replica.sampling import SamplingParams

log = logging.getLogger("loraland.kernel")

Prompt = str | list[int]


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


def resolve_model_path(model_id: str | Path) -> Path:
    """A local folder as is; otherwise a Hub id through huggingface_hub's cache (HF_HUB_OFFLINE honoured)."""
    p = Path(model_id).expanduser()
    if p.is_dir():
        return p
    if p.exists() or str(model_id).startswith((".", "/", "~")):
        raise ValueError(f"model {model_id!r} is not a folder: give a Hugging Face model folder or Hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model_id), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:
        raise ValueError(f"cannot resolve model {model_id!r} as a folder or through the Hugging Face Hub "
                         f"cache: {e}") from e


def _available_memory(device: torch.device) -> int:
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


class LLMKernel:
    def __init__(self, model_id: str | Path, *, max_adapters: int = 64, max_cpu_adapters: int | None = None,
                 max_batch_size: int = 32, gpu_memory_utilization: float = 0.9, max_lora_rank: int = 64,
                 dtype: str | torch.dtype = "auto", device: str = "auto", max_model_len: int | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 max_waiting: int | None = None, hub=None):
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.model_id = str(model_id)
        folder = resolve_model_path(model_id)
        self.model_config = cfg = ModelConfig.from_folder(folder)
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        self.dtype = resolve_dtype(dtype, dev, cfg)
        self.model = Model(folder, cfg, self.dtype, dev)
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as e:
            raise ValueError(f"{folder} has no usable tokenizer ({e}): add tokenizer files to the model folder") from e
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if max_model_len and max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        per_block = KVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        if num_kv_blocks is None:
            budget = int(gpu_memory_utilization * _available_memory(dev)) - self.model.nbytes()
            # More blocks than every running sequence at full length (x2 for the prefix cache) is waste on CPU.
            cap = 2 * max_batch_size * -(-self.max_model_len // block_size)
            num_kv_blocks = min(cap, budget // per_block)
            if num_kv_blocks < 1:
                raise ValueError("no memory left for the KV cache: raise gpu_memory_utilization or pass num_kv_blocks")
        self.max_lora_rank = max_lora_rank
        self.adapter_manager = None
        self._init_adapters(max_adapters, max_cpu_adapters, hub)
        self.engine = Engine(
            self.model, self.tokenizer,
            EngineConfig(
                max_model_len=self.max_model_len, num_kv_blocks=num_kv_blocks, block_size=block_size,
                max_batch_size=max_batch_size,
                max_num_batched_tokens=max_num_batched_tokens or 2048,
                enable_prefix_caching=enable_prefix_caching, max_waiting=max_waiting or 4096),
            adapters=self.adapter_manager,
        )
        self.engine.start()
        log.info("LLMKernel %s ready: %s on %s, %d KV blocks of %d tokens", self.model_id, self.dtype, dev,
                 num_kv_blocks, block_size)

    def _init_adapters(self, max_adapters, max_cpu_adapters, hub) -> None:
        self._hub = hub

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False) or self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidRequest("each prompt must be a string or a list of token ids")

    def _route(self, adapter_id: str | None) -> tuple[str | None, str]:
        if adapter_id is not None:
            raise InvalidRequest("adapters are not available in this kernel build")
        return None, ""

    def generate(self, prompt: Prompt, adapter_id: str | None = None, **sampling) -> AsyncIterator[Delta]:
        """Stream Deltas for one prompt (an async iterator; abandoning it aborts the request)."""
        params = SamplingParams.from_kwargs(**sampling)
        ids = self._prompt_ids(prompt)
        adapter, key = self._route(adapter_id)
        return self.engine.stream(ids, params, adapter=adapter, adapter_key=key)

    def complete(self, prompts: Seq[Prompt], adapter_ids: Seq[str | None] | None = None,
                 **sampling) -> list[Completion]:
        if isinstance(prompts, str):
            prompts = [prompts]
        adapter_ids = [None] * len(prompts) if adapter_ids is None else list(adapter_ids)
        if len(adapter_ids) != len(prompts):
            raise InvalidRequest(f"got {len(prompts)} prompts but {len(adapter_ids)} adapter_ids")
        params = SamplingParams.from_kwargs(**sampling)
        jobs = [(self._prompt_ids(p), *self._route(a)) for p, a in zip(prompts, adapter_ids)]
        return self._run(jobs, params)

    def _run(self, jobs, params: SamplingParams) -> list[Completion]:
        done = threading.Semaphore(0)
        results: list[list] = [[[], None, 0, None] for _ in jobs]

        def collector(i: int):
            def on_delta(d: Delta) -> None:
                r = results[i]
                r[0].extend(d.token_ids)
                r[2] = d.prompt_tokens
                if d.finish_reason is not None:
                    r[1], r[3] = d.finish_reason, d.error
                    done.release()
            return on_delta

        for i, (ids, adapter, key) in enumerate(jobs):
            self.engine.add(ids, params, collector(i), adapter=adapter, adapter_key=key)
        for _ in jobs:
            done.acquire()
        out = []
        for ids, reason, n_prompt, error in results:
            if error:
                raise RuntimeError(error)
            shown = ids[:-1] if reason == "stop" and ids and self._is_stop_token(ids[-1], params) else ids
            text = self.tokenizer.decode(shown, skip_special_tokens=True)
            for s in params.stop:
                if (j := text.find(s)) >= 0:
                    text = text[:j]
            out.append(Completion(text, ids, reason, n_prompt))
        return out

    def _is_stop_token(self, tok: int, params: SamplingParams) -> bool:
        return tok in params.stop_token_ids or (not params.ignore_eos and tok in self.engine.eos_ids)

    def infer(self, prompts: Seq[Prompt], adapter_ids: Seq[str | None] | None = None, **sampling) -> list[str]:
        return [c.text for c in self.complete(prompts, adapter_ids, **sampling)]

    def stats(self) -> dict:
        e = self.engine
        return {"resident": [], "free_slots": 0, "queue_len": e.num_waiting(), "running": len(e.scheduler.running),
                "kv_usage": e.allocator.usage(), "loaded": []}

    def close(self) -> None:
        self.engine.stop()

    def __enter__(self) -> LLMKernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
