"""LLMKernel: the seed's public API — one resident base model serving many LoRA adapters."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from app.config.kernel_config import KernelConfig
from app.config.model_config import ModelConfig
from app.errors import InvalidRequest, UnknownAdapter
from app.names import check_name
from app.protocol import Failure
from app.replica.adapter_reader import AdapterReader
from app.replica.composition import Composition
from app.replica.engine import Delta, Engine, EngineConfig
from app.replica.fairness import make_policy
from app.replica.grammar import Grammars
from app.replica.logprobs import SampleLogprobs
from app.replica.lora.dora import BaseWeights
from app.replica.lora.manager import AdapterManager
from app.replica.memory import release_free_memory
from app.replica.model import Model, resolve_dtype
from app.replica.resources import available_memory, kv_blocks, load_tokenizer, resolve_model_path
from app.replica.sampling import SamplingParams

log = logging.getLogger("loraland.kernel")

Prompt = str | list[int]
LONG_PROMPT_CHARS = 4096  # generate() tokenizes prompts longer than this off the event loop
TRIM_AFTER_CHARS = 1 << 18  # after tokenizing a longer prompt, hand freed heap pages back (memory.py)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[SampleLogprobs] | None = None  # one per token id, when asked (sampling's `logprobs`)
    prompt_logprobs: list[SampleLogprobs] | None = None  # one per prompt token (`prompt_logprobs`)


class LLMKernel:
    """One resident base model serving many LoRA adapters, their chains and merges, in one shared batch.

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
        self.tokenizer = load_tokenizer(folder)
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

    # ------------------------------------------------------------------ adapters
    @property
    def hub(self) -> Any:
        return self.reader.hub

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
        check_name(name)
        weights = self.reader.read(source, name, files)
        with self._adapter_lock:
            v = version if version is not None else self._versions.get(name, 0) + 1
            self._versions[name] = max(v, self._versions.get(name, 0))
        self.adapter_manager.register(name, v, self.reader.loader(source, name, files), weights)

    def unload_adapter(self, name: str) -> None:
        """Requests already submitted for `name` finish; new ones get UnknownAdapter."""
        try:
            self.adapter_manager.unload(name)
        except KeyError:
            raise UnknownAdapter(f"adapter {name!r} is not loaded; loaded: {self.adapters()}") from None
        self.composition.forget(name)

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

    def set_tenant_weights(self, weights: Mapping[str | None, float]) -> None:
        """Replace the tenants' shares under the "vtc" policy (tenant -> positive weight; one not named weighs 1,
        None is the anonymous tenant): weight 2 gets twice the tokens of weight 1 while both wait."""
        self.fairness.set_weights(weights)

    def set_adaptive_chain(self, names: Seq[str] | None) -> None:
        """Requests that name no adapter run through this chain (also addressable as "a|b"); None clears it."""
        self.composition.set_chain(names)

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise InvalidRequest(
                    f"the prompt has {len(prompt)} characters: more than max_model_len ({self.max_model_len} "
                    f"tokens) can hold with this tokenizer (at most {self.max_prompt_chars} characters); "
                    "shorten it"
                )
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) or self.tokenizer.encode(prompt)
            if len(prompt) > TRIM_AFTER_CHARS:
                release_free_memory()
            return ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidRequest("each prompt must be a string or a list of token ids")

    @staticmethod
    def _stage_params(params: SamplingParams, grammar: Any, last: bool) -> tuple[SamplingParams, Any]:
        """A chain's response_format shapes its last stage's output alone (earlier stages feed prompts)."""
        if last or params.response_format is None:
            return params, grammar
        return dataclasses.replace(params, response_format=None), None

    async def generate(
        self, prompt: Prompt, adapter_id: str | None = None, *, tenant: str | None = None, **sampling
    ) -> AsyncIterator[Delta]:
        """Stream Deltas for one prompt (abandoning the iterator aborts the request). A chain runs its
        earlier stages to completion and streams the last one. `tenant`: whose request, for fair admission.
        Log probabilities (`logprobs`) are the streamed stage's; prompt log probabilities (`prompt_logprobs`)
        are of the caller's prompt under the first stage, and arrive with the first delta."""
        params = SamplingParams.from_kwargs(**sampling)
        later = (
            dataclasses.replace(params, prompt_logprobs=None)
            if params.prompt_logprobs is not None
            else params
        )
        first_prompt_logprobs = None
        # A long prompt is tokenized on a worker thread (the fast tokenizer releases the GIL), so the caller's
        # event loop keeps serving; a short one costs less than the thread hop.
        long = isinstance(prompt, str) and len(prompt) > LONG_PROMPT_CHARS
        ids = await asyncio.to_thread(self._prompt_ids, prompt) if long else self._prompt_ids(prompt)
        stages = self.composition.lookup(adapter_id)
        if stages is None:  # a new merge: building it reads (maybe fetches) and concatenates its terms
            stages = await asyncio.to_thread(self.composition.stages, adapter_id)
        grammar = None
        if params.response_format is not None:  # compiled (or found in the cache) off the step loop
            grammar = await asyncio.to_thread(self.grammars.compile, params.response_format)
        n_prompt = len(ids)
        for i, key in enumerate(stages):
            last = i == len(stages) - 1
            text = ""
            stage, g = self._stage_params(params if i == 0 else later, grammar, last)
            async for d in self.engine.stream(ids, stage, adapter=key, tenant=tenant, grammar=g):
                if d.failure is not None:
                    raise d.failure.to_exception()
                if i == 0 and not last and d.prompt_logprobs is not None:
                    first_prompt_logprobs = d.prompt_logprobs
                if last:
                    d.prompt_tokens = n_prompt
                    if i > 0 and first_prompt_logprobs is not None:
                        d.prompt_logprobs, first_prompt_logprobs = first_prompt_logprobs, None
                    yield d
                else:
                    text += d.text
            if not last:
                ids = self._stage_output(text, params)

    def complete(
        self,
        prompts: Seq[Prompt],
        adapter_ids: Seq[str | None] | None = None,
        *,
        tenant: str | None = None,
        **sampling,
    ) -> list[Completion]:
        if isinstance(prompts, str):
            prompts = [prompts]
        adapter_ids = [None] * len(prompts) if adapter_ids is None else list(adapter_ids)
        if len(adapter_ids) != len(prompts):
            raise InvalidRequest(f"got {len(prompts)} prompts but {len(adapter_ids)} adapter_ids")
        params = SamplingParams.from_kwargs(**sampling)
        later = (
            dataclasses.replace(params, prompt_logprobs=None)
            if params.prompt_logprobs is not None
            else params
        )
        ids = [self._prompt_ids(p) for p in prompts]
        stages = [self.composition.stages(a) for a in adapter_ids]
        grammar = None if params.response_format is None else self.grammars.compile(params.response_format)
        n_prompt = [len(x) for x in ids]
        results: list[Completion | None] = [None] * len(prompts)
        first_prompt_logprobs: list[list[SampleLogprobs] | None] = [None] * len(prompts)
        depth = 0
        while True:  # one round per pipeline depth: every prompt's stage `depth` runs in one batch
            todo = [i for i in range(len(prompts)) if depth < len(stages[i])]
            if not todo:
                break
            base = params if depth == 0 else later
            jobs = [
                (ids[i], stages[i][depth], *self._stage_params(base, grammar, depth == len(stages[i]) - 1))
                for i in todo
            ]
            outs = self._run(jobs, tenant)
            for i, c in zip(todo, outs):
                if depth == 0:
                    first_prompt_logprobs[i] = c.prompt_logprobs
                if depth == len(stages[i]) - 1:
                    c.prompt_tokens = n_prompt[i]
                    c.prompt_logprobs = first_prompt_logprobs[i]  # the caller's prompt, under the first stage
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

    def _run(
        self, jobs: list[tuple[list[int], str | None, SamplingParams, Any]], tenant: str | None = None
    ) -> list[Completion]:
        """Run prompts (each under its adapter key, with its params and compiled grammar or None) in the shared
        batch; block until all have finished."""
        done = threading.Semaphore(0)
        results = [Completion("", [], "", 0) for _ in jobs]
        failures: list[Failure | None] = [None] * len(jobs)

        def collector(i: int) -> Callable[[Delta], None]:
            def on_delta(d: Delta) -> None:
                # The engine's deltas carry text with stop strings and stop tokens applied: no second decode.
                c = results[i]
                c.token_ids.extend(d.token_ids)
                c.text += d.text
                c.prompt_tokens = d.prompt_tokens
                if d.logprobs is not None:
                    c.logprobs = (c.logprobs or []) + d.logprobs
                if d.prompt_logprobs is not None:
                    c.prompt_logprobs = d.prompt_logprobs
                if d.finish_reason is not None:
                    c.finish_reason, failures[i] = d.finish_reason, d.failure
                    done.release()

            return on_delta

        for i, (ids, key, params, grammar) in enumerate(jobs):
            self.engine.add(ids, params, collector(i), adapter=key, tenant=tenant, grammar=grammar)
        for _ in jobs:
            done.acquire()
        for f in failures:
            if f is not None:
                raise f.to_exception()
        return results

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
            "in_memory": _in_memory(m),
        }

    def close(self) -> None:
        self.engine.stop()

    def __enter__(self) -> LLMKernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _in_memory(m: Any) -> list[str]:
    """Names whose live version is in host memory, a device slot, or being read back in: what a request can
    use without fetching again. The registry keeps every adapter ever registered (its loader re-reads it
    after the host LRU drops it), so `loaded` never shrinks; routers must see this instead. `list()` copies
    the dict in one step under the GIL, so the engine thread's changes cannot break the iteration."""
    entries = list(getattr(m, "entries", {}).values())
    return sorted(
        {
            e.name
            for e in entries
            if not e.retired and (e.weights is not None or e.slot is not None or e.loading is not None)
        }
    )
