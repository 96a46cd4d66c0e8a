"""Per-request state that the scheduler and engine share (plain dataclasses, no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.replica.logprobs import SampleLogprobs
from app.replica.output_state import OutputState
from app.replica.sampler_state import SamplerState
from app.sampling_params import SamplingParams

# Sequence.lora_start of an activated LoRA whose prompt lacks its invocation sequence: the delta never applies
NEVER = 1 << 62


def alora_start(prompt_ids: list[int], invocation: tuple[int, ...]) -> int | None:
    """PEFT's activation point of an activated LoRA (peft/tuners/lora/variants.py, calculate_alora_offsets):
    the index of the start of the *last* occurrence of `invocation` in the prompt; the delta applies to that
    token and every one after it (the invocation tokens included). None when the prompt does not hold it."""
    n, first = len(invocation), invocation[0]
    for i in range(len(prompt_ids) - n, -1, -1):
        if prompt_ids[i] == first and tuple(prompt_ids[i : i + n]) == invocation:
            return i
    return None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    # The adapter manager's key ("name@version" or a merge key; None = base model). It is also the adapter
    # identity in prefix-cache hashes, so the same tokens under two adapters never share KV.
    adapter: str | None = None
    arrival: float = 0.0
    tenant: str | None = None  # whose request (None: the anonymous tenant); the admission policy's key
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    kv_basis: int = 0  # the sequence's length when its cached K/V were last computed (LongRoPE picks by it)
    # per KV group (app/replica/kv_layout.py) the sequence's block table; -1 marks a block a sliding group
    # freed (wholly before the window). One group, the whole table, for a model without sliding layers.
    tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks
    finish_reason: str | None = None
    num_preemptions: int = 0
    prompt_charged: bool = False  # the VTC charged its prompt at first admission; a recompute is not charged
    sampler: SamplerState = field(default_factory=SamplerState)
    # prompt tokens' log probabilities computed so far (params.prompt_logprobs): one per prompt token from the
    # first (logprob None) on; a recompute after preemption does not compute them again
    prompt_logprobs: list[SampleLogprobs] | None = None
    # the output side's state (delta callback, detokenizer offsets); the scheduler never reads it
    output: OutputState | None = None
    # The first position whose token takes the adapter's delta: 0 for a plain LoRA; for an activated LoRA (aLoRA)
    # alora_start's answer, set on admission (NEVER when the prompt lacks the invocation: the base model's
    # behaviour, as PEFT). Tokens before it are the base model's: LoRA slot -1 and the base's prefix-cache key.
    lora_start: int = 0
    alora_activated: bool | None = None  # None: not an aLoRA adapter

    def base_tokens(self, start: int, n: int) -> int:
        """How many of the tokens at positions [start, start + n) come before the adapter's activation."""
        return max(0, min(n, self.lora_start - start))

    def kv_key(self, end: int) -> str:
        """The adapter identity of this sequence's KV at positions before `end` (a prefix-cache block ending
        there): the base model's ("") while they all precede the activation, else the adapter's key."""
        return "" if self.adapter is None or end <= self.lora_start else self.adapter

    @property
    def block_ids(self) -> list[int]:
        """The first group's table (the global one whenever the model has global layers)."""
        return self.tables[0]

    @block_ids.setter
    def block_ids(self, ids: list[int]) -> None:
        self.tables[0] = ids

    def live_blocks(self) -> list[int]:
        """Every block the sequence holds, in all groups."""
        return [b for t in self.tables for b in t if b >= 0]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without copying the whole sequence (a decode step reads one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
