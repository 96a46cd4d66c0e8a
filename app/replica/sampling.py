"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from app.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_kwargs(cls, **kw) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; supported: {sorted(known)}")
        if isinstance(kw.get("stop"), str):
            kw["stop"] = (kw["stop"],)
        for key in ("stop", "stop_token_ids"):
            if kw.get(key) is None:
                kw.pop(key, None)
            else:
                kw[key] = tuple(kw[key])
        kw = {k: v for k, v in kw.items() if v is not None or k == "seed"}
        return cls(**kw)


@dataclass
class SamplerState:
    """Per-sequence random state: a seeded sequence draws only from its own generator."""

    generator: torch.Generator | None = field(default=None)


def sample(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState]) -> list[int]:
    """logits [n, V] (any float dtype) -> one token id per row."""
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        st = states[i]
        if st.generator is None:
            st.generator = torch.Generator()
            if p.seed is not None:
                st.generator.manual_seed(p.seed)
            else:
                st.generator.seed()
        out[i] = int(torch.multinomial(probs, 1, generator=st.generator))
    return out
