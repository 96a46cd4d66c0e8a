"""One sequence's sampler state, a leaf both the sampler and its logits processors read (no import back)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.replica.grammar import GrammarState


@dataclass
class SamplerState:
    """Per-sequence sampler state: a seeded sequence draws only from its own generator; a penalized one keeps
    its token counts (built once, then updated with each new token: logits_processors.py)."""

    generator: torch.Generator | None = field(default=None)
    counts: torch.Tensor | None = None  # [V] float32: how often each token appears in the output so far
    seen: torch.Tensor | None = None  # [V] bool: the token appears in the prompt or the output
    counted: int = 0  # output tokens already in `counts`
    grammar: GrammarState | None = None  # response_format's matcher (set at admission; grammar.py)
