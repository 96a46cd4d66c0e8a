"""The step loop (schedule -> forward -> sample) on its own thread, and an asyncio front that streams deltas."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from app.errors import InvalidRequest, QueueFull
from app.replica.kv_cache import BlockAllocator, KVCache
from app.replica.model import ForwardBatch, Model, PrefillAttn
from app.replica.sampling import SamplingParams, sample
from app.replica.scheduler import Batch, Scheduler, SchedulerConfig
from app.replica.sequence import Sequence

log = logging.getLogger("loraland.engine")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    num_kv_blocks: int
    block_size: int = 16
    max_batch_size: int = 32
    # 4096 over 2048: +25% output tok/s over HTTP on workload W (2 CPU cores), prefill in fewer, larger GEMMs.
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    max_waiting: int = 4096

    def __post_init__(self) -> None:
        for key in (
            "max_model_len",
            "num_kv_blocks",
            "block_size",
            "max_batch_size",
            "max_num_batched_tokens",
            "max_waiting",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class Delta:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # set when the request failed (finish_reason "abort")
    error_kind: str | None = None  # "adapter" (its adapter could not be loaded) or "internal"


class _Detok:
    """Incremental detokenization that holds back text which may still become a stop string or a split
    multi-byte character."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0  # characters already emitted
        self.sent_tokens = 0

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class Engine:
    def __init__(self, model: Model, tokenizer, config: EngineConfig, adapters=None):
        self.model, self.tok, self.cfg, self.adapters = model, tokenizer, config, adapters
        c = model.cfg
        self.allocator = BlockAllocator(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCache(
            c.num_layers,
            config.num_kv_blocks,
            config.block_size,
            c.num_kv_heads,
            c.head_dim,
            model.dtype,
            model.device,
        )
        hooks = {} if adapters is None else {"admit": adapters.admit, "release": adapters.release}
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_batch_size, config.max_num_batched_tokens, config.block_size),
            self.allocator,
            **hooks,
        )
        self.eos_ids = set(c.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0

    # ------------------------------------------------------------------ submission (any thread)
    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_delta: Callable[[Delta], None],
        *,
        adapter: str | None = None,
        adapter_key: str = "",
    ) -> Sequence:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty: give at least one token")
        n = len(prompt_ids)
        if n >= self.cfg.max_model_len:
            raise InvalidRequest(
                f"the prompt has {n} tokens but max_model_len is {self.cfg.max_model_len} "
                "(prompt + at least one new token must fit): shorten the prompt"
            )
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        need = min(n + params.max_tokens, self.cfg.max_model_len)
        blocks = -(-need // self.cfg.block_size)
        if blocks > self.cfg.num_kv_blocks:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {blocks} KV blocks but the cache "
                f"has {self.cfg.num_kv_blocks} of {self.cfg.block_size} tokens: lower max_tokens or the prompt"
            )
        seq = Sequence(
            next(self._ids),
            list(prompt_ids),
            params,
            adapter=adapter,
            adapter_key=adapter_key,
            arrival=time.monotonic(),
        )
        seq.ctx = (on_delta, _Detok(self.tok, params.stop))
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
                    with (
                        self._lock
                    ):  # only cold adapters are waiting: sleep until a load lands or input arrives
                        self._wake.wait(timeout=0.005)
            except Exception as e:  # never let one bad batch kill the loop
                log.exception("engine step failed")
                self._fail_running(f"internal error in the engine step: {e}")
        if self.adapters is not None:
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
        if self.adapters is not None:
            failed = self.adapters.poll()
            for seq in [s for s in self.scheduler.waiting if s.adapter in failed]:
                self._finish(
                    seq,
                    "abort",
                    f"adapter {seq.adapter} could not be loaded: {failed[seq.adapter]}",
                    "adapter",
                )
        batch = self.scheduler.schedule()
        if not batch.items:
            return False
        self.steps += 1
        if self.adapters is not None:
            batch.items.sort(key=lambda it: self.adapters.sort_key(it.seq))
        fb, sampled_items = self._build(batch)
        logits = self.model.forward(fb, self.kv)
        tokens = sample(
            logits, [it.seq.params for it in sampled_items], [it.seq.sampler for it in sampled_items]
        )
        self.scheduler.commit(batch)
        for it, tok in zip(sampled_items, tokens):
            self._append(it.seq, tok)
        return True

    def _build(self, batch: Batch):
        bs = self.cfg.block_size
        ids, pos, slots = [], [], []
        dec_idx, dec_tables, dec_lens, prefills, logits_idx, sampled = [], [], [], [], [], []
        seqs_tokens = []
        for it in batch.items:
            seq, start, n = it.seq, it.start, it.num_tokens
            t0 = len(ids)
            all_ids = seq.all_ids
            ids.extend(all_ids[start : start + n])
            rng = range(start, start + n)
            pos.extend(rng)
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in rng)
            if n == 1:
                dec_idx.append(t0)
                dec_tables.append(seq.block_ids)
                dec_lens.append(start + 1)
            else:
                nblk = -(-(start + n) // bs)
                prefills.append(
                    PrefillAttn(torch.arange(t0, t0 + n), start + n, torch.tensor(seq.block_ids[:nblk]))
                )
            if it.samples:
                logits_idx.append(t0 + n - 1)
                sampled.append(it)
            seqs_tokens.append((seq, n))
        dev = self.model.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(pos, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            decode_idx=None,
            decode_block_tables=None,
            decode_ctx_lens=None,
            prefills=prefills,
            logits_idx=torch.tensor(logits_idx, dtype=torch.long, device=dev),
        )
        if dec_idx:
            width = max(len(t) for t in dec_tables)
            fb.decode_idx = torch.tensor(dec_idx, device=dev)
            fb.decode_block_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in dec_tables], device=dev
            )
            fb.decode_ctx_lens = torch.tensor(dec_lens, device=dev)
        if self.adapters is not None:
            fb.lora = self.adapters.lora_batch(seqs_tokens)
        return fb, sampled

    # ------------------------------------------------------------------ outputs
    def _append(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        seq.output_ids.append(tok)
        on_delta, dt = seq.ctx
        reason = None
        hide_last = False
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            reason, hide_last = "stop", True
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            reason = "length"
        text = dt.text(seq.output_ids[:-1] if hide_last else seq.output_ids)
        if p.stop:
            start = max(0, dt.sent - dt.hold)
            hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
            if hits:
                text = text[: min(hits)[0]]
                reason = "stop"
        if reason is None:
            cut = len(text) - dt.hold
            while cut > dt.sent and text[cut - 1] == "\ufffd":  # an unfinished multi-byte character
                cut -= 1
            new_text = text[dt.sent : cut] if cut > dt.sent else ""
        else:
            new_text = text[dt.sent :]
            self.scheduler.finish(seq, reason)
            if self.adapters is not None:
                self.adapters.finished(seq)
        dt.sent += len(new_text)
        new_ids = seq.output_ids[dt.sent_tokens :]
        dt.sent_tokens = len(seq.output_ids)
        on_delta(Delta(new_text, new_ids, reason, len(seq.prompt_ids), len(seq.output_ids)))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, kind: str | None = None) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq, reason)
        if self.adapters is not None:
            self.adapters.finished(seq)
        on_delta, dt = seq.ctx
        on_delta(Delta("", [], reason, len(seq.prompt_ids), len(seq.output_ids), error, kind))

    def _fail_running(self, message: str) -> None:
        for seq in list(self.scheduler.running):
            self._finish(seq, "abort", message, "internal")

    # ------------------------------------------------------------------ asyncio front
    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        adapter_key: str = "",
    ) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta] = asyncio.Queue()

        def push(d: Delta) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, d)
            except RuntimeError:  # the consumer's loop is gone
                pass

        seq = self.add(prompt_ids, params, push, adapter=adapter, adapter_key=adapter_key)
        done = False
        try:
            while not done:
                d = await q.get()
                done = d.finish_reason is not None
                yield d
        finally:
            if not done:  # the consumer went away: free the sequence's blocks
                self.abort(seq)
