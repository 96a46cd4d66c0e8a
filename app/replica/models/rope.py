"""Rotary position embeddings as Hugging Face defines them: default, linear, llama3 and LongRoPE, partial
rotation (the first fraction of each head), applied in place."""

from __future__ import annotations

import math

import torch


def inv_freq(theta: float, dim: int, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the cos/sin scaling for default, linear and llama3 RoPE (LongRoPE: see
    Rope, which keeps two tables)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = None if scaling is None else scaling["rope_type"]
    if kind is None:
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind != "llama3":
        raise ValueError(f"inv_freq: rope type {kind!r} has no single table")
    # llama3: long wavelengths scaled by `factor`, short kept, smooth in between
    factor, lo, hi = (
        scaling["factor"],
        scaling.get("low_freq_factor", 1.0),
        scaling.get("high_freq_factor", 4.0),
    )
    old = scaling["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
    return torch.where(is_medium, smoothed, inv_l), 1.0


class Rope:
    """One RoPE table set. `rot_dim` of each head's head_dim leading dims rotate; the rest pass through.

    LongRoPE (Phi-3/Phi-4): short factors while a sequence is at most original_max_position_embeddings long,
    long factors once it is longer, chosen per token by its sequence's length after the step. transformers does
    the same per forward and, when a sequence first crosses the threshold, recomputes its whole cache with the
    long factors; the engine does the same (a crossing sequence is recomputed: Model.needs_recompute)."""

    def __init__(
        self, theta: float, head_dim: int, scaling: dict | None, partial: float, device: torch.device
    ):
        self.rot_dim = int(head_dim * partial)
        self.longrope_at: int | None = None
        if scaling is not None and scaling["rope_type"] == "longrope":
            shape = torch.arange(0, self.rot_dim, 2, dtype=torch.int64).float() / self.rot_dim
            base = theta**shape
            short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
            long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
            self.inv, self.inv_long = short.to(device), long.to(device)
            self.scaling = float(scaling["attention_factor"])
            self.longrope_at = int(scaling["original_max_position_embeddings"])
        else:
            inv, self.scaling = inv_freq(theta, self.rot_dim, scaling)
            self.inv, self.inv_long = inv.to(device), None

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rot_dim / 2] (HF's cat((freqs, freqs)) repeats the same half)."""
        inv = self.inv[None, :]
        if self.inv_long is not None and seq_lens is not None:
            inv = torch.where((seq_lens > self.longrope_at)[:, None], self.inv_long[None, :], inv)
        freqs = positions.float()[:, None] * inv
        cos = (freqs.cos() * self.scaling).to(dtype)[:, None, :]
        sin = (freqs.sin() * self.scaling).to(dtype)[:, None, :]
        return cos, sin


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary in place on x [T, heads, d] over its first 2 * cos.shape[-1] dims (cos/sin [T, 1, r/2]): HF's
    x*cos + rotate_half(x)*sin, the same products and sums (no fused multiply-add), without the copy."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    x2_sin = x2 * sin
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
