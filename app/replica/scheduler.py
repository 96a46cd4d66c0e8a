"""Continuous (iteration-level) batching: admission, a token budget per step, chunked prefill, preemption.

Pure Python over `Sequence` and `BlockAllocator`; the engine turns a `Batch` into tensors. Preemption is by
recompute: the victim's blocks are freed and it re-enters the waiting queue at its arrival position, so
no request is lost and its output is unchanged (its sampled tokens become part of what is recomputed).
Which waiting request is admitted next is the admission policy's call (app/replica/fairness.py): arrival order
(FCFS), or between tenants by the Virtual Token Counter; running sequences are served oldest first either way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from app.replica.fairness import AdmissionPolicy, FirstComeFirstServed
from app.replica.kv_cache import BlockAllocator, block_hash
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


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step: all_ids[start : start + num_tokens]
    start: int  # == seq.num_computed when scheduled

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # for lack of KV blocks
    displaced: list[Sequence] = field(default_factory=list)  # preempted by the policy for a tenant behind

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


def _always(_: Sequence) -> bool:
    return True


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
    ):
        self.config = config
        self.policy: AdmissionPolicy = policy if policy is not None else FirstComeFirstServed()
        self.alloc = allocator
        self.admit = admit
        self.release = release
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue management
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
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
        elif seq in self.waiting:
            self._remove_waiting(seq)
        self._free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if was_running:
            self.release(seq)

    def _free(self, seq: Sequence) -> None:
        self.alloc.free(seq.block_ids)
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(seq, arrival=False)
        self.release(seq)

    # ----------------------------------------------------------------- scheduling
    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed + num_new) // self.config.block_size)
        return max(0, total - len(seq.block_ids))

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        need = self._blocks_needed(seq, num_new)
        if need > self.alloc.num_free:
            return False
        seq.block_ids.extend(self.alloc.allocate() for _ in range(need))
        return True

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Attach cached blocks for the sequence's leading full blocks (at least one token stays uncomputed)."""
        bs = self.config.block_size
        ids = seq.all_ids
        parent = None
        for j in range((len(ids) - 1) // bs):
            h = block_hash(parent, tuple(ids[j * bs : (j + 1) * bs]), seq.adapter or "")
            bid = self.alloc.lookup(h)
            if bid is None:
                break
            seq.block_ids.append(bid)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed = len(seq.block_ids) * bs

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        # 0. a full batch may give one slot to a waiting tenant that is behind (the policy's call; FCFS never)
        if self.waiting and len(self.running) >= self.config.max_batch_size:
            self._displace(batch)
        # 1. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.items.append(ScheduledSeq(seq, n, seq.num_computed))
                budget -= n
                i += 1
                continue
            # seq itself was preempted; everything after it was too
            break
        # 2. admit waiting sequences in the policy's order while there is room
        if not batch.preempted:
            for seq in self.policy.order(self.waiting):
                if budget <= 0 or len(self.running) >= self.config.max_batch_size:
                    break
                if not self.admit(seq):
                    continue
                # prompt log probabilities need the logits of every prompt position: no cached prefix
                if self.alloc.enable_prefix_caching and seq.params.prompt_logprobs is None:
                    self._reuse_prefix(seq)
                n = min(seq.num_uncomputed, budget)
                if not self._grow(seq, n):
                    self._free(seq)
                    self.release(seq)
                    break  # head of line keeps its place: no starvation of old requests
                self._remove_waiting(seq)
                self.policy.admitted(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                batch.items.append(ScheduledSeq(seq, n, seq.num_computed))
                budget -= n
        return batch

    def _displace(self, batch: Batch) -> None:
        for seq in self.policy.order(self.waiting):
            victim = self.policy.victim(seq, self.running)
            if victim is None:
                return  # the policy's order is most-behind first: nobody after seq is owed a slot either
            if not self.admit(seq):
                continue  # its adapter is not resident yet: the next candidate may be
            self.release(seq)  # admitted for real in step 2, into the slot freed here
            self._preempt(victim)
            batch.displaced.append(victim)
            return

    def commit(self, batch: Batch) -> None:
        """After the forward: mark the fed tokens computed, register newly filled blocks for reuse, and charge
        the policy one output token for every sequence that samples (the engine appends it next)."""
        bs = self.config.block_size
        for it in batch.items:
            seq = it.seq
            if it.samples:
                self.policy.sampled(seq)
            seq.num_computed = it.start + it.num_tokens
            while len(seq.block_hashes) < seq.num_computed // bs:
                j = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                h = block_hash(parent, tuple(seq.token_range(j * bs, (j + 1) * bs)), seq.adapter or "")
                self.alloc.register(seq.block_ids[j], h)
                seq.block_hashes.append(h)
