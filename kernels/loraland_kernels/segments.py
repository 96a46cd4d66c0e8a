"""A forward step's tokens as segments of one adapter slot each: built once per step and pool, read by every
layer's shrink and expand (the torch paths in lora.py and the Triton kernels in triton_sgmv.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GROUPED_MIN_MEAN_SEGMENT = 4  # fp32: tokens per segment from which one GEMM per slot beats the gather


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
    _spans: torch.Tensor | None = field(default=None, repr=False)

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

    def spans(self) -> torch.Tensor:
        """int64 [k, 3] (slot, first, end) of each segment, in adapter-token positions (CPU); cached."""
        if self._spans is None:
            self._spans = run_spans(self.token_slot.cpu())
        return self._spans

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


def run_spans(ids: torch.Tensor) -> torch.Tensor:
    """ids int [n] -> int64 [k, 3]: (value, first, end) of each run of equal consecutive values, the runs one
    after the other from 0 to n (the spans fused.segment_matmul takes)."""
    values, lens = torch.unique_consecutive(ids, return_counts=True)
    ends = lens.cumsum(0)
    return torch.stack([values.long(), ends - lens, ends], 1)


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
