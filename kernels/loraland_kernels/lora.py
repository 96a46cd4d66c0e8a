"""Grouped multi-LoRA (Punica SGMV) over a flat token batch sorted by adapter slot.

A pool holds S slots of one rank r: A [S, in, r], B [S, r, out]. Tokens of a slot are contiguous; slot -1
(no adapter) may only lead the batch. For every segment with slot s >= 0:
    shrink:  z[seg] = x[seg] @ A[s]                        ([T, in] -> [T, r])
    expand:  y[seg] += scale[s] * z[seg] @ B[s]            ([T, r] -> [T, out], in place)
DoRA adapters also rescale the base output per output column before the delta is added (base_scale [S, out],
the part base_bias [out] of y left unscaled): y[seg] = base_scale[s] * (y[seg] - base_bias) + base_bias + ...
kernels/loraland_kernels/reference.py is the definition the paths below are tested against.

Paths (`method`):
- "fused" (CPU, the fused ops built: cpu_build.py): one op per call streaming each present slot's factors once
  from the pool as it lies (fused.segment_matmul, broadcast-FMAs over a slot's rows for up to four tokens). On a
  2-core Zen 4 it beat every path below on every batch measured: a decode step's q,v factors of 40 slots over
  SmolLM2's 30 layers 6.3 vs the gather's 7.7 ms fp32 (4.1 vs 5.4 bf16); a q shrink + expand of 512 tokens over
  50 slots 0.35 ms vs gather 0.48, grouped 0.92; 4096 tokens over 50 slots 4.1 vs grouped 4.4, gather 5.1 (over
  8 slots 3.8 vs grouped 3.7). `method=None` takes it on CPU wherever it runs.
- "gather" (CPU): one F.embedding_bag per call. Row (s, i) of A.view(S*in, r) is weighted by x[t, i] and
  summed into z[t]; expand likewise over B.view(S*r, out). No weight copies, no per-adapter ops, no cost
  for empty slots; the [T, in] row index is built once per step and cached (chunked past a size cap).
- "grouped" (CPU): torch._grouped_mm over the slots between the lowest and highest present slot (a view,
  no copy). GEMM-efficient for long segments; every slot in that span costs ~1.5 us even when empty.
- "compact" (CPU): torch._grouped_mm over the k present slots, copied by index_select each call (k x in
  x r per call, never per token): for long segments in a sparsely used pool.
- "triton" (CUDA): the SGMV kernels of kernels/loraland_kernels/triton_sgmv.py (triton imported on first use).
- "loop": one matmul per segment (reference speed; tests and benchmarks only).
`method=None` picks triton on CUDA, "fused" on CPU where it runs, otherwise `Segments.cpu_method(pool dtype)`,
the rule measured by load_tests/bench_kernels.py. fp32 pools with long segments (>= 4 tokens per segment on
average, or one adapter): grouped when the slot span holds no more empty slots than there are tokens, else
compact. Otherwise the gather: decode batches, and always bf16/fp16 pools, whose small-rank GEMMs are 10-30x
slower than the gather on an AVX2 CPU.
Expand outputs are produced in token chunks of <= 8 MiB: a fresh [T, out] temporary per call costs more
in page faults than the GEMM itself.

Fused projections: one shrink over A_qkv [S, in, r_q + r_k + r_v], then `expand` per projection with the
column slice z[:, r0:r1] and the projection's own B; y may be a column slice of a fused output. Both are
taken as strided views (no caller copies); `expand_sliced` is that loop over projections.

Dtypes: the pool's dtype is the compute dtype (x is cast to it, z comes out in it); y keeps its own dtype.
fp32, bf16 and fp16 are supported, and bf16 activations with fp32 pools (fast on CPUs without AVX-512 bf16).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from loraland_kernels import fused
from loraland_kernels.segments import Segments, build_segments, run_spans  # noqa: F401 (part of this API)

GATHER_MAX_INDEX = 1 << 22  # entries of a cached gather index ([T, in]); longer batches are chunked
EXPAND_CHUNK_BYTES = 8 << 20  # largest [rows, out] temporary of expand (reused memory, no page faults)


def _pick(t: torch.Tensor, w: torch.Tensor, seg: Segments, method: str | None) -> str:
    if method is None:
        if t.is_cuda:
            return "triton" if _has_triton() else "gather"  # gather: correct on any device, no pool copies
        return "fused" if fused_runs(t, w) else seg.cpu_method(w.dtype)
    if method not in ("fused", "gather", "grouped", "compact", "triton", "loop"):
        raise ValueError(
            f"unknown method {method!r}: use fused, gather, grouped, compact, triton, loop or None (auto)"
        )
    return method


def fused_runs(t: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused segment op takes pool w for tensors on t's device (CPU, library built, fp32/bf16)."""
    return w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous() and fused.enabled(t.device)


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        logging.getLogger("loraland.kernels").warning(
            "triton is not installed: CUDA LoRA falls back to the gather path (pip install 'loraland[cuda]')"
        )
        return False
    return True


def _check(t: torch.Tensor, w: torch.Tensor, seg: Segments, what: str) -> None:
    if t.shape[0] != seg.num_tokens:
        raise ValueError(f"{what}: {t.shape[0]} tokens but the Segments were built for {seg.num_tokens}")
    if w.shape[0] < seg.span_hi:
        raise ValueError(f"{what}: the pool has {w.shape[0]} slots but the batch uses slot {seg.span_hi - 1}")


def shrink(x: torch.Tensor, A: torch.Tensor, seg: Segments, *, method: str | None = None) -> torch.Tensor:
    """Semantics: z[t] = x[t] @ A[s_t] for adapter tokens, z[t] = 0 where s_t = -1.

    x [T, in] (any strides), A [S, in, r] -> z [T, r] in A's dtype (x is cast to it).
    """
    _check(x, A, seg, "shrink")
    m = _pick(x, A, seg, method)
    if m == "triton":
        from loraland_kernels import triton_sgmv

        return triton_sgmv.shrink(x, A, seg)
    nb, r = seg.num_base, A.shape[2]
    xa = x[nb:].to(A.dtype)
    if not seg.slots:
        za = xa.new_zeros(0, r)
    elif m == "gather":
        rows = max(1, GATHER_MAX_INDEX // A.shape[1])
        parts = [_apply(xa[c0:c1], A, sub, m) for c0, c1, sub in seg.chunks(rows)]
        za = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        za = _apply(xa, A, seg, m)
    if nb == 0:
        return za
    z = za.new_zeros(seg.num_tokens, r)
    z[nb:] = za
    return z


def shrink_embedding(ids: torch.Tensor, A: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Semantics: z[t] = A[s_t, ids[t]] for adapter tokens (LoRA on an embedding: PEFT's
    F.embedding(ids, lora_embedding_A.T) with each token's own adapter), z[t] = 0 where s_t = -1.

    ids int [T] token ids, A [S, vocab, r] (lora_embedding_A transposed per slot) -> z [T, r] in A's dtype. One
    gather over A.view(S * vocab, r), whatever the number of adapters; then `expand` with B [S, r, hidden].
    """
    if ids.shape[0] != seg.num_tokens:
        raise ValueError(
            f"shrink_embedding: {ids.shape[0]} tokens but the Segments were built for {seg.num_tokens}"
        )
    if A.shape[0] < seg.span_hi:
        raise ValueError(
            f"shrink_embedding: the pool has {A.shape[0]} slots but the batch uses slot {seg.span_hi - 1}"
        )
    nb, vocab = seg.num_base, A.shape[1]
    rows = A.reshape(-1, A.shape[2])  # a view: the pool is contiguous
    za = F.embedding(seg.token_slot * vocab + ids[nb:].to(seg.token_slot.dtype), rows)
    if nb == 0:
        return za
    z = za.new_zeros(seg.num_tokens, A.shape[2])
    z[nb:] = za
    return z


def expand(
    y: torch.Tensor,
    z: torch.Tensor,
    B: torch.Tensor,
    seg: Segments,
    scale: torch.Tensor | None = None,
    *,
    base_scale: torch.Tensor | None = None,
    base_bias: torch.Tensor | None = None,
    method: str | None = None,
) -> None:
    """Semantics: y[t] += scale[s_t] * (z[t] @ B[s_t]) in place for adapter tokens; rows with s_t = -1
    are untouched; scale None means 1. With base_scale (DoRA), y[t] is first rescaled per output column:
    y[t] = base_scale[s_t] * (y[t] - base_bias) + base_bias, base_bias None meaning 0.

    y [T, out] (may be a column slice of a fused output), z [T, r] (may be a column slice z[:, r0:r1] of a
    fused shrink), B [S, r, out], scale [S] or None, base_scale [S, out] or None, base_bias [out] or None
    (only with base_scale). Computed in B's dtype, added in y's dtype.
    """
    if base_bias is not None and base_scale is None:
        raise ValueError(
            "expand: base_bias is the part of y that base_scale leaves unscaled; give base_scale"
        )
    if base_scale is not None and base_scale.shape != (B.shape[0], B.shape[2]):
        raise ValueError(
            f"expand: base_scale is {tuple(base_scale.shape)}, expected [{B.shape[0]}, {B.shape[2]}] (slots, out)"
        )
    _check(y, B, seg, "expand")
    if z.shape != (seg.num_tokens, B.shape[1]):
        raise ValueError(
            f"expand: z is {tuple(z.shape)}, expected [{seg.num_tokens}, {B.shape[1]}] (tokens, rank)"
        )
    if not seg.slots:
        return
    m = _pick(y, B, seg, method)
    if m == "triton":
        from loraland_kernels import triton_sgmv

        triton_sgmv.expand(y, z, B, seg, scale, base_scale=base_scale, base_bias=base_bias)
        return
    nb = seg.num_base
    za = z[nb:].to(B.dtype)
    if scale is not None:  # on z ([T, r]), the cheap side
        za = za * scale.to(B.dtype)[seg.token_slot][:, None]
    if m == "fused" and base_scale is None and y.dtype == B.dtype and y.stride(1) == 1 and fused_runs(y, B):
        # added into y where it lies (a column slice of a fused projection's output): no temporary, no add_
        fused.segment_matmul(za if za.stride(1) == 1 else za.contiguous(), B, seg.spans(), y[nb:])
        return
    rows = max(64, EXPAND_CHUNK_BYTES // (B.shape[2] * B.element_size()))
    for c0, c1, sub in seg.chunks(rows):
        yc, d = y[nb + c0 : nb + c1], _apply(za[c0:c1], B, sub, m)
        if base_scale is None:
            yc.add_(d)
            continue
        # DoRA: one gather of the rows' factors and one fused y*f + d (two more without a bias), whatever the
        # number of adapters; d is a fresh temporary, so the bias can be added to it in place
        if base_bias is not None:
            yc.sub_(base_bias)
            d.add_(base_bias)
        torch.addcmul(d, yc, F.embedding(sub.token_slot, base_scale), out=yc)


def expand_sliced(
    ys: list[torch.Tensor],
    z: torch.Tensor,
    Bs: list[torch.Tensor],
    seg: Segments,
    scales: list[torch.Tensor | None] | None = None,
    *,
    base_scales: list[torch.Tensor | None] | None = None,
    base_biases: list[torch.Tensor | None] | None = None,
    method: str | None = None,
) -> None:
    """Semantics: for projection j of rank r_j, ys[j] += scales[j] * z[:, c_j : c_j + r_j] @ Bs[j] per
    segment, with c_j = r_0 + ... + r_{j-1} (z from one shrink over the rank-concatenated A); with
    base_scales[j], ys[j] is first rescaled as `expand` says (DoRA).

    ys[j] [T, out_j], z [T, sum r_j], Bs[j] [S, r_j, out_j]; scales, base_scales, base_biases: None or one
    entry (or None) per projection. One expand per projection: the op count follows the projections, never
    the adapters.
    """
    if len(ys) != len(Bs):
        raise ValueError(f"expand_sliced: {len(ys)} outputs but {len(Bs)} B pools")
    if sum(B.shape[1] for B in Bs) != z.shape[1]:
        raise ValueError(
            f"expand_sliced: the B ranks sum to {sum(B.shape[1] for B in Bs)}, z has {z.shape[1]}"
        )
    c = 0
    for j, (y, B) in enumerate(zip(ys, Bs, strict=True)):
        r = B.shape[1]
        expand(
            y, z[:, c : c + r], B, seg, None if scales is None else scales[j],
            base_scale=None if base_scales is None else base_scales[j],
            base_bias=None if base_biases is None else base_biases[j], method=method,
        )  # fmt: skip
        c += r


def lora_linear_delta(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    seg: Segments,
    scale: torch.Tensor | None = None,
    *,
    base_scale: torch.Tensor | None = None,
    base_bias: torch.Tensor | None = None,
    method: str | None = None,
) -> None:
    """Semantics: y[t] += scale[s_t] * (x[t] @ A[s_t]) @ B[s_t] in place (shrink then expand), after the
    DoRA rescale of y[t] when base_scale is given (see `expand`).

    y [T, out], x [T, in], A [S, in, r], B [S, r, out], scale [S] or None, base_scale [S, out] or None,
    base_bias [out] or None.
    """
    z = shrink(x, A, seg, method=method)
    expand(y, z, B, seg, scale, base_scale=base_scale, base_bias=base_bias, method=method)


def _apply(a: torch.Tensor, w: torch.Tensor, seg: Segments, m: str) -> torch.Tensor:
    """out[t] = a[t] @ w[s_t] over the adapter tokens of seg: a [Ta, n], w [S, n, m] -> [Ta, m]."""
    if m == "loop":
        return _loop(a, w, seg)
    if m == "fused" and fused_runs(a, w):
        return fused.segment_matmul(a if a.stride(1) == 1 else a.contiguous(), w, seg.spans())
    if m == "fused":
        m = "gather"  # the op did not build here, or a pool it does not take: the same job through aten
    compact = m == "compact"
    out = _gather(a, w, seg) if m == "gather" else _grouped(a, w, seg, compact)
    if out is None:  # the other CPU path takes what this one refused (strides, alignment)
        out = _grouped(a, w, seg, compact) if m == "gather" else _gather(a, w, seg)
    return _loop(a, w, seg) if out is None else out


def _gather(a: torch.Tensor, w: torch.Tensor, seg: Segments) -> torch.Tensor | None:
    """One embedding_bag: row (s, i) of w.view(S*n, m) weighted by a[t, i]. None when w's rows are not
    contiguous (a copy of the pool per call is what this path exists to avoid)."""
    try:
        rows = w.view(-1, w.shape[2])
    except RuntimeError:
        return None
    if rows.stride(1) != 1 or rows.stride(0) != w.shape[2]:
        return None
    return F.embedding_bag(seg.rows(w.shape[1]), rows, mode="sum", per_sample_weights=a)


def _aligned(t: torch.Tensor) -> bool:
    # torch._grouped_mm wants 16-byte aligned data and strides
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all(st == 1 or st * es % 16 == 0 for st in t.stride())


def _grouped(a: torch.Tensor, w: torch.Tensor, seg: Segments, compact: bool = False) -> torch.Tensor | None:
    """One torch._grouped_mm over the slot span (a view of w), or with compact=True over a copy of the k
    present slots. None when w is not 16-byte aligned (odd ranks or widths)."""
    if not _aligned(w):
        return None
    if not _aligned(a):
        a = a.contiguous()  # activations only: cheap next to the pool
        if not _aligned(a):
            return None
    if compact:
        return torch._grouped_mm(a, w.index_select(0, seg.present), offs=seg.offs_present)
    return torch._grouped_mm(a, w[seg.span_lo : seg.span_hi], offs=seg.offs)


def _loop(a: torch.Tensor, w: torch.Tensor, seg: Segments) -> torch.Tensor:
    out, s = [], 0
    for slot, n in zip(seg.slots, seg.lens, strict=True):
        out.append(a[s : s + n] @ w[slot])
        s += n
    return torch.cat(out) if out else a.new_zeros(0, w.shape[2])
