"""PEFT's add_weighted_adapter combination types other than cat, computed as PEFT computes them.

Two families (peft/tuners/lora/model.py, peft/utils/merge_utils.py), per targeted (layer, module), over the
terms that carry it:
- entrywise on A and B (linear, ties, dare_linear, dare_ties, magnitude_prune): each term's A is weighted by
  sign(w*s) * sqrt(|w*s|) and its B by sqrt(|w*s|) (s: the term's LoRA scale), then A's are combined with A's
  and B's with B's. Every term must have the same rank (PEFT refuses otherwise). The result is rank r.
- on the full deltas w_i * s_i * B_i @ A_i (svd, ties_svd, dare_linear_svd, dare_ties_svd,
  magnitude_prune_svd), then truncated to svd_rank (default: the largest term rank) by an SVD:
  B = U[:, :k] diag(S[:k]), A = Vh[:k] (optionally clamped at the svd_clamp quantile).
The merged adapter has scale 1. DARE's random masks come from a torch.Generator seeded with the merge's
seed, drawn in PEFT's order (modules in the model's order, then terms; A's before B's): PEFT draws from torch's
global RNG in that same order, so PEFT seeded with the same number right before its merge loop gives the
same masks.
PEFT quirk not copied (as for cat, see merge.py): its merged config takes use_rslora and layers_to_transform
from the first adapter.
"""

from __future__ import annotations

import math

import torch

from app.config.model_config import LORA_MODULES
from app.errors import InvalidRequest
from app.merge_methods import MergeMethod
from app.replica.lora.weights import LoraWeights, Tensors

ENTRYWISE = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")


# ---- peft.utils.merge_utils, with an explicit generator for DARE
def _prune(t: torch.Tensor, density: float, how: str, gen: torch.Generator | None) -> torch.Tensor:
    if density >= 1:  # PEFT returns before drawing: no random numbers consumed
        return t
    if how == "magnitude":
        mask = torch.zeros_like(t).reshape(-1)
        mask[torch.topk(t.abs().reshape(-1), k=int(density * t.numel()), largest=True)[1]] = 1
        return t * mask.reshape(t.shape)
    return t * torch.bernoulli(torch.full_like(t, density), generator=gen) / density  # DARE rescales


def _combine(ts: list[torch.Tensor], weights: torch.Tensor, m: MergeMethod, gen) -> torch.Tensor:
    kind = m.kind.removesuffix("_svd")
    if kind in ("ties", "magnitude_prune"):
        ts = [_prune(t, m.density, "magnitude", None) for t in ts]
    elif kind in ("dare_linear", "dare_ties"):
        ts = [_prune(t, m.density, "random", gen) for t in ts]
    stacked = torch.stack(ts, 0)
    weighted = stacked * weights.view(weights.shape + (1,) * (stacked.dim() - 1))
    if kind not in ("ties", "dare_ties"):
        return weighted.sum(0)
    sign = stacked.sign()  # TIES: elect each entry's sign, average the terms that agree with it
    mass = stacked.sum(0) if m.majority_sign_method == "total" else sign.sum(0)
    agree = sign == torch.where(mass >= 0, 1, -1)
    return (weighted * agree).sum(0) / torch.clamp(agree.sum(0), min=1.0)


# ---- the merge
def peft_merge(terms: list[tuple[LoraWeights, float]], method: MergeMethod) -> tuple[Tensors, str]:
    """Per (layer, module): the merged (A [k, in], B [out, k]) at scale 1. Returns (tensors, kind actually
    used): one term is merged linearly, as PEFT does."""
    kind = "linear" if len(terms) == 1 else method.kind
    m = MergeMethod(**{**method.__dict__, "kind": kind}) if kind != method.kind else method
    entrywise = kind in ENTRYWISE
    if entrywise:
        _check_entrywise(terms, kind)
    svd_rank = m.svd_rank or max(lw.rank for lw, _ in terms)
    gen = torch.Generator().manual_seed(m.seed) if m.seed is not None else None
    order = {mod: i for i, mod in enumerate(LORA_MODULES)}
    keys = sorted({k for lw, _ in terms for k in lw.tensors}, key=lambda k: (k[0], order[k[1]]))
    out: Tensors = {}
    for key in keys:
        valid = [(lw, w) for lw, w in terms if key in lw.tensors]
        if entrywise:
            ws = [w * lw.scale for lw, w in valid]
            wa = torch.tensor([math.sqrt(abs(x)) * (1 if x >= 0 else -1) for x in ws])
            wb = torch.tensor([math.sqrt(abs(x)) for x in ws])
            # contiguous: DARE's masks are drawn in memory order, and PEFT's tensors are row-major
            a = _combine([lw.tensors[key][0].contiguous() for lw, _ in valid], wa, m, gen)
            b = _combine([lw.tensors[key][1].contiguous() for lw, _ in valid], wb, m, gen)
            out[key] = (a, b)
        else:
            deltas = [lw.delta(*key).contiguous() for lw, _ in valid]
            delta = _combine(deltas, torch.tensor([w for _, w in valid]), m, gen)
            out[key] = _svd(delta, svd_rank, m.svd_clamp)
    return out, kind


def _svd(delta: torch.Tensor, rank: int, clamp: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)  # the leading k are those of the full SVD
    k = min(rank, S.shape[0])
    U, Vh = U[:, :k] @ torch.diag(S[:k]), Vh[:k, :]
    if clamp is not None:
        hi = torch.quantile(torch.cat([U.flatten(), Vh.flatten()]), clamp)
        U, Vh = U.clamp(-hi, hi), Vh.clamp(-hi, hi)
    return Vh.contiguous(), U.contiguous()


def _check_entrywise(terms: list[tuple[LoraWeights, float]], kind: str) -> None:
    for lw, _ in terms:
        if lw.patterned:
            raise InvalidRequest(
                f"a {kind} merge mixes the terms' lora_A and lora_B entrywise, so each term needs one rank and "
                f"one alpha for every module; adapter {lw.name!r} uses rank_pattern/alpha_pattern: use "
                f"{kind if kind.endswith('_svd') else kind + '_svd'} (linear: svd) or cat instead"
            )
    ranks = {lw.name: lw.rank for lw, _ in terms}
    if len(set(ranks.values())) > 1:
        raise InvalidRequest(
            f"a {kind} merge needs every term to have the same rank r (PEFT's rule), got {ranks}: use an _svd "
            "kind (svd, ties_svd, ...) or cat to merge adapters of different ranks"
        )
