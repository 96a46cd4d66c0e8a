"""What LLMKernel hands its callers: a finished prompt's `Completion`, and a `KernelStats` snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.replica.logprobs import SampleLogprobs
from app.replica.output_state import Delta


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[SampleLogprobs] | None = None  # one per token id, when asked (sampling's `logprobs`)
    prompt_logprobs: list[SampleLogprobs] | None = None  # one per prompt token (`prompt_logprobs`)
    # an activated LoRA's request: False when its prompt lacked the invocation (the base model served it)
    alora_activated: bool | None = None

    def add(self, d: Delta) -> None:
        """Fold one more delta of the stream in (the engine's text has stop strings and tokens applied)."""
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.prompt_tokens = d.prompt_tokens
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        if d.alora_activated is not None:
            self.alora_activated = d.alora_activated


@dataclass(frozen=True)
class KernelStats:
    """A snapshot of the kernel's queues, KV cache and adapters (what a replica reports and its gauges show)."""

    resident: tuple[str, ...]  # adapter names in a device slot
    in_memory: tuple[str, ...]  # names servable without a fetch: host memory, a device slot, or reading in
    loaded: tuple[str, ...]  # every registered name (its loader re-reads it after a host eviction)
    host_cached: int  # adapters parsed in host memory
    free_slots: int
    queue_len: int
    running: int
    kv_usage: float
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int
    prefix_hits: int
    # activated-LoRA adapter key ("name@version") -> (prompt tokens served from the base model's cached KV
    # blocks, tokens prefilled), summed over admissions since the replica started
    alora_kv: dict[str, tuple[int, int]] = field(default_factory=dict)
