"""LLMKernel: the seed's public API — one resident base model serving many LoRA adapters."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from app.config.model_config import ModelConfig
from app.errors import AdapterUnavailable, InvalidAdapter, InvalidRequest, UnknownAdapter
from app.names import ModelSpec, Term, parse_model
from app.replica.engine import Delta, Engine, EngineConfig
from app.replica.kv_cache import KVCache
from app.replica.lora.manager import AdapterManager
from app.replica.lora.peft_format import LoraWeights, merge_adapters, read_adapter
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
        return Path(
            snapshot_download(str(model_id), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        )
    except Exception as e:
        raise ValueError(
            f"cannot resolve model {model_id!r} as a folder or through the Hugging Face Hub cache: {e}"
        ) from e


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
    def __init__(
        self,
        model_id: str | Path,
        *,
        max_adapters: int = 64,
        max_cpu_adapters: int | None = None,
        max_batch_size: int = 32,
        gpu_memory_utilization: float = 0.9,
        max_lora_rank: int = 64,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        max_waiting: int | None = None,
        hub=None,
    ):
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
            raise ValueError(
                f"{folder} has no usable tokenizer ({e}): add tokenizer files to the model folder"
            ) from e
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if max_model_len and max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        per_block = KVCache.bytes_per_block(
            cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )
        if num_kv_blocks is None:
            budget = int(gpu_memory_utilization * _available_memory(dev)) - self.model.nbytes()
            # More blocks than every running sequence at full length (x2 for the prefix cache) is waste on CPU.
            cap = 2 * max_batch_size * -(-self.max_model_len // block_size)
            num_kv_blocks = min(cap, budget // per_block)
            if num_kv_blocks < 1:
                raise ValueError(
                    "no memory left for the KV cache: raise gpu_memory_utilization or pass num_kv_blocks"
                )
        self.max_lora_rank = max_lora_rank
        self._init_adapters(max_adapters, max_cpu_adapters, hub)
        self.engine = Engine(
            self.model,
            self.tokenizer,
            EngineConfig(
                max_model_len=self.max_model_len,
                num_kv_blocks=num_kv_blocks,
                block_size=block_size,
                max_batch_size=max_batch_size,
                max_num_batched_tokens=max_num_batched_tokens or EngineConfig.max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                max_waiting=max_waiting or 4096,
            ),
            adapters=self.adapter_manager,
        )
        self.engine.start()
        log.info(
            "LLMKernel %s ready: %s on %s, %d KV blocks of %d tokens",
            self.model_id,
            self.dtype,
            dev,
            num_kv_blocks,
            block_size,
        )

    def _init_adapters(self, max_adapters, max_cpu_adapters, hub) -> None:
        self._hub = hub
        self._chain: ModelSpec | None = None
        self._versions: dict[str, int] = {}
        self._adapter_lock = threading.Lock()
        self.adapter_manager = AdapterManager(
            self.model_config,
            max_adapters=max_adapters,
            max_cpu_adapters=max_cpu_adapters,
            dtype=self.dtype,
            device=self.model.device,
            on_ready=lambda: self.engine.wake(),
        )

    # ------------------------------------------------------------------ adapters
    @property
    def hub(self):
        if self._hub is None:
            from app.catalog.sources import AdapterHub

            self._hub = AdapterHub()
        return self._hub

    def _materialize(self, source: str | Path, files: dict[str, str] | None = None) -> Path:
        """A local adapter folder for `source`: a folder as is, s3:// hf:// file:// (or anything with expected
        checksums) through the hub, which verifies and caches it."""
        text = str(source)
        if files or text.startswith(("s3://", "hf://", "file://")):
            return Path(self.hub.fetch(text, files=files))
        p = Path(text).expanduser()
        if not p.is_dir():
            raise InvalidAdapter(
                f"adapter source {text!r} is not a folder nor an s3://, hf:// or file:// URI"
            )
        return p

    def _read(self, source: str | Path, name: str, files: dict[str, str] | None = None) -> LoraWeights:
        t0, c0 = time.perf_counter(), time.thread_time()
        folder = self._materialize(source, files)
        t1, c1 = time.perf_counter(), time.thread_time()
        weights = read_adapter(folder, self.model_config, max_rank=self.max_lora_rank, name=name)
        # Wall and this thread's CPU time: a wide gap means the load waited (network, disk, CPU, GIL).
        log.info(
            "adapter %s: fetched in %.1f ms (%.1f ms CPU), read and validated in %.1f ms (%.1f ms CPU)",
            name,
            (t1 - t0) * 1e3,
            (c1 - c0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
            (time.thread_time() - c1) * 1e3,
        )
        return weights

    def load_adapter(
        self,
        name: str,
        source: str | Path,
        *,
        version: int | None = None,
        files: dict[str, str] | None = None,
    ) -> None:
        """Parse and validate an adapter and make it servable under `name` (a new version if it exists).
        `files` (filename -> sha256) makes the hub verify what it fetches, now and on every re-read.
        Blocks the caller only; requests already running keep decoding."""
        from app.names import check_name

        check_name(name)
        weights = self._read(source, name, files)
        with self._adapter_lock:
            v = version if version is not None else self._versions.get(name, 0) + 1
            self._versions[name] = max(v, self._versions.get(name, 0))

        def reload() -> LoraWeights:
            try:
                return self._read(source, name, files)
            except (InvalidAdapter, AdapterUnavailable):
                raise
            except Exception as e:
                raise AdapterUnavailable(f"re-reading adapter {name!r} from {source}: {e}") from e

        self.adapter_manager.register(name, v, reload, weights)

    def unload_adapter(self, name: str) -> None:
        """Requests already submitted for `name` finish; new ones get UnknownAdapter."""
        try:
            self.adapter_manager.unload(name)
        except KeyError:
            raise UnknownAdapter(f"adapter {name!r} is not loaded; loaded: {self.adapters()}") from None
        if self._chain is not None and name in {t.name for t in self._chain.terms()}:
            self._chain = None

    def pin(self, name: str) -> None:
        self._pin(name, True)

    def unpin(self, name: str) -> None:
        self._pin(name, False)

    def _pin(self, name: str, pinned: bool) -> None:
        try:
            self.adapter_manager.set_pinned(name, pinned)
        except KeyError:
            raise UnknownAdapter(f"adapter {name!r} is not loaded") from None

    def has_adapter(self, name: str) -> bool:
        return self.adapter_manager.resolve(name) is not None

    def adapters(self) -> list[str]:
        return self.adapter_manager.names()

    def set_adaptive_chain(self, names: Seq[str] | None) -> None:
        """Requests that name no adapter run through this chain (also addressable as "a|b"); None clears it."""
        if not names:
            self._chain = None
            return
        spec = parse_model("|".join(names))
        for t in spec.terms():
            self._term_key(t)
        self._chain = spec

    def _term_key(self, t: Term) -> str:
        m = self.adapter_manager
        if t.version is None:
            key = m.resolve(t.name)
        else:
            key = f"{t.name}@{t.version}"
            e = m.entries.get(key)
            key = key if e is not None and not e.retired else None
        if key is None:
            raise UnknownAdapter(f"adapter {t.ref!r} is not loaded on this kernel; loaded: {self.adapters()}")
        return key

    def _stage_key(self, stage: tuple[Term, ...]) -> str:
        """The adapter key serving one stage: the adapter itself, or a merge built as a virtual adapter."""
        if len(stage) == 1:
            return self._term_key(stage[0])
        keys = [self._term_key(t) for t in stage]
        name = "+".join(f"{k}*{t.weight:g}" for k, t in zip(keys, stage))
        m = self.adapter_manager
        with self._adapter_lock:
            if m.resolve(name) is None:

                def build() -> LoraWeights:
                    parts = []
                    for k, t in zip(keys, stage):
                        e = m.entries[k]
                        parts.append((e.weights or e.loader(), t.weight))
                    return merge_adapters(parts, name)

                m.register(name, 1, build, build())
            return m.resolve(name)

    def _stages(self, adapter_id: str | None) -> list[str | None]:
        """Adapter keys, one per pipeline stage (None = base model)."""
        if adapter_id is None:
            spec = self._chain
            if spec is None:
                return [None]
        elif not isinstance(adapter_id, str):
            raise InvalidRequest(f"adapter id must be a string or None, got {type(adapter_id).__name__}")
        else:
            spec = parse_model(adapter_id, (self.model_id,))
        return [self._stage_key(st) for st in spec.stages] or [None]

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False) or self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidRequest("each prompt must be a string or a list of token ids")

    async def generate(
        self, prompt: Prompt, adapter_id: str | None = None, **sampling
    ) -> AsyncIterator[Delta]:
        """Stream Deltas for one prompt (abandoning the iterator aborts the request). A chain runs its
        earlier stages to completion and streams the last one."""
        params = SamplingParams.from_kwargs(**sampling)
        ids = self._prompt_ids(prompt)
        stages = self._stages(adapter_id)
        n_prompt = len(ids)
        for i, key in enumerate(stages):
            last = i == len(stages) - 1
            text = ""
            async for d in self.engine.stream(ids, params, adapter=key, adapter_key=key or ""):
                if d.error:
                    raise self._error(d)
                if last:
                    d.prompt_tokens = n_prompt
                    yield d
                else:
                    text += d.text
            if not last:
                ids = self._stage_output(text, params)

    def complete(
        self, prompts: Seq[Prompt], adapter_ids: Seq[str | None] | None = None, **sampling
    ) -> list[Completion]:
        if isinstance(prompts, str):
            prompts = [prompts]
        adapter_ids = [None] * len(prompts) if adapter_ids is None else list(adapter_ids)
        if len(adapter_ids) != len(prompts):
            raise InvalidRequest(f"got {len(prompts)} prompts but {len(adapter_ids)} adapter_ids")
        params = SamplingParams.from_kwargs(**sampling)
        ids = [self._prompt_ids(p) for p in prompts]
        stages = [self._stages(a) for a in adapter_ids]
        n_prompt = [len(x) for x in ids]
        results: list[Completion | None] = [None] * len(prompts)
        depth = 0
        while True:  # one round per pipeline depth: every prompt's stage `depth` runs in one batch
            todo = [i for i in range(len(prompts)) if depth < len(stages[i])]
            if not todo:
                break
            outs = self._run([(ids[i], stages[i][depth]) for i in todo], params)
            for i, c in zip(todo, outs):
                if depth == len(stages[i]) - 1:
                    c.prompt_tokens = n_prompt[i]
                    results[i] = c
                else:
                    ids[i] = self._stage_output(c.text, params)
            depth += 1
        return results

    def _stage_output(self, text: str, params: SamplingParams) -> list[int]:
        """The next stage's prompt: the previous stage's text, tokenized again."""
        nxt = self._prompt_ids(text) if text else []
        if not nxt:
            raise InvalidRequest("a chain stage produced no text to feed the next stage; raise max_tokens")
        return nxt[-(self.max_model_len - params.max_tokens) :] if len(nxt) >= self.max_model_len else nxt

    @staticmethod
    def _error(d: Delta) -> Exception:
        return AdapterUnavailable(d.error) if d.error_kind == "adapter" else RuntimeError(d.error)

    def _run(self, jobs, params: SamplingParams) -> list[Completion]:
        done = threading.Semaphore(0)
        # [token ids, finish reason, prompt tokens, error, text]: the engine's deltas already carry the text
        # with stop strings and stop tokens applied, so nothing is decoded twice.
        results: list[list] = [[[], None, 0, None, ""] for _ in jobs]

        def collector(i: int):
            def on_delta(d: Delta) -> None:
                r = results[i]
                r[0].extend(d.token_ids)
                r[4] += d.text
                r[2] = d.prompt_tokens
                if d.finish_reason is not None:
                    r[1], r[3] = d.finish_reason, (d.error, d.error_kind) if d.error else None
                    done.release()

            return on_delta

        for i, (ids, key) in enumerate(jobs):
            self.engine.add(ids, params, collector(i), adapter=key, adapter_key=key or "")
        for _ in jobs:
            done.acquire()
        out = []
        for ids, reason, n_prompt, error, text in results:
            if error:
                raise self._error(Delta("", [], reason, n_prompt, 0, error[0], error[1]))
            out.append(Completion(text, ids, reason, n_prompt))
        return out

    def infer(
        self, prompts: Seq[Prompt], adapter_ids: Seq[str | None] | None = None, **sampling
    ) -> list[str]:
        return [c.text for c in self.complete(prompts, adapter_ids, **sampling)]

    def stats(self) -> dict:
        e, m = self.engine, self.adapter_manager
        return {
            "resident": m.resident(),
            "free_slots": m.free_slots(),
            "queue_len": e.num_waiting(),
            "running": len(e.scheduler.running),
            "kv_usage": e.allocator.usage(),
            "loaded": m.names(),
        }

    def close(self) -> None:
        self.engine.stop()

    def __enter__(self) -> LLMKernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
