"""A scheduler Batch -> the model's ForwardBatch (flat tokens, slots, attention metadata) and its LoRA plan."""

from __future__ import annotations

import torch

from app.replica.lora.null import AdapterHooks
from app.replica.model import ForwardBatch, PrefillAttn
from app.replica.scheduler import Batch, ScheduledSeq


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, adapters: AdapterHooks):
        self.block_size, self.device, self.adapters = block_size, device, adapters

    def build(self, batch: Batch) -> tuple[ForwardBatch, list[ScheduledSeq]]:
        """The forward batch, and the items that sample a token this step (in logits row order).

        Sorts `batch.items` in place by adapter slot first: the LoRA kernels need each adapter's tokens
        contiguous."""
        batch.items.sort(key=lambda it: self.adapters.sort_key(it.seq))
        bs = self.block_size
        ids, pos, slots = [], [], []
        dec_idx, dec_tables, dec_lens, prefills, logits_idx, sampled = [], [], [], [], [], []
        seqs_tokens = []
        for it in batch.items:
            seq, start, n = it.seq, it.start, it.num_tokens
            t0 = len(ids)
            ids.extend(seq.token_range(start, start + n))
            rng = range(start, start + n)
            pos.extend(rng)
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in rng)
            if n == 1:
                dec_idx.append(t0)
                dec_tables.append(seq.block_ids)
                dec_lens.append(start + 1)
            else:
                nblk = -(-(start + n) // bs)
                prefills.append(
                    PrefillAttn(torch.arange(t0, t0 + n), start + n, torch.tensor(seq.block_ids[:nblk]))
                )
            if it.samples:
                logits_idx.append(t0 + n - 1)
                sampled.append(it)
            seqs_tokens.append((seq, n))
        dev = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(pos, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            decode_idx=None,
            decode_block_tables=None,
            decode_ctx_lens=None,
            prefills=prefills,
            logits_idx=torch.tensor(logits_idx, dtype=torch.long, device=dev),
        )
        if dec_idx:
            width = max(len(t) for t in dec_tables)
            fb.decode_idx = torch.tensor(dec_idx, device=dev)
            # Pad each table with its own first block, not block 0: attention reads the padding under a mask,
            # and 0 * inf is NaN, so a padded row must never read another sequence's (maybe broken) KV.
            fb.decode_block_tables = torch.tensor(
                [t + t[:1] * (width - len(t)) for t in dec_tables], device=dev
            )
            fb.decode_ctx_lens = torch.tensor(dec_lens, device=dev)
        fb.lora = self.adapters.lora_batch(seqs_tokens)
        return fb, sampled
