"""Grouped multi-LoRA (Punica SGMV) over a flat token batch sorted by adapter slot.

A pool holds S slots of one rank r: A [S, in, r], B [S, r, out]. Tokens of a slot are contiguous; slot -1
(no adapter) may only lead the batch. For every segment with slot s >= 0:
    shrink:  z[seg] = x[seg] @ A[s]                        ([T, in] -> [T, r])
    expand:  y[seg] += scale[s] * z[seg] @ B[s]            ([T, r] -> [T, out], in place)
DoRA adapters also rescale the base output per output column before the delta is added (base_scale [S, out],
the part base_bias [out] of y left unscaled): y[seg] = base_scale[s] * (y[seg] - base_bias) + base_bias + ...
kernels/loraland_kernels/reference.py is the definition the paths below are tested against.

Paths (`method`):
- "gather" (CPU): one F.embedding_bag per call. Row (s, i) of A.view(S*in, r) is weighted by x[t, i] and
  summed into z[t]; expand likewise over B.view(S*r, out). No weight copies, no per-adapter ops, no cost
  for empty slots; the [T, in] row index is built once per step and cached (chunked past a size cap).
- "grouped" (CPU): torch._grouped_mm over the slots between the lowest and highest present slot (a view,
  no copy). GEMM-efficient for long segments; every slot in that span costs ~1.5 us even when empty.
- "compact" (CPU): torch._grouped_mm over the k present slots, copied by index_select each call (k x in
  x r per call, never per token): for long segments in a sparsely used pool.
- "triton" (CUDA): the SGMV kernels of kernels/loraland_kernels/triton_sgmv.py (triton imported on first use).
- "loop": one matmul per segment (reference speed; tests and benchmarks only).
`method=None` picks triton on CUDA, otherwise `Segments.cpu_method(pool dtype)`, the rule measured by
load_tests/bench_kernels.py. fp32 pools with long segments (>= 4 tokens per segment on average, or one
adapter): grouped when the slot span holds no more empty slots than there are tokens, else compact.
Otherwise the gather: decode batches, and always bf16/fp16 pools, whose small-rank GEMMs are 10-30x
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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

GROUPED_MIN_MEAN_SEGMENT = 4  # fp32: tokens per segment from which one GEMM per slot beats the gather
GATHER_MAX_INDEX = 1 << 22  # entries of a cached gather index ([T, in]); longer batches are chunked
EXPAND_CHUNK_BYTES = 8 << 20  # largest [rows, out] temporary of expand (reused memory, no page faults)


@dataclass
class Segments:
    """One pool's view of a forward step: built once by build_segments, reused by every layer's calls.
    Token positions in slots/offs/token_slot count from the first adapter token (after num_base)."""

    num_tokens: int  # T
    num_base: int  # leading tokens with slot -1 (no adapter)
    num_slots: int  # S of the pool
    slots: list[int]  # slot of each segment, ascending, all >= 0
    lens: list[int]  # tokens of each segment
    token_slot: torch.Tensor  # int64 [T - num_base], slot of every adapter token
    # grouped_mm: the groups are slots span_lo .. span_hi-1 (A[span_lo:span_hi] is a view)
    span_lo: int
    span_hi: int
    offs: torch.Tensor  # int32 [span_hi - span_lo], cumulative tokens per slot (CPU)
    present: torch.Tensor  # int64 [k] slots present (CPU), for compaction
    offs_present: torch.Tensor  # int32 [k], cumulative tokens per present slot (CPU)
    # triton: one program row per segment (absolute token positions, on the batch's device)
    seg_start: torch.Tensor  # int32 [k]
    seg_len: torch.Tensor  # int32 [k]
    seg_slot: torch.Tensor  # int32 [k]
    max_seg_len: int
    cache_rows: bool = True
    _rows: dict = field(default_factory=dict, repr=False)
    _chunks: dict = field(default_factory=dict, repr=False)

    @property
    def num_adapter_tokens(self) -> int:
        return self.num_tokens - self.num_base

    def cpu_method(self, pool_dtype: torch.dtype) -> str:
        """The measured rule (load_tests/bench_kernels.py): "grouped", "compact" or "gather"."""
        n, k = self.num_adapter_tokens, len(self.slots)
        long_segments = n >= GROUPED_MIN_MEAN_SEGMENT * k or k == 1  # k == 1: a single GEMM
        if pool_dtype != torch.float32 or not k or not long_segments:
            return "gather"
        # an empty group in the span costs about what a token row does; past that, copying the k present
        # slots (k <= n / 4 here) is cheaper than walking the empty ones
        return "grouped" if (self.span_hi - self.span_lo) - k <= n else "compact"

    def rows(self, width: int) -> torch.Tensor:
        """[T - num_base, width] gather index: entry (t, j) = token_slot[t] * width + j."""
        if width in self._rows:
            return self._rows[width]
        dt = torch.int32 if self.num_slots * width < 2**31 else torch.int64
        base = (self.token_slot * width).to(dt)
        idx = base[:, None] + torch.arange(width, dtype=dt, device=base.device)
        if self.cache_rows:
            self._rows[width] = idx
        return idx

    def chunks(self, rows: int) -> list[tuple[int, int, Segments]]:
        """The adapter tokens cut into runs of <= rows tokens: (start, end, their Segments); cached."""
        n = self.num_adapter_tokens
        if n <= rows:
            return [(0, n, self)]
        if rows not in self._chunks:
            self._chunks[rows] = [
                (c, min(n, c + rows), _build(self.token_slot[c : c + rows], self.num_slots, cache_rows=False))
                for c in range(0, n, rows)
            ]
        return self._chunks[rows]


def build_segments(slot_ids: torch.Tensor, num_slots: int) -> Segments:
    """Semantics: splits a sorted per-token slot vector into segments.

    slot_ids int [T], ascending, values in -1 .. num_slots-1 (-1 = no adapter, only at the start);
    num_slots = S of the pool. Call once per forward step per pool (one host sync); reuse for every layer.
    """
    return _build(slot_ids, num_slots, cache_rows=True)


def _build(slot_ids: torch.Tensor, num_slots: int, cache_rows: bool) -> Segments:
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids must be 1-D [T], got shape {tuple(slot_ids.shape)}")
    device = slot_ids.device
    ids = slot_ids.detach().to("cpu", torch.int64)
    T = ids.numel()
    if T and bool((ids[1:] < ids[:-1]).any()):
        raise ValueError(
            "slot_ids must be sorted ascending (each slot's tokens contiguous, -1 first): sort the batch"
        )
    if T and (int(ids[0]) < -1 or int(ids[-1]) >= num_slots):
        raise ValueError(
            f"slot ids must lie in -1..{num_slots - 1} (num_slots={num_slots}), got "
            f"{int(ids[0])}..{int(ids[-1])}"
        )
    num_base = int((ids < 0).sum())
    act = ids[num_base:]
    uniq, counts = torch.unique_consecutive(act, return_counts=True)
    slots, lens = uniq.tolist(), counts.tolist()
    lo, hi = (slots[0], slots[-1] + 1) if slots else (0, 0)
    per_slot = torch.zeros(hi - lo, dtype=torch.int64)
    per_slot[uniq - lo] = counts
    starts = (torch.cumsum(counts, 0) - counts + num_base).tolist()
    return Segments(
        num_tokens=T, num_base=num_base, num_slots=num_slots, slots=slots, lens=lens,
        token_slot=act.to(device), span_lo=lo, span_hi=hi, offs=per_slot.cumsum(0).to(torch.int32),
        present=uniq, offs_present=counts.cumsum(0).to(torch.int32),
        seg_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seg_len=torch.tensor(lens, dtype=torch.int32, device=device),
        seg_slot=torch.tensor(slots, dtype=torch.int32, device=device),
        max_seg_len=max(lens, default=0), cache_rows=cache_rows,
    )  # fmt: skip


def _pick(t: torch.Tensor, w: torch.Tensor, seg: Segments, method: str | None) -> str:
    if method is None:
        if t.is_cuda:
            return "triton" if _has_triton() else "gather"  # gather: correct on any device, no pool copies
        return seg.cpu_method(w.dtype)
    if method not in ("gather", "grouped", "compact", "triton", "loop"):
        raise ValueError(
            f"unknown method {method!r}: use gather, grouped, compact, triton, loop or None (auto)"
        )
    return method


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
