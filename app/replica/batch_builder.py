"""A scheduler Batch -> the model's ForwardBatch (flat tokens, slots, attention metadata) and its LoRA plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.replica.batch import Batch, ScheduledSeq
from app.replica.kv_blocks import GLOBAL
from app.replica.kv_layout import KVLayout
from app.replica.lora.null import AdapterHooks
from app.replica.models import ForwardBatch, PrefillAttn
from app.replica.models.batch import GroupAttn
from app.replica.sequence import Sequence


@dataclass(frozen=True)
class PromptRows:
    """Logits rows at prompt positions [lo, hi) of seq: the log probabilities of its prompt tokens lo+1..hi."""

    seq: Sequence
    lo: int
    hi: int


class BatchBuilder:
    def __init__(
        self, block_size: int, device: torch.device, adapters: AdapterHooks, layout: KVLayout = GLOBAL
    ):
        self.block_size, self.device, self.adapters, self.layout = block_size, device, adapters, layout

    def build(self, batch: Batch) -> tuple[ForwardBatch, list[ScheduledSeq], list[PromptRows]]:
        """The forward batch, the items that sample a token this step (the first logits rows, in order), and
        the prompt positions whose logits give prompt log probabilities (the rows after those, in order).

        Sorts `batch.items` in place by adapter slot first: the LoRA kernels need each adapter's tokens
        contiguous. An activated LoRA's chunk wholly before its activation point is a base chunk."""
        batch.items.sort(key=self._sort_key)
        bs = self.block_size
        groups = range(self.layout.num_groups)
        ids, pos, lens, dec_idx, logits_idx, sampled = [], [], [], [], [], []
        # per KV group: slots, decode tables and lengths, prefill chunks
        slots: list[list[int]] = [[] for _ in groups]
        dec_tables: list[list[list[int]]] = [[] for _ in groups]
        dec_lens: list[list[int]] = [[] for _ in groups]
        prefills: list[list[PrefillAttn]] = [[] for _ in groups]
        seqs_tokens, prompt_rows, prompt_idx = [], [], []
        for it in batch.items:
            seq, start, n = it.seq, it.start, it.num_tokens
            t0 = len(ids)
            ids.extend(seq.token_range(start, start + n))
            rng = range(start, start + n)
            pos.extend(rng)
            lens.extend([seq.num_tokens] * n)
            seq.kv_basis = seq.num_tokens
            if n == 1:
                dec_idx.append(t0)
            else:
                rows, nblk = torch.arange(t0, t0 + n), -(-(start + n) // bs)
            for g in groups:
                table = seq.tables[g]
                slots[g].extend(table[p // bs] * bs + p % bs for p in rng)
                # a sliding group's attention starts at the first block its window needs: blocks before it
                # are freed (-1), and positions count from there
                first = self.layout.first_needed(g, start, bs)
                if n == 1:
                    dec_tables[g].append(table[first:] if first else table)
                    dec_lens[g].append(start + 1 - first * bs)
                else:
                    prefills[g].append(
                        PrefillAttn(rows, start + n - first * bs, torch.tensor(table[first:nblk]))
                    )
            if it.samples:
                logits_idx.append(t0 + n - 1)
                sampled.append(it)
            if seq.prompt_logprobs is not None:
                # logits at position p give prompt token p + 1's log probability; those already computed (before
                # a preemption) are not computed again
                lo = max(start, len(seq.prompt_logprobs) - 1)
                hi = min(start + n, len(seq.prompt_ids) - 1)
                if lo < hi:
                    prompt_idx.extend(range(t0 + lo - start, t0 + hi - start))
                    prompt_rows.append(PromptRows(seq, lo, hi))
            seqs_tokens.append((seq, n))
        dev = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(pos, device=dev),
            slot_mapping=torch.tensor(slots[0], device=dev),
            decode_idx=None,
            decode_block_tables=None,
            decode_ctx_lens=None,
            prefills=prefills[0],
            logits_idx=torch.tensor(logits_idx + prompt_idx, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(lens, device=dev),
        )
        if dec_idx:
            fb.decode_idx = torch.tensor(dec_idx, device=dev)
            fb.decode_block_tables, fb.decode_ctx_lens = self._tables(dec_tables[0], dec_lens[0])
        for g in groups[1:]:
            tables, glens = self._tables(dec_tables[g], dec_lens[g]) if dec_idx else (None, None)
            fb.groups.append(
                GroupAttn(torch.tensor(slots[g], device=dev), fb.decode_idx, tables, glens, prefills[g])
            )
        fb.lora = self.adapters.lora_batch(seqs_tokens)
        return fb, sampled, prompt_rows

    def _tables(self, tables: list[list[int]], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows' block tables, padded to the widest, and their lengths, as tensors."""
        width = max(len(t) for t in tables)
        # Pad each table with its own first block, not block 0: attention reads the padding under a mask,
        # and 0 * inf is NaN, so a padded row must never read another sequence's (maybe broken) KV.
        padded = torch.tensor([t + t[:1] * (width - len(t)) for t in tables], device=self.device)
        return padded, torch.tensor(lens, device=self.device)

    def _sort_key(self, it: ScheduledSeq) -> tuple[int, int]:
        if it.seq.base_tokens(it.start, it.num_tokens) == it.num_tokens:
            return (-1, -1)
        return self.adapters.sort_key(it.seq)
