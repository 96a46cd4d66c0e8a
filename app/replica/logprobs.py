"""Log probabilities of sampled and prompt tokens, batched: one log_softmax, one gather, one topk, one transfer.

Semantics: vLLM's default ("raw_logprobs"): log_softmax of the model's own logits, before any logits processor,
temperature or truncation. A prompt token's log probability is that of the logits at the position before it
(the first prompt token has none: its entry's logprob is None). Non-finite values (a broken adapter's logits at
a prompt position; sampled rows are checked before) are clamped to -9999.0, as vLLM does, so every number is
valid JSON.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

FLOOR = -9999.0


@dataclass(frozen=True)
class SampleLogprobs:
    """One token's raw log probability (None for a prompt's first token) and, when asked, the top ones at its
    position (best first)."""

    token_id: int
    logprob: float | None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def _top(
    lp: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """lp [m, V] log probabilities -> (lp at ids [m], top-k ids [m][k], top-k values [m][k]) as Python lists."""
    lp = torch.nan_to_num(lp, nan=FLOOR, posinf=FLOOR, neginf=FLOOR).clamp_(min=FLOOR)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    k = min(k, lp.shape[1])
    if not k:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    top_v, top_i = lp.topk(k, dim=-1)
    return chosen, top_i.tolist(), top_v.tolist()


def sample_logprobs(
    raw: torch.Tensor,
    rows: list[int],
    ks: Seq[int],
    tokens: Seq[int | Exception],
    into: list[SampleLogprobs | None],
) -> None:
    """into[i] for each i of `rows`: the raw log probability of tokens[i] under raw[i], and the top ks[j]."""
    dev = raw.device
    lp = torch.log_softmax(raw.index_select(0, torch.tensor(rows, device=dev)), dim=-1)
    ids = torch.tensor([tokens[i] for i in rows], device=dev)
    chosen, top_i, top_v = _top(lp, ids, max(ks))
    for j, (i, k) in enumerate(zip(rows, ks)):
        into[i] = SampleLogprobs(tokens[i], chosen[j], tuple(top_i[j][:k]), tuple(top_v[j][:k]))


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], ks: Seq[int]) -> list[SampleLogprobs]:
    """logits [m, V] at m prompt positions; next_ids[j]: the prompt token that follows position j; ks[j]: how
    many top log probabilities it asked for."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen, top_i, top_v = _top(lp, torch.tensor(next_ids, device=logits.device), max(ks))
    return [
        SampleLogprobs(t, c, tuple(ti[:k]), tuple(tv[:k]))
        for t, c, ti, tv, k in zip(next_ids, chosen, top_i, top_v, ks)
    ]
