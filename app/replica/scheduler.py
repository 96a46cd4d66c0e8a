"""Continuous (iteration-level) batching: admission, a token budget per step, chunked prefill, preemption.

Pure Python over `Sequence` and `BlockAllocator` (a sequence's block tables, one per KV group, are kept by
app/replica/kv_blocks.py: a sliding-window group frees what falls behind its window); each step's output is a
`Batch` (app/replica/batch.py), which the engine turns into tensors. Preemption is by recompute: the victim's blocks are freed and it re-enters the
waiting queue at its arrival position, so no request is lost and its output is unchanged (its sampled tokens
become part of what is recomputed).
Which waiting request is admitted next is the admission policy's call (app/replica/fairness.py): arrival order
(FCFS), or between tenants by the Virtual Token Counter; running sequences are served oldest first either way.
A policy with fair claims (VTC with preempt) may also make a waiting request jump ahead: it is admitted first in
the step, taking a slot or KV blocks from tenants above their guarantee, and those tenants sit the step out.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from app.replica.batch import Batch, ScheduledSeq
from app.replica.fairness import AdmissionPolicy, FirstComeFirstServed
from app.replica.kv_blocks import GLOBAL, BlockTables
from app.replica.kv_cache import BlockAllocator
from app.replica.kv_layout import KVLayout
from app.replica.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine builds this from its EngineConfig, the one place the defaults live."""

    max_batch_size: int
    max_num_batched_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be >= 1")


def _always(_: Sequence) -> bool:
    return True


def _never(_: Sequence) -> bool:
    return False


def _nothing(_: Sequence) -> None:
    return None


class Scheduler:
    """`admit(seq)` may refuse a waiting sequence (its adapter is not resident yet): it is skipped, not blocking
    the queue. `release(seq)` is called whenever a sequence stops running (finished, aborted, preempted).
    `policy` orders admission (default: first come first served)."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        admit: Callable[[Sequence], bool] = _always,
        release: Callable[[Sequence], None] = _nothing,
        policy: AdmissionPolicy | None = None,
        stale_kv: Callable[[Sequence], bool] = _never,
        layout: KVLayout = GLOBAL,  # the model's KV groups (sliding-window layers free blocks behind them)
    ):
        self.config = config
        self.tables = BlockTables(allocator, layout, config.block_size)
        self.stale_kv = stale_kv  # a running sequence whose cached K/V the model says must be computed again
        self.policy: AdmissionPolicy = policy if policy is not None else FirstComeFirstServed()
        self.alloc = allocator
        self.admit = admit
        self.release = release
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        # running sequences a claim took the slot of, KV kept: not scheduled while the batch is over its size
        self.held: list[Sequence] = []
        self.num_preemptions = 0
        # per activated-LoRA adapter key: (tokens found in base-keyed cached KV blocks, tokens computed instead),
        # counted at each admission; replaced whole, never mutated, so another thread may copy it
        self.alora_kv: dict[str, tuple[int, int]] = {}

    # ----------------------------------------------------------------- queue management
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.tables.reset(seq)
        self._insert_waiting(seq, arrival=True)

    def _insert_waiting(self, seq: Sequence, arrival: bool) -> None:
        keys = [s.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.arrival), seq)
        self.policy.enqueued(seq, arrival)

    def _remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.policy.dequeued(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.FINISHED:
            return
        was_running = seq.status is Status.RUNNING
        if seq in self.running:
            self.running.remove(seq)
            self._unhold(seq)
        elif seq in self.waiting:
            self._remove_waiting(seq)
        self._free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if was_running:
            self.release(seq)

    def _free(self, seq: Sequence) -> None:
        self.tables.reset(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._unhold(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(seq, arrival=False)
        self.release(seq)

    # ----------------------------------------------------------------- scheduling
    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        return self.tables.needed(seq, num_new)

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        return self.tables.grow(seq, num_new)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Attach cached blocks for the sequence's leading full blocks (at least one token stays uncomputed)."""
        self.tables.reuse_prefix(seq)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        # 0. requests the policy says are owed a slot now go first (FCFS: never), maybe holding tenants out
        claimed: set[int] = set()
        # held sequences resume, oldest first, as soon as the batch has room for them (before any admission)
        while self.held and len(self.running) - len(self.held) < self.config.max_batch_size:
            self.held.remove(min(self.held, key=self.running.index))
        if self.waiting and self.policy.claims:
            budget = self._claim(batch, budget, claimed)
        out = batch.sitting_out
        # 1. running sequences, oldest first; when blocks run out, preempt one not yet scheduled (the policy's
        # pick: the newest, or the newest of the most-served tenant)
        held = {id(s) for s in self.held}
        pending = [
            s for s in self.running if id(s) not in claimed and id(s) not in held and s.tenant not in out
        ]
        for seq in [s for s in pending if self.stale_kv(s)]:  # recomputed from its tokens, like a preemption
            self._preempt(seq)
            batch.preempted.append(seq)
            pending.remove(seq)
        while pending and budget > 0:
            seq = pending[0]
            n = min(seq.num_uncomputed, budget)
            if self._grow(seq, n):
                batch.items.append(ScheduledSeq(seq, n, seq.num_computed))
                budget -= n
                pending.pop(0)
                continue
            scheduled = {id(it.seq) for it in batch.items}
            victim = self.policy.kv_victim([s for s in self.running if id(s) not in scheduled])
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim in pending:
                pending.remove(victim)
        # 2. admit waiting sequences in the policy's order while there is room
        if not batch.preempted:
            for seq in self.policy.order(self.waiting):
                if budget <= 0 or self._active() >= self.config.max_batch_size:
                    break
                if seq.tenant in out or not self.admit(seq):
                    continue
                # prompt log probabilities need the logits of every prompt position: no cached prefix
                if self.alloc.enable_prefix_caching and seq.params.prompt_logprobs is None:
                    self._reuse_prefix(seq)
                n = min(seq.num_uncomputed, budget)
                if not self._grow(seq, n):
                    self._free(seq)
                    self.release(seq)
                    break  # head of line keeps its place: no starvation of old requests
                self._start(seq, n, batch)
                budget -= n
        return batch

    def _active(self) -> int:
        return len(self.running) - len(self.held)

    def _unhold(self, seq: Sequence) -> None:
        if seq in self.held:
            self.held.remove(seq)

    def _start(self, seq: Sequence, n: int, batch: Batch) -> None:
        self._remove_waiting(seq)
        self.policy.admitted(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.items.append(ScheduledSeq(seq, n, seq.num_computed))
        if seq.alora_activated is not None and seq.adapter is not None:
            self._count_base_kv(seq, seq.adapter)

    def _count_base_kv(self, seq: Sequence, key: str) -> None:
        """An aLoRA sequence just admitted: its cached blocks that end at or before the activation point are
        the base model's KV (kv_key); the rest of its tokens are prefilled."""
        bs = self.config.block_size
        reused = min(seq.num_computed, seq.lora_start // bs * bs)
        r, p = self.alora_kv.get(key, (0, 0))
        self.alora_kv = {**self.alora_kv, key: (r + reused, p + seq.num_uncomputed)}

    def _claim(self, batch: Batch, budget: int, claimed: set[int]) -> int:
        """Admit the waiting sequences the policy says are owed a slot now, first in the step's budget,
        preempting the victims it names while the batch is full or KV blocks are short; returns the budget left."""
        # the answer is per tenant: one no is a no for its later requests too
        refused: set[str | None] = set()
        out = set(batch.sitting_out)
        for seq in self.policy.order(self.waiting):
            if budget <= 0:
                break
            if seq.tenant in refused:
                continue
            held = {id(s) for s in self.held}
            active = [s for s in self.running if id(s) not in held]
            claim = self.policy.claim(seq, active, self.config.max_batch_size)
            if claim is None:
                refused.add(seq.tenant)
                continue
            full = len(active) >= self.config.max_batch_size
            if full and not claim.victims:
                refused.add(seq.tenant)
                continue
            if not self.admit(seq):
                continue  # a cold adapter: its tenant's next request may be warm
            if self.alloc.enable_prefix_caching and seq.params.prompt_logprobs is None:
                self._reuse_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            victims = list(claim.victims)
            # count what the victims would free first: never preempt for a claim that cannot fit
            freeable = sum(len(v.live_blocks()) for v in victims)
            need = self._blocks_needed(seq, n)
            if need > self.alloc.num_free + freeable:
                self._free(seq)
                self.release(seq)
                continue
            # the slot: hold a victim (no recompute) unless its blocks are needed too, then preempt it
            while victims and (self._active() >= self.config.max_batch_size or need > self.alloc.num_free):
                v = victims.pop(0)
                if need > self.alloc.num_free:
                    self._preempt(v)
                else:
                    self.held.append(v)
                batch.displaced.append(v)
            if self._active() >= self.config.max_batch_size or not self._grow(seq, n):
                self._free(seq)  # shared prefix blocks freed less than counted: rare, and it waits as before
                self.release(seq)
                continue
            self._start(seq, n, batch)
            budget -= n
            claimed.add(id(seq))
            out |= claim.yielders
        batch.sitting_out = frozenset(out)
        return budget

    def commit(self, batch: Batch) -> None:
        """After the forward: mark the fed tokens computed, register newly filled blocks for reuse, and charge
        the policy one output token for every sequence that samples (the engine appends it next)."""
        for it in batch.items:
            seq = it.seq
            if it.samples:
                self.policy.sampled(seq)
            seq.num_computed = it.start + it.num_tokens
            self.tables.commit(seq)
