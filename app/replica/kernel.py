"""LLMKernel: the seed's public API — one resident base model serving many LoRA adapters."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from collections.abc import Sequence as Seq
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from app.config.kernel_config import KernelConfig
from app.config.model_config import ModelConfig
from app.errors import InvalidRequest
from app.names import ModelSpec
from app.replica.adapter_reader import AdapterReader
from app.replica.composition import Composition, Stages
from app.replica.engine import Engine
from app.replica.engine_config import EngineConfig
from app.replica.fairness import make_policy
from app.replica.grammar import Grammars
from app.replica.kernel_adapters import KernelAdapters
from app.replica.kernel_prompts import KernelPrompts, Prompt
from app.replica.lora.dora import BaseWeights
from app.replica.lora.manager import AdapterManager
from app.replica.models import Model, resolve_dtype
from app.replica.output_state import Delta
from app.replica.resources import (
    available_memory,
    generation_eos_ids,
    kv_blocks,
    load_tokenizer,
    resolve_model_path,
)
from app.replica.results import Completion, KernelStats
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams

log = logging.getLogger("loraland.kernel")

# A model id ("a", "a@2", "a|b", "a*0.5+b*0.5"), parsed or not; None = the base model (or the adaptive chain).
AdapterId = str | ModelSpec | None
T = TypeVar("T")


class LLMKernel(KernelAdapters, KernelPrompts):
    """One resident base model serving many LoRA adapters, their chains and merges, in one shared batch. Its
    adapter administration (load, unload, pin, chains, tenant weights) is KernelAdapters
    (app/replica/kernel_adapters.py), its prompt tokenization KernelPrompts (app/replica/kernel_prompts.py).

    `LLMKernel(model_id, config)` or the seed's style, `LLMKernel(model_id, max_adapters=512, ...)`: keyword
    options override `config` (KernelConfig, where every option and its default is documented)."""

    def __init__(
        self, model_id: str | Path, config: KernelConfig | None = None, *, hub: Any = None, **options: Any
    ):
        base = config if config is not None else KernelConfig()
        self.config = cfg = KernelConfig.from_options({**asdict(base), **options}) if options else base
        self.model_id = str(model_id)
        folder = resolve_model_path(model_id)
        self.model_config = mc = ModelConfig.from_folder(folder)
        dev = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        self.dtype = resolve_dtype(cfg.dtype, dev, mc)
        self.model = Model(folder, mc, self.dtype, dev)
        self.tokenizer = load_tokenizer(folder, cfg.chat_template)
        if cfg.max_model_len and cfg.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}"
            )
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        # No token covers more characters than the longest vocabulary entry spells (byte-level and
        # SentencePiece entries spell at least what they decode to), so a longer prompt cannot fit and is refused
        # before tokenizing it: tokenizing 20 MB took ~30 s and ~2 GB that the process kept.
        self.max_prompt_chars = self.max_model_len * max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_lora_rank = cfg.max_lora_rank
        num_kv_blocks = cfg.num_kv_blocks or kv_blocks(
            cfg, mc, self.dtype, self.max_model_len, free=available_memory(dev), weights=self.model.nbytes()
        )
        self.reader = AdapterReader(mc, cfg.max_lora_rank, hub)
        self._versions: dict[str, int] = {}
        self._adapter_lock = threading.Lock()
        self.adapter_manager = AdapterManager(
            mc,
            max_adapters=cfg.max_adapters,
            max_cpu_adapters=cfg.max_cpu_adapters,
            dtype=self.dtype,
            device=self.model.device,
            on_ready=lambda: self.engine.wake(),
            base_weights=BaseWeights(folder),  # DoRA adapters' factors are computed from the checkpoint
            max_saved_module_bytes=cfg.max_saved_module_bytes,
        )
        self.composition = Composition(self.adapter_manager, (self.model_id,))
        self.fairness = make_policy(
            cfg.scheduling_policy, cfg.vtc_prompt_weight, cfg.vtc_output_weight, cfg.vtc_preempt
        )
        self.engine = Engine(
            self.model,
            self.tokenizer,
            EngineConfig(
                max_model_len=self.max_model_len,
                num_kv_blocks=num_kv_blocks,
                block_size=cfg.block_size,
                max_batch_size=cfg.max_batch_size,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_prefix_caching=cfg.enable_prefix_caching,
                max_waiting=cfg.max_waiting,
            ),
            adapters=self.adapter_manager,
            policy=self.fairness,
            eos_token_ids=generation_eos_ids(folder),
        )
        self.engine.start()
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.engine.eos_ids)
        log.info(
            "LLMKernel %s ready: %s on %s, %d KV blocks of %d tokens",
            self.model_id,
            self.dtype,
            dev,
            num_kv_blocks,
            cfg.block_size,
        )

    # ------------------------------------------------------------------ requests
    def set_fault_hook(self, hook: Callable[[Sequence], None] | None) -> None:
        """Tests only: called with each sequence that samples in a step; raising fails that sequence alone."""
        self.engine.fault_hook = hook

    def is_alive(self) -> bool:
        """False once the step loop has died (no request could finish here)."""
        return self.engine.is_alive()

    def _params(self, params: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
        if params is None:
            return SamplingParams.from_kwargs(**sampling)
        if sampling:
            raise InvalidRequest(
                f"give either params or sampling keywords, not both (got {sorted(sampling)})"
            )
        return params

    async def _stages(self, adapter_id: AdapterId) -> Stages:
        stages = self.composition.lookup(adapter_id)
        if stages is None:  # a new merge: building it reads (maybe fetches) and concatenates its terms
            stages = await asyncio.to_thread(self.composition.stages, adapter_id)
        return stages

    async def generate(
        self,
        prompt: Prompt,
        adapter_id: AdapterId = None,
        *,
        tenant: str | None = None,
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Delta]:
        """Stream Deltas for one prompt (abandoning the iterator aborts the request): the one pipeline runner.
        A chain runs its earlier stages to completion, each stage's text the next one's prompt, and streams the
        last one; a response_format shapes the last stage alone. `tenant`: whose request, for fair admission.
        Sampling comes as `params` or as keywords (SamplingParams' fields). Log probabilities (`logprobs`) are
        the streamed stage's; prompt log probabilities are of the caller's prompt under the first stage, and
        arrive with the first delta. A failed sequence raises its error (an app.errors class)."""
        params = self._params(params, sampling)
        ids = await self.tokenize_async(prompt)
        stages = await self._stages(adapter_id)
        grammar = None
        if params.response_format is not None:  # compiled (or found in the cache) off the step loop
            grammar = await asyncio.to_thread(self.grammars.compile, params.response_format)
        n_prompt, first_prompt_logprobs = len(ids), None
        for i, key in enumerate(stages):
            last = i == len(stages) - 1
            stage = params if i == 0 else dataclasses.replace(params, prompt_logprobs=None)
            if not last and stage.response_format is not None:
                stage = dataclasses.replace(stage, response_format=None)
            text = ""
            async for d in self.engine.stream(
                ids, stage, adapter=key, tenant=tenant, grammar=grammar if last else None
            ):
                if d.error is not None:
                    raise d.error
                if not last:
                    text += d.text
                    if d.prompt_logprobs is not None:
                        first_prompt_logprobs = d.prompt_logprobs
                    continue
                d.prompt_tokens = n_prompt
                if i > 0 and first_prompt_logprobs is not None:
                    d.prompt_logprobs, first_prompt_logprobs = first_prompt_logprobs, None
                yield d
            if not last:
                ids = self._stage_output(text, params)

    def _stage_output(self, text: str, params: SamplingParams) -> list[int]:
        """The next stage's prompt: the previous stage's text, tokenized again."""
        nxt = self.tokenize(text) if text else []
        if not nxt:
            raise InvalidRequest("a chain stage produced no text to feed the next stage; raise max_tokens")
        return nxt[-(self.max_model_len - params.max_tokens) :] if len(nxt) >= self.max_model_len else nxt

    def complete(
        self,
        prompts: Seq[Prompt],
        adapter_ids: Seq[AdapterId] | None = None,
        *,
        tenant: str | None = None,
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> list[Completion]:
        """Run every prompt (each under its adapter id) to completion in the shared batch; blocks the caller.
        Every prompt is checked before any runs."""
        if isinstance(prompts, str):
            prompts = [prompts]
        adapter_ids = [None] * len(prompts) if adapter_ids is None else list(adapter_ids)
        if len(adapter_ids) != len(prompts):
            raise InvalidRequest(f"got {len(prompts)} prompts but {len(adapter_ids)} adapter_ids")
        params = self._params(params, sampling)
        ids = [self.tokenize(p) for p in prompts]
        for x in ids:
            self.check(x, params)

        async def one(prompt_ids: list[int], adapter_id: AdapterId) -> Completion:
            c = Completion("", [], "", 0)
            async for d in self.generate(prompt_ids, adapter_id, tenant=tenant, params=params):
                c.add(d)
            return c

        async def run_all() -> list[Completion]:
            return list(await asyncio.gather(*(one(x, a) for x, a in zip(ids, adapter_ids))))

        return _run_blocking(run_all())

    def infer(
        self, prompts: Seq[Prompt], adapter_ids: Seq[AdapterId] | None = None, **sampling: Any
    ) -> list[str]:
        return [c.text for c in self.complete(prompts, adapter_ids, **sampling)]

    def stats(self) -> KernelStats:
        e, m, alloc = self.engine, self.adapter_manager, self.engine.allocator
        return KernelStats(
            resident=tuple(m.resident()),
            in_memory=tuple(m.in_memory()),
            loaded=tuple(m.names()),
            host_cached=m.host_count(),
            free_slots=m.free_slots(),
            queue_len=e.num_waiting(),
            running=len(e.scheduler.running),
            kv_usage=alloc.usage(),
            kv_blocks_used=alloc.num_used,
            kv_blocks_total=alloc.num_blocks,
            prefix_queries=alloc.queries,
            prefix_hits=alloc.hits,
            alora_kv=e.scheduler.alora_kv,
        )

    def close(self) -> None:
        self.engine.stop()

    def __enter__(self) -> LLMKernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end from synchronous code, on an event loop of its own (on a thread of its own
    when the caller is inside a running loop, e.g. a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
