"""Attention over the paged KV cache for one layer: decode rows read their block tables, prefill chunks their
blocks; a sliding window (per layer) and a softmax scale (per family) are honoured in both. With the fused CPU
ops, one op call per layer runs every row (a prefill token is a row whose context ends at its own position);
without them, decode rows through SDPA over gathered blocks and each prefill through its own SDPA call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraland_kernels import fused

from app.replica.models.batch import AttentionRows, ForwardBatch, GroupAttn


def stale_slots(b: ForwardBatch | GroupAttn, block_size: int) -> torch.Tensor | None:
    """(The torch decode path only: the fused one reads no slot past a row's length.) Cache slots (block * block_size + offset) past each decode row's length in its own last block. They are
    stale: a reused block's previous owner left them, maybe inf/NaN (a prefill aborted midway). Decode attention
    reads them (and the padding, which repeats the row's first block) under a mask of weight 0, but 0 * NaN is
    NaN, so the forward zeroes them before attention. No one else writes there: the slots are the row's own,
    and its next tokens overwrite them."""
    lens = b.decode_ctx_lens
    used = lens % block_size  # 0: the last block is full
    last = b.decode_block_tables.gather(1, ((lens - 1) // block_size)[:, None])
    off = torch.arange(block_size, device=lens.device)[None, :]
    slots = (last * block_size + off)[(off >= used[:, None]) & (used[:, None] > 0)]
    return slots if slots.numel() else None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: ForwardBatch | GroupAttn,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """q [T, H, d], k/v [T, Hkv, d] of this step (already in the cache too) -> [T, H * d]. A key at position j
    is seen by a query at i when j <= i and, with a window w, j > i - w (transformers' sliding mask). SDPA gets
    4-D inputs: 3-D ones with enable_gqa fall back to the unfused math path on CPU (~10x slower). `b` is the
    layer's KV group's layout (ForwardBatch.group): a sliding group's positions count from its first needed
    block, so i and j above are relative, which the mask does not mind."""
    T, H, d = q.shape
    Hkv = k.shape[1]
    out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)
    if fused.enabled(q.device):
        # every row, decode and prefill, in one call reading only its own live slots from the cache (this
        # step's k/v are there already): one call per layer instead of one SDPA call per sequence
        a = b.attention_rows if b.attention_rows is not None else _attention_rows(b)
        sc = d**-0.5 if scale is None else scale
        fused.decode_attention_(q, kc, vc, a.rows, a.block_tables, a.ctx_lens, window, sc, out.view(T, H * d))
        return out.flatten(1)
    if b.decode_idx is not None:
        bt = b.decode_block_tables
        nb, bs = bt.shape[1], kc.shape[1]
        keys = kc[bt].view(bt.shape[0], nb * bs, Hkv, d)  # gathered: a copy
        vals = vc[bt].view(bt.shape[0], nb * bs, Hkv, d)
        pos = torch.arange(nb * bs, device=q.device)[None, :]
        lens = b.decode_ctx_lens[:, None]
        mask = pos < lens
        keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)
        if window is not None:
            mask &= pos >= lens - window
        # A query head's group of heads sharing one KV head as that KV head's query rows ([Bd, Hkv, group, d]):
        # the same attention as enable_gqa with one query row, but CPU SDPA's flash kernel runs it 6-7x faster
        # in bf16 (1.3-1.7x in fp32) with the same error (load_tests/engine/bench_attention.py).
        qd = q.index_select(0, b.decode_idx).view(bt.shape[0], Hkv, -1, d)
        o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=mask[:, None, None, :], scale=scale)
        out.index_copy_(0, b.decode_idx, o.view(bt.shape[0], H, d))
    for p in b.prefills:
        n = p.token_idx.shape[0]
        t0 = int(p.token_idx[0])
        # the batch builder lays a chunk's tokens side by side: slice instead of gather/scatter
        rows = slice(t0, t0 + n) if int(p.token_idx[-1]) == t0 + n - 1 else p.token_idx
        qp = q[rows].transpose(0, 1)[None]  # [1, H, n, d]
        if p.ctx_len == n:  # the whole sequence is this chunk: its K/V are the ones just computed
            keys, vals = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
        else:
            keys = kc.index_select(0, p.block_ids).flatten(0, 1)[: p.ctx_len].transpose(0, 1)[None]
            vals = vc.index_select(0, p.block_ids).flatten(0, 1)[: p.ctx_len].transpose(0, 1)[None]
        if p.ctx_len == n and (window is None or window >= n):
            o = F.scaled_dot_product_attention(qp, keys, vals, is_causal=True, enable_gqa=True, scale=scale)
        else:
            qpos = torch.arange(p.ctx_len - n, p.ctx_len, device=q.device)[:, None]
            kpos = torch.arange(p.ctx_len, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, enable_gqa=True, scale=scale)
        out[rows] = o[0].transpose(0, 1)
    return out.flatten(1)


def _attention_rows(b: ForwardBatch | GroupAttn) -> AttentionRows:
    """b's AttentionRows, built and kept on b (one step, one KV group; every layer reads them)."""
    rows, lens, tables = [], [], []
    if b.decode_idx is not None:
        rows.append(b.decode_idx.long())
        lens.append(b.decode_ctx_lens.long())
        tables.append(b.decode_block_tables.long())
    for p in b.prefills:
        n = p.token_idx.shape[0]
        rows.append(p.token_idx.long())
        lens.append(torch.arange(p.ctx_len - n + 1, p.ctx_len + 1, dtype=torch.long))
        tables.append(p.block_ids.long()[None].expand(n, -1))
    width = max((t.shape[1] for t in tables), default=1)
    bt = torch.zeros(sum(r.shape[0] for r in rows), width, dtype=torch.long)
    r0 = 0
    for t in tables:
        bt[r0 : r0 + t.shape[0], : t.shape[1]] = t
        r0 += t.shape[0]
    b.attention_rows = AttentionRows(torch.cat(rows), bt, torch.cat(lens))
    return b.attention_rows
