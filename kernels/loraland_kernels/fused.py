"""The fused CPU ops (cpu/fused_ops.cpp) as Python calls on CPU tensors. `enabled(device)` says whether they
run for tensors on that device (CPU, and the library built and loaded: cpu_build.py); callers keep their torch
path for every other case. Each call writes into a tensor it allocates, or updates its arguments in place
where the name ends with an underscore."""

from __future__ import annotations

import torch

from loraland_kernels import cpu_build


def _vector_bytes() -> int:
    """The vector width of torch's CPU kernels (its dispatch capability), which silu_mul copies to match them."""
    cap = torch.backends.cpu.get_cpu_capability()
    return 64 if cap.startswith("AVX512") else 32 if cap == "AVX2" else 0


VECTOR_BYTES = _vector_bytes()


def enabled(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_build.load()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of each row of x [N, n] (residual given: residual += x first, in place, and the norm reads it)."""
    src = x if residual is None else residual
    out = torch.empty(src.shape, dtype=src.dtype)
    torch.ops.loraland.rms_norm(x, residual, weight, eps, gemma, out)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused [N, 2I] projection (gate first) -> [N, I], bit for bit torch's result."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    torch.ops.loraland.silu_mul(gate_up, VECTOR_BYTES, out)
    return out


def rope_cache_(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
) -> None:
    """RoPE in place on the q and k heads of qkv [T, W], then each token's k and v into its cache slot."""
    torch.ops.loraland.rope_cache(qkv, heads, kv_heads, head_dim, cos, sin, slot_mapping, kc, vc)


def decode_attention_(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    decode_idx: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of the decode rows decode_idx of q [T, H, d] over their cached positions (the last `window`
    of them, if set), written into those rows of out [T, H * d]."""
    torch.ops.loraland.decode_attention(
        q, kc, vc, decode_idx, block_tables, ctx_lens, window or 0, scale, out
    )


def expert_matmul(x: torch.Tensor, w: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """x [P, K] (rows sorted by expert), w [E, N, K], spans [S, 3] int64 (expert, first row, end row) ->
    [P, N] with out[r] = x[r] @ w[e]^T for the rows of each span (rows in no span: left uninitialised). fp32 or
    bf16; sums in fp32 in another order than a GEMM's (not bit-identical to F.linear)."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype)
    torch.ops.loraland.expert_matmul(x, w, spans, out)
    return out


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, V] fp32 -> [n, 2] int64: each row's torch.argmax index and 1 where the row holds inf or NaN."""
    out = torch.empty(logits.shape[0], 2, dtype=torch.long)
    torch.ops.loraland.greedy_rows(logits, out)
    return out


def segment_matmul(
    a: torch.Tensor, w: torch.Tensor, spans: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = a[t] @ w[s] for the rows t of each span (slot s, first row, end row), the spans one after the
    other from row 0 to the last: a [P, n] (rows sorted by slot, unit column stride), w [S, n, m] contiguous,
    spans int64 [k, 3] -> [P, m] in w's dtype (fp32 or bf16; a in it too). Each slot's factors are read once.
    With `out` ([P, m] in w's dtype, unit column stride, e.g. a column slice of a fused projection's output) the
    products are added to it in place, as out.add_(product) rounds, and out is returned."""
    if out is None:
        out = torch.empty(a.shape[0], w.shape[2], dtype=w.dtype)
        torch.ops.loraland.segment_matmul(a, w, spans, out, False)
    else:
        torch.ops.loraland.segment_matmul(a, w, spans, out, True)
    return out


def expert_combine_(out: torch.Tensor, ys: torch.Tensor, ws: torch.Tensor, rows: torch.Tensor) -> None:
    """out[rows[p]] += ys[p] * ws[p] in pair order, rounded as ys.mul_(ws[:, None]) then out.index_add_(0, rows,
    ys) round (bf16: each output row summed in fp32, rounded once): out [T, H], ys [P, H] (fp32, or bf16 with bf16
    or fp32 ws [P]), rows int64 [P]; ys is not changed. bf16 passes over all of out twice: for few rows (decode)."""
    torch.ops.loraland.expert_combine(out, ys, ws, rows)
