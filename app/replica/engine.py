"""The step loop (schedule -> forward -> sample) on its own thread, and an asyncio front that streams deltas."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import torch

from app.errors import AdapterUnavailable, InternalError, LoraLandError, QueueFull
from app.replica.batch_builder import BatchBuilder, PromptRows
from app.replica.engine_config import EngineConfig, check_request
from app.replica.fairness import AdmissionPolicy
from app.replica.grammar import GrammarState
from app.replica.kv_cache import BlockAllocator, KVCache
from app.replica.logprobs import SampleLogprobs, prompt_logprobs
from app.replica.lora.null import AdapterHooks, NullAdapters
from app.replica.memory import keep_freed_memory
from app.replica.models import Model
from app.replica.outputs import Delta, OutputProcessor
from app.replica.row_failure import row_error, scrub_kv
from app.replica.sampling import NonFiniteLogits, sample_with_logprobs
from app.replica.scheduler import Scheduler, SchedulerConfig
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams

log = logging.getLogger("loraland.engine")


class Engine:
    """Requests enter through `add` (any thread); one thread runs `step()` while there is work."""

    # Tests only: called with each sequence that samples in a step, inside that step's sampling; raising fails
    # that sequence alone (the fault-isolation tests inject a fault into one row this way). None costs nothing.
    fault_hook: Callable[[Sequence], None] | None = None

    def __init__(
        self,
        model: Model,
        tokenizer,
        config: EngineConfig,
        adapters: AdapterHooks = NullAdapters(),
        policy: AdmissionPolicy | None = None,  # admission between tenants; None: first come first served
        eos_token_ids: Iterable[int] = (),  # end tokens beyond config.json's (generation_config.json's)
    ):
        self.model, self.tok, self.cfg, self.adapters = model, tokenizer, config, adapters
        if model.device.type == "cpu":
            keep_freed_memory()  # each step's temporaries reuse the last step's pages instead of faulting in
        c = model.cfg
        # LongRoPE models: K/V depend on the sequence's final length, not only its prefix (no prefix cache)
        caching = config.enable_prefix_caching and model.prefix_cache_safe
        # one pool of blocks for every KV group (app/replica/kv_layout.py): sliding-window layers' blocks go
        # back to it once behind the window; num_kv_blocks is the memory of that many blocks of every layer
        self.layout = model.kv_layout
        self.num_blocks = self.layout.pool_blocks(config.num_kv_blocks, c.num_layers)
        self.allocator = BlockAllocator(self.num_blocks, config.block_size, caching)
        self.kv = KVCache(
            self.layout.width,
            self.num_blocks,
            config.block_size,
            c.num_kv_heads,
            c.head_dim,
            model.dtype,
            model.device,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_batch_size, config.max_num_batched_tokens, config.block_size),
            self.allocator,
            admit=self.adapters.admit,
            release=self.adapters.release,
            policy=policy,
            stale_kv=model.stale_kv,
            layout=self.layout,
        )
        self.builder = BatchBuilder(config.block_size, model.device, self.adapters, self.layout)
        # every end token the model may emit: config.json's, generation_config.json's (a list in chat models,
        # e.g. Gemma's <eos> and <end_of_turn>) and the tokenizer's
        eos = set(c.eos_token_ids) | set(eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.outputs = OutputProcessor(tokenizer, eos, config.max_model_len)
        self.eos_ids = frozenset(eos)  # what min_tokens masks (with each request's stop_token_ids)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._stop = False

    # ------------------------------------------------------------------ submission (any thread)
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest (naming what to change) if this prompt with these parameters cannot run here."""
        check_request(prompt_ids, params, self.cfg, self.model.cfg.vocab_size, self.layout)

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_delta: Callable[[Delta], None],
        *,
        adapter: str | None = None,
        tenant: str | None = None,
        grammar: Any = None,
    ) -> Sequence:
        """Queue a request; `adapter` is the adapter manager's key (None = base model), `tenant` whose request it
        is for fair admission (None = the anonymous tenant), `grammar` the compiled response_format grammar
        (compiled by the caller, off the step loop: app/replica/grammar.py)."""
        if (grammar is None) != (params.response_format is None):
            raise ValueError("a response_format needs its compiled grammar, and only it")
        self.check(prompt_ids, params)
        seq = Sequence(
            next(self._ids),
            list(prompt_ids),
            params,
            adapter=adapter,
            arrival=time.monotonic(),
            tenant=tenant,
        )
        seq.output = self.outputs.state(params, on_delta)
        if grammar is not None:
            seq.sampler.grammar = GrammarState.of(grammar)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [SampleLogprobs(seq.prompt_ids[0], None)]
        with self._lock:
            if len(self._inbox) + len(self.scheduler.waiting) >= self.cfg.max_waiting:
                raise QueueFull(
                    f"the replica's queue is full ({self.cfg.max_waiting} waiting): retry shortly"
                )
            if adapter is not None:
                self.adapters.submitted(adapter)
            self._inbox.append(seq)
            self._wake.notify()
        return seq

    def abort(self, seq: Sequence) -> None:
        with self._lock:
            self._aborts.append(seq)
            self._wake.notify()

    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="loraland-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        """False once the step loop's thread has died (no request could finish here)."""
        return self._thread is None or self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self._inbox or self._aborts or self.scheduler.has_work()):
                    self._wake.wait()
                if self._stop:
                    break
            try:
                if not self.step():
                    # only cold adapters are waiting: sleep until a load lands or input arrives
                    with self._lock:
                        self._wake.wait(timeout=0.005)
            except Exception as e:  # never let one bad batch kill the loop
                # Only a step-wide failure lands here (building the batch, the forward pass, the scheduler):
                # no row of it has logits, so every running sequence fails. Anything one row can cause
                # (non-finite logits, an error drawing its token) fails that sequence alone in `step`.
                log.exception("engine step failed")
                self._fail_running(f"internal error in the engine step: {e}")
        self.adapters.close()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, "abort")

    def wake(self) -> None:
        with self._lock:
            self._wake.notify()

    def _drain(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for seq in new:
            self.scheduler.add(seq)
        for seq in aborts:
            if not seq.is_finished:
                self._finish(seq, "abort")

    def step(self) -> bool:
        """One iteration; returns False when nothing could run."""
        self._drain()
        failed = self.adapters.poll()
        for seq in [s for s in self.scheduler.waiting if s.adapter in failed]:
            message = f"adapter {seq.adapter} could not be loaded: {failed[seq.adapter]}"
            self._finish(seq, "abort", AdapterUnavailable(message))
        batch = self.scheduler.schedule()
        if not batch.items:
            return False
        fb, sampled_items, prompt_rows = self.builder.build(batch)
        logits = self.model.forward(fb, self.kv)
        if prompt_rows:
            self._prompt_logprobs(logits[len(sampled_items) :], prompt_rows)
            logits = logits[: len(sampled_items)]
        hook = self.fault_hook
        tokens, logprobs = sample_with_logprobs(
            logits,
            [it.seq.params for it in sampled_items],
            [it.seq.sampler for it in sampled_items],
            None if hook is None else lambda i: hook(sampled_items[i].seq),
            histories=[(it.seq.prompt_ids, it.seq.output_ids) for it in sampled_items],
            stop_ids=self.eos_ids,
        )
        broken = {id(it.seq) for it, tok in zip(sampled_items, tokens) if isinstance(tok, Exception)}
        if broken:  # those sequences end here: nothing of this step is theirs to commit
            batch.items = [it for it in batch.items if id(it.seq) not in broken]
        self.scheduler.commit(batch)
        for it, tok, lp in zip(sampled_items, tokens, logprobs):
            if isinstance(tok, Exception):
                self._fail_row(it.seq, tok)
            else:
                self._append(it.seq, tok, lp)
        return True

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list[PromptRows]) -> None:
        """Append the prompt log probabilities these logits rows give to their sequences."""
        next_ids, ks = [], []
        for r in rows:
            next_ids += r.seq.prompt_ids[r.lo + 1 : r.hi + 1]
            ks += [r.seq.params.prompt_logprobs] * (r.hi - r.lo)
        out = prompt_logprobs(logits, next_ids, ks)
        at = 0
        for r in rows:
            r.seq.prompt_logprobs.extend(out[at : at + r.hi - r.lo])
            at += r.hi - r.lo

    def _fail_row(self, seq: Sequence, exc: Exception) -> None:
        """One sequence of the batch failed; the others carry on untouched."""
        if isinstance(exc, NonFiniteLogits):
            # Its KV may hold inf/NaN too. Attention reads stale slots of reused blocks under a mask, and
            # 0 * inf is NaN, so clear the non-finite values before its blocks go back to the pool.
            scrub_kv(self.kv, seq.live_blocks(), self.model.device)
        self._finish(seq, "abort", row_error(seq, exc))

    # ------------------------------------------------------------------ outputs
    def _append(self, seq: Sequence, tok: int, logprobs: SampleLogprobs | None = None) -> None:
        delta = self.outputs.append(seq, tok, logprobs)
        if delta.finish_reason is not None:
            self.scheduler.finish(seq, delta.finish_reason)
            self.adapters.finished(seq)
        seq.output.on_delta(delta)

    def _finish(self, seq: Sequence, reason: str, error: LoraLandError | None = None) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq, reason)
        self.adapters.finished(seq)
        seq.output.on_delta(Delta("", [], reason, len(seq.prompt_ids), len(seq.output_ids), error))

    def _fail_running(self, message: str) -> None:
        for seq in list(self.scheduler.running):  # one exception each: each is raised in its own consumer
            self._finish(seq, "abort", InternalError(message))

    # ------------------------------------------------------------------ asyncio front
    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        tenant: str | None = None,
        grammar: Any = None,
    ) -> AsyncIterator[Delta]:
        """The request's deltas, the last one with a finish_reason; closing the iterator early aborts it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta] = asyncio.Queue()

        def push(d: Delta) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, d)
            except RuntimeError:  # the consumer's loop is gone
                pass

        seq = self.add(prompt_ids, params, push, adapter=adapter, tenant=tenant, grammar=grammar)
        done = False
        try:
            while not done:
                d = await q.get()
                done = d.finish_reason is not None
                yield d
        finally:
            if not done:  # the consumer went away: free the sequence's blocks
                self.abort(seq)
