"""Merges of LoRA adapters as one virtual adapter: `a*0.7+b*0.3` (cat), and PEFT's other combination types
(`ties(a*0.7+b*0.3;density=0.5)`, ...; app/names.py has the grammar, peft_merges.py the arithmetic).

The exact merge of LoRAs is a concatenation along the rank axis: A = [w1*s1*A1; w2*s2*A2], B = [B1, B2],
scale 1.0. Every merge result is a plain LoraWeights, so the device pools and kernels serve it like any adapter.
DoRA adapters are not merged: PEFT's add_weighted_adapter ignores their magnitude vectors.
"""

from __future__ import annotations

import functools
import math

from app.config.model_config import ROUTER_MODULE
from app.errors import InvalidRequest
from app.merge_methods import MergeMethod
from app.replica.lora.weights import LoraWeights, pad_ranks


def merge_adapters(
    terms: list[tuple[LoraWeights, float]],
    name: str,
    *,
    method: MergeMethod | None = None,
    max_rank: int | None = None,
) -> LoraWeights:
    """The merge of `terms` by `method` (None: cat) as one adapter named `name`, at scale 1.0.

    cat: sum_i w_i * delta_i as one wider adapter: per (layer, module), A = [w1*s1*A1; w2*s2*A2; ...],
    B = [B1, B2, ...], concatenating only the terms that carry that (layer, module); then ranks are
    zero-padded per module (see app/replica/lora/weights.py). Other kinds: as PEFT's add_weighted_adapter
    (peft_merges.py).

    Equals PEFT's add_weighted_adapter(..., combination_type="cat") delta for delta, with two PEFT quirks we do
    not copy: its merged config takes use_rslora and layers_to_transform from the FIRST adapter, so when that one
    uses rslora PEFT's merge is scaled by sqrt(total rank) instead of 1, and when it has layers_to_transform
    PEFT drops the other adapters' other layers. Ours is always exactly sum_i w_i * delta_i."""
    if not terms:
        raise InvalidRequest("a merge needs at least one adapter term, e.g. 'a*0.7+b*0.3'")
    for lw, w in terms:
        if not isinstance(w, (int, float)) or not math.isfinite(w):
            raise InvalidRequest(f"merge weight {w!r} for adapter {lw.name!r} must be a finite number")
        if lw.is_dora:
            raise InvalidRequest(
                f"adapter {lw.name!r} is a DoRA adapter (use_dora): merging DoRA adapters is not supported "
                "(PEFT's add_weighted_adapter ignores their magnitude vectors); serve it on its own"
            )
        if lw.expert_tensors or any(m == ROUTER_MODULE for _, m in lw.tensors):
            raise InvalidRequest(
                f"adapter {lw.name!r} adapts a mixture-of-experts model's experts or router (target_parameters): merging "
                "such adapters is not supported yet; serve it on its own"
            )
        if lw.touches_vocab:
            raise InvalidRequest(
                f"adapter {lw.name!r} adapts embed_tokens/lm_head (LoRA on them or modules_to_save): merging such "
                "adapters is not supported (a merge of full copies has no LoRA form); serve it on its own or in a "
                "chain"
            )
    keys = sorted({k for lw, _ in terms for k in lw.tensors})
    for key in keys:
        shapes = {
            (lw.tensors[key][0].shape[1], lw.tensors[key][1].shape[0]) for lw, _ in terms if key in lw.tensors
        }
        if len(shapes) > 1:
            raise InvalidRequest(
                f"merge {name!r}: adapters disagree on the shape of layer {key[0]} {key[1]}: {shapes}"
            )
    kind = "cat" if method is None else method.kind
    if kind == "cat":
        tensors = _cat(terms, keys)
    else:
        from app.replica.lora.peft_merges import peft_merge  # torch, only where a merge is built

        tensors, kind = peft_merge(terms, method)
    tensors = pad_ranks(tensors)
    rank = max((a.shape[0] for a, _ in tensors.values()), default=0)
    if max_rank is not None and rank > max_rank:
        why = "sum of its terms' ranks" if kind == "cat" else "svd_rank or its terms' rank"
        raise InvalidRequest(f"merge {name!r} has rank {rank} ({why}), over max_lora_rank={max_rank}")
    label = "+".join(f"{lw.name}*{w:g}" for lw, w in terms)
    return LoraWeights(
        name=name,
        rank=rank,
        alpha=float(rank),  # alpha == r, as in PEFT's merged config: scale 1.0, the weights are folded into A
        use_rslora=False,
        scale=1.0,
        target_modules=frozenset(m for _, m in tensors),
        layers=tuple(sorted({lay for lay, _ in tensors})),
        tensors=tensors,
        source=f"merge:{label}" if method is None else "merge:" + method.text(label),
    )


def _cat(terms: list[tuple[LoraWeights, float]], keys: list) -> dict:
    """Per (layer, module): A = [w1*s1*A1; w2*s2*A2; ...] and B = [B1, B2, ...], written once each into
    column-major tensors, the layout read_adapter gives (A [r, in] stored as [in, r], B [out, r] as [r, out]):
    the device pools hold A^T and B^T, so installing the merge on the engine thread is then a plain copy, and
    building it is one pass over each term's tensors, the scaling fused into A's copy."""
    import torch

    tensors = {}
    for key in keys:
        parts = [(lw.tensors[key], w * lw.scale) for lw, w in terms if key in lw.tensors]
        (a0, b0), _ = parts[0]
        rank = sum(a.shape[0] for (a, _), _ in parts)
        a_dtype = functools.reduce(torch.promote_types, (a.dtype for (a, _), _ in parts))
        b_dtype = functools.reduce(torch.promote_types, (b.dtype for (_, b), _ in parts))
        a = torch.empty(a0.shape[1], rank, dtype=a_dtype, device=a0.device).t()
        b = torch.empty(rank, b0.shape[0], dtype=b_dtype, device=b0.device).t()
        at = 0
        for (pa, pb), s in parts:
            r = pa.shape[0]
            torch.mul(pa, s, out=a[at : at + r])
            b[:, at : at + r].copy_(pb)
            at += r
        tensors[key] = (a, b)
    return tensors
