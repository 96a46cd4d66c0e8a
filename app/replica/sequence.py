"""Per-request state that the scheduler and engine share (plain dataclasses, no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.replica.logprobs import SampleLogprobs
from app.replica.output_state import OutputState
from app.replica.sampler_state import SamplerState
from app.sampling_params import SamplingParams


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
    block_ids: list[int] = field(default_factory=list)
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
