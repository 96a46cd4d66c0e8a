"""One engine step's LoRA plan: the batch's tokens as runs of one pool each, with each token's adapter slot
(the AdapterManager's entries say which pool and slot serve a sequence's adapter key)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from loraland_kernels import lora as K

from app.replica.lora.pools import LoraBatch, PoolPlan
from app.replica.sequence import Sequence


def plan_lora_batch(
    entries: Mapping[str, Any], seqs_tokens: list[tuple[Sequence, int]], device: torch.device
) -> LoraBatch | None:
    """seqs_tokens: the batch in sort_key order, with each sequence's token count this step (from
    seq.num_computed on); `entries`: adapter key -> entry with a `slot` (pool, index). An activated LoRA's
    tokens before its activation point are base tokens (slot -1): a chunk wholly before it sorts among the base
    ones (batch_builder); a chunk that crosses it gets a plan of its own, its leading tokens -1, since the
    kernels want slot -1 tokens first."""
    plans, t, i = [], 0, 0
    while i < len(seqs_tokens):
        seq, n = seqs_tokens[i]
        if seq.adapter is None or seq.base_tokens(seq.num_computed, n) == n:
            t += n
            i += 1
            continue
        pool = entries[seq.adapter].slot[0]
        start, slots = t, []
        while i < len(seqs_tokens):
            s, n = seqs_tokens[i]
            pre = 0 if s.adapter is None else s.base_tokens(s.num_computed, n)
            if s.adapter is None or pre == n or entries[s.adapter].slot[0] is not pool or (pre and slots):
                break
            slots += [-1] * pre + [entries[s.adapter].slot[1]] * (n - pre)
            t += n
            i += 1
            if pre:  # the crossing chunk's plan holds it alone
                break
        ids = torch.tensor(slots, dtype=torch.int64, device=device)
        plans.append(PoolPlan(pool, start, t, K.build_segments(ids, pool.high_water())))
    return LoraBatch(plans) if plans else None
