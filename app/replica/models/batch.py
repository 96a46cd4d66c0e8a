"""What one forward step reads: the flat token batch, its attention layout, and the LoRA hook."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class LoraHook(Protocol):
    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every targeted adapter's delta for linear `group` ("qkv", "o", "gate_up", "down") into out."""

    def apply_experts(
        self,
        layer: int,
        which: str,
        x_pairs: torch.Tensor,
        pair_expert: torch.Tensor,
        pair_token: torch.Tensor,
        out_pairs: torch.Tensor,
    ) -> None:
        """Mixture-of-experts layers: add each pair's adapter's expert delta for `which` ("gate_up" on the layer
        input, before the activation; "down" on the activated input, before the routing weight) into out_pairs.
        Pair i is (token pair_token[i], expert pair_expert[i]); the pairs come sorted by expert."""

    def embed(self, ids: torch.Tensor, h: torch.Tensor) -> None:
        """h = the base embedding of ids [T]: apply each token's adapter's embed_tokens (LoRA or copy) in place."""

    def head(self, rows: torch.Tensor, x: torch.Tensor, logits: torch.Tensor) -> None:
        """logits = lm_head(x), row i of token rows[i]: apply each row's adapter's lm_head (LoRA or copy)."""


@dataclass(frozen=True)
class AttentionRows:
    """Every token of a step as a row of the fused attention op, which attends one query row to the cached
    positions [max(0, len - window), len) of its own block table: the decode rows, then each prefill token
    with its context ending at its own position (causal). Built once per step and KV group, read by every
    layer."""

    rows: torch.Tensor  # [N] int64 flat token index
    block_tables: torch.Tensor  # [N, max_blocks] int64 (padded with 0, never read past len)
    ctx_lens: torch.Tensor  # [N] int64


@dataclass
class PrefillAttn:
    token_idx: torch.Tensor  # [q_len] positions of this chunk's tokens in the flat batch
    ctx_len: int  # tokens of the sequence in the cache after this step (context + this chunk)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)]


@dataclass
class GroupAttn:
    """The attention layout of one more KV group (app/replica/kv_layout.py) beyond the first, whose layout is the
    ForwardBatch's own fields. A sliding group's tables start at the first block its window needs: its decode
    lengths and prefill ctx_len count from that block's first position (attention only sees relative order)."""

    slot_mapping: torch.Tensor  # [T]
    decode_idx: torch.Tensor | None  # the batch's
    decode_block_tables: torch.Tensor | None
    decode_ctx_lens: torch.Tensor | None
    prefills: list[PrefillAttn]
    attention_rows: AttentionRows | None = field(default=None, repr=False)  # built on first use, attention.py


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token (block * block_size + offset)
    decode_idx: torch.Tensor | None  # [Bd] flat index of each single-token (decode) sequence
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] (padded with 0)
    decode_ctx_lens: torch.Tensor | None  # [Bd]
    prefills: list[PrefillAttn]
    logits_idx: torch.Tensor  # [n] tokens whose next-token logits are needed
    lora: LoraHook | None = None
    seq_lens: torch.Tensor | None = None  # [T] each token's sequence length (its known tokens) this step
    groups: list[GroupAttn] = field(default_factory=list)  # KV groups 1.. (sliding-window models)
    attention_rows: AttentionRows | None = field(default=None, repr=False)  # built on first use, attention.py

    def group(self, g: int) -> ForwardBatch | GroupAttn:
        """KV group g's slots, decode tables and lengths, and prefill blocks (group 0: this batch's fields)."""
        return self if g == 0 else self.groups[g - 1]
