"""Plain-torch loops that define grouped multi-LoRA (Punica SGMV) semantics; the fast paths are tested
against these. Slow on purpose: one matmul per segment, computed in float32 whatever the input dtype."""

from __future__ import annotations

import torch


def segments_of(slot_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, slot) of every run of equal slot ids, in token order (slot -1 runs included)."""
    ids = slot_ids.tolist()
    out, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[start]:
            out.append((start, t, ids[start]))
            start = t
    return out


def shrink_ref(x: torch.Tensor, A: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """Semantics: z[t] = x[t] @ A[slot_ids[t]], and z[t] = 0 where slot_ids[t] = -1.

    x [T, in], A [S, in, r], slot_ids int [T] (tokens of a slot contiguous) -> z [T, r] in float32.
    """
    z = torch.zeros(x.shape[0], A.shape[2], dtype=torch.float32, device=x.device)
    for s, e, slot in segments_of(slot_ids):
        if slot >= 0:
            z[s:e] = x[s:e].float() @ A[slot].float()
    return z


def expand_ref(
    y: torch.Tensor,
    z: torch.Tensor,
    B: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: torch.Tensor | None = None,
    base_scale: torch.Tensor | None = None,
    base_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: returns y[t] + scale[slot_ids[t]] * (z[t] @ B[slot_ids[t]]), y[t] unchanged where the
    slot is -1; scale None means 1. With base_scale (DoRA), y[t] is replaced first by
    base_scale[slot] * (y[t] - base_bias) + base_bias (base_bias None means 0).

    y [T, out], z [T, r], B [S, r, out], slot_ids int [T], scale [S] or None, base_scale [S, out] or None,
    base_bias [out] or None -> [T, out] in float32 (y itself is not modified).
    """
    out = y.float().clone()
    bias = 0.0 if base_bias is None else base_bias.float()
    for s, e, slot in segments_of(slot_ids):
        if slot >= 0:
            if base_scale is not None:
                out[s:e] = base_scale[slot].float() * (out[s:e] - bias) + bias
            w = 1.0 if scale is None else float(scale[slot])
            out[s:e] += w * (z[s:e].float() @ B[slot].float())
    return out


def lora_delta_ref(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: delta[t] = scale[s] * (x[t] @ A[s]) @ B[s] with s = slot_ids[t]; 0 where s = -1.

    x [T, in], A [S, in, r], B [S, r, out] -> delta [T, out] in float32.
    """
    z = shrink_ref(x, A, slot_ids)
    return expand_ref(torch.zeros(x.shape[0], B.shape[2], device=x.device), z, B, slot_ids, scale)


def dora_linear_ref(
    x: torch.Tensor,
    W: torch.Tensor,
    bias: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: float,
    magnitude: torch.Tensor,
) -> torch.Tensor:
    """Semantics: PEFT's DoRA linear at eval (dropout off), written out: with the LoRA delta dW = scale * B @ A
    and the detached column norm n = ||W + dW|| over the input axis (one per output), the output is
    (magnitude / n) * (x @ (W + dW)^T) + bias; the bias is not rescaled.

    x [T, in], W [out, in], bias [out] or None, A [r, in], B [out, r], magnitude [out] -> [T, out] float32.
    """
    Wd = W.float() + scale * (B.float() @ A.float())
    f = magnitude.float() / torch.linalg.norm(Wd, dim=1)
    y = f * (x.float() @ Wd.t())
    return y if bias is None else y + bias.float()


def shrink_embedding_ref(ids: torch.Tensor, A: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """Semantics: z[t] = A[slot_ids[t], ids[t]] (the LoRA A of an embedding: PEFT's
    F.embedding(ids, lora_embedding_A.T)), and z[t] = 0 where slot_ids[t] = -1.

    ids int [T] token ids, A [S, vocab, r] (each slot's lora_embedding_A transposed), slot_ids int [T] -> z [T, r]
    in float32.
    """
    z = torch.zeros(ids.shape[0], A.shape[2], dtype=torch.float32, device=ids.device)
    for t in range(ids.shape[0]):
        if int(slot_ids[t]) >= 0:
            z[t] = A[int(slot_ids[t]), int(ids[t])].float()
    return z
