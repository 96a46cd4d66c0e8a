"""Linear merges of LoRA adapters (`a*0.7+b*0.3`) as one wider virtual adapter.

A linear merge of LoRAs is exactly a concatenation along the rank axis: A = [w1*s1*A1; w2*s2*A2], B = [B1, B2],
scale 1.0. The result is a plain LoraWeights, so the device pools and kernels serve it like any adapter.
"""

from __future__ import annotations

import math

from app.errors import InvalidRequest
from app.replica.lora.weights import LoraWeights, pad_ranks


def merge_adapters(
    terms: list[tuple[LoraWeights, float]], name: str, *, max_rank: int | None = None
) -> LoraWeights:
    """Linear merge sum_i w_i * delta_i as one wider adapter: per (layer, module), A = [w1*s1*A1; w2*s2*A2; ...],
    B = [B1, B2, ...], scale 1.0, concatenating only the terms that carry that (layer, module); then ranks are
    zero-padded per module (see app/replica/lora/weights.py).

    Equals PEFT's add_weighted_adapter(..., combination_type="cat") delta for delta, with two PEFT quirks we do
    not copy: its merged config takes use_rslora and layers_to_transform from the FIRST adapter, so when that one
    uses rslora PEFT's merge is scaled by sqrt(total rank) instead of 1, and when it has layers_to_transform
    PEFT drops the other adapters' other layers. Ours is always exactly sum_i w_i * delta_i."""
    import torch

    if not terms:
        raise InvalidRequest("a merge needs at least one adapter term, e.g. 'a*0.7+b*0.3'")
    for lw, w in terms:
        if not isinstance(w, (int, float)) or not math.isfinite(w):
            raise InvalidRequest(f"merge weight {w!r} for adapter {lw.name!r} must be a finite number")
    keys = sorted({k for lw, _ in terms for k in lw.tensors})
    tensors = {}
    for key in keys:
        parts = [(lw.tensors[key], w * lw.scale) for lw, w in terms if key in lw.tensors]
        shapes = {(a.shape[1], b.shape[0]) for (a, b), _ in parts}
        if len(shapes) > 1:
            raise InvalidRequest(
                f"merge {name!r}: adapters disagree on the shape of layer {key[0]} {key[1]}: {shapes}"
            )
        a = torch.cat([a * s for (a, _), s in parts], 0)
        b = torch.cat([b for (_, b), _ in parts], 1)
        tensors[key] = (a, b)
    tensors = pad_ranks(tensors)
    rank = max((a.shape[0] for a, _ in tensors.values()), default=0)
    if max_rank is not None and rank > max_rank:
        raise InvalidRequest(
            f"merge {name!r} has rank {rank} (sum of its terms' ranks), over max_lora_rank={max_rank}"
        )
    return LoraWeights(
        name=name,
        rank=rank,
        alpha=float(rank),  # alpha == r, as in PEFT's merged config: scale 1.0, the weights are folded into A
        use_rslora=False,
        scale=1.0,
        target_modules=frozenset(m for _, m in tensors),
        layers=tuple(sorted({lay for lay, _ in tensors})),
        tensors=tensors,
        source="merge:" + "+".join(f"{lw.name}*{w:g}" for lw, w in terms),
    )
