"""Per-request state that the scheduler and engine share (plain dataclasses, no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from app.replica.sampling import SamplerState, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # resolved adapter name (None = base model)
    adapter_key: str = ""  # adapter identity in prefix-cache hashes: "name@version", "" = base
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks
    finish_reason: str | None = None
    num_preemptions: int = 0
    sampler: SamplerState = field(default_factory=SamplerState)
    # engine-side bookkeeping (detokenizer state, output callback); the scheduler never reads it
    ctx: Any = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
