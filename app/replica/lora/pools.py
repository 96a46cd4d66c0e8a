"""Device pools: adapters' tensors laid out for the grouped LoRA kernels, and the per-step LoRA plan.

Adapters with the same shape signature (rank of every targeted (layer, module), and DoRA or not) share one
pool, so a rank-4 adapter never pays for rank-64 slots and a q/v adapter never pays for MLP slots. Per (layer,
fused linear) a pool holds A [cap, in, sum of ranks] (q/k/v and gate/up A's side by side, so one shrink serves
all three) and one B [cap, r, out] per module with alpha/r folded in. A DoRA pool also holds, per module, the
factor f [cap, out] (dora.py) and the base linear's bias [out] (shared by the slots): its B has f folded in too,
and the expand rescales the base output of its rows by f (kernels/loraland_kernels/lora.py). Plain LoRA pools
carry neither. One fused linear's tensors in one pool are a GroupWeights (app/replica/lora/group_weights.py).

LoRA on embed_tokens/lm_head sits in the pool too (`vocab_groups`, the same layout: embed_tokens' A is its
lora_embedding_A transposed, [cap, vocab, r], read by the kernels' shrink_embedding; lm_head's is
[cap, hidden, r]), and full per-adapter copies (modules_to_save) one tensor per slot (`copies`): they are large,
so never stacked.
The model calls `LoraBatch.embed` right after the embedding and `LoraBatch.head` right after the lm_head, whose
rows are only the sampled positions (`logits_idx`): each row takes its token's adapter.

Pools are touched only on the engine thread (install on admit, remove on eviction, reads in LoraBatch.apply).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from loraland_kernels import lora as K

from app.config.model_config import ModelConfig
from app.replica.lora.experts import ExpertWeights, apply_experts, expert_shapes
from app.replica.lora.group_weights import GROUPS, GroupWeights
from app.replica.lora.weights import LoraWeights


class Signature(NamedTuple):
    """What decides an adapter's pool: its sorted (layer, module, rank) entries, and whether it is DoRA."""

    ranks: tuple[tuple[int, str, int], ...]
    dora: bool = False
    vocab: tuple[tuple[str, int], ...] = ()  # LoRA on embed_tokens/lm_head: (module, rank)
    copies: tuple[str, ...] = ()  # modules_to_save: modules held whole per slot
    experts: tuple[tuple[int, str, int], ...] = ()  # LoRA on MoE experts: (layer, "gate_up"|"down", rank)


class Pool:
    """Slots for adapters of one shape signature. On CPU the tensors are allocated for max_adapters slots up
    front with torch.empty: untouched pages are never committed, so memory follows the slots in use. On CUDA
    they grow by doubling."""

    def __init__(
        self,
        index: int,
        signature: Signature,
        cfg: ModelConfig,
        max_slots: int,
        dtype,
        device,
        biases: Callable[[int, str], torch.Tensor | None] | None = None,
    ):
        """`biases(layer, module)`: the base linears' biases, needed by (and only by) a DoRA pool."""
        self.index, self.signature = index, signature
        if signature.dora and biases is None:
            raise ValueError("a DoRA pool needs the base linears' biases (biases=BaseWeights.bias)")
        ranks = {(layer, m): r for layer, m, r in signature.ranks}
        shapes = cfg.linear_shapes()
        offsets = {
            "q_proj": 0,
            "k_proj": shapes["q_proj"][1],
            "v_proj": shapes["q_proj"][1] + shapes["k_proj"][1],
            "gate_proj": 0,
            "up_proj": shapes["gate_proj"][1],
            "o_proj": 0,
            "down_proj": 0,
            "gate": 0,  # an MoE router
        }
        self.cap = max_slots if device.type == "cpu" else min(8, max_slots)
        self.max_slots = max_slots
        self.groups: dict[tuple[int, str], GroupWeights] = {}
        for layer in sorted({lay for lay, _ in ranks}):
            for g, modules in GROUPS.items():
                present = [
                    (m, ranks[(layer, m)], shapes[m][1], offsets[m]) for m in modules if (layer, m) in ranks
                ]
                if present:
                    bias = {m: biases(layer, m) for m, *_ in present} if signature.dora else None
                    self.groups[(layer, g)] = GroupWeights(
                        self.cap, shapes[modules[0]][0], present, dtype, device, bias
                    )
        V, H = cfg.vocab_size, cfg.hidden_size
        self.vocab_groups = {
            m: GroupWeights(self.cap, V if m == "embed_tokens" else H, [(m, r, H if m == "embed_tokens" else V, 0)],
                            dtype, device)
            for m, r in signature.vocab
        }  # fmt: skip
        xs = expert_shapes(cfg) if signature.experts else {}
        self.expert_groups = {
            (layer, g): ExpertWeights(self.cap, cfg.num_experts, xs[g][0], r, xs[g][1], dtype, device)
            for layer, g, r in signature.experts
        }
        self.copies: dict[str, dict[int, torch.Tensor]] = {m: {} for m in signature.copies}
        self.copy_bytes = len(signature.copies) * V * H * torch.empty(0, dtype=dtype).element_size()
        self.dtype, self.device = dtype, device
        self.free = list(range(self.cap - 1, -1, -1))  # lowest index first keeps the high-water mark tight
        self.used: set[int] = set()

    def high_water(self) -> int:
        return max(self.used) + 1 if self.used else 0

    def nbytes_per_slot(self) -> int:
        """A slot's bytes: its LoRA tensors, and its full copies (modules_to_save) when the pool holds any."""
        groups = [*self.groups.values(), *self.vocab_groups.values(), *self.expert_groups.values()]
        return sum(g.nbytes_per_slot() for g in groups) + self.copy_bytes

    def install(self, lw: LoraWeights) -> int:
        if not self.free:
            new_cap = min(self.max_slots, self.cap * 2)
            for g in [*self.groups.values(), *self.vocab_groups.values(), *self.expert_groups.values()]:
                g.grow(new_cap)
            self.free = list(range(new_cap - 1, self.cap - 1, -1))
            self.cap = new_cap
        self.free.sort(reverse=True)
        if lw.is_dora != self.signature.dora or (lw.is_dora and lw.dora_scale is None):
            raise ValueError(
                f"adapter {lw.name!r} does not fit this pool (DoRA factors missing or unexpected)"
            )
        if lw.base_layers:
            raise ValueError(
                f"adapter {lw.name!r} still holds saved base weights: prepare it (app/replica/lora/vocab.py) first"
            )
        slot = self.free.pop()
        for (layer, _), gw in self.groups.items():
            for p in gw.parts:
                a, b = lw.tensors[(layer, p.module)]
                gw.A[slot, :, p.r0 : p.r1].copy_(a.t())
                if p.base_scale is None:  # scaled straight into the slot: one pass, no temporary
                    torch.mul(b.t(), lw.scale, out=p.B[slot])
                else:  # DoRA: f * s * B (f per output row of B), and f for the base output's rescale
                    f = lw.dora_scale[(layer, p.module)]
                    p.B[slot].copy_((b * (lw.scale * f)[:, None]).t())
                    p.base_scale[slot].copy_(f)
        for m, gw in self.vocab_groups.items():
            (p,), (a, b) = gw.parts, lw.vocab_tensors[m]
            gw.A[slot].copy_(a.t())
            torch.mul(b.t(), lw.scale, out=p.B[slot])
        for key, xw in self.expert_groups.items():
            xw.install(slot, *lw.expert_tensors[key])
        for m, held in self.copies.items():
            held[slot] = lw.vocab_copies[m].to(device=self.device, dtype=self.dtype, copy=True)
        self.used.add(slot)
        return slot

    def remove(self, slot: int) -> None:
        for held in self.copies.values():
            held.pop(slot, None)
        self.used.discard(slot)
        self.free.append(slot)


def signature(lw: LoraWeights) -> Signature:
    return Signature(
        tuple(sorted((layer, m, a.shape[0]) for (layer, m), (a, _) in lw.tensors.items())),
        lw.is_dora,
        tuple(sorted((m, a.shape[0]) for m, (a, _) in lw.vocab_tensors.items())),
        tuple(sorted(lw.vocab_copies)),
        tuple(sorted((layer, g, a.shape[2]) for (layer, g), (a, _) in lw.expert_tensors.items())),
    )


class PoolPlan(NamedTuple):
    """One pool's share of a step: its contiguous token range start:end and their segments."""

    pool: Pool
    start: int
    end: int
    segments: K.Segments


class LoraBatch:
    """Per-step LoRA plan (the model's LoraHook): for each pool present, its token range and segments."""

    def __init__(self, plans: list[PoolPlan]):
        self.plans = plans
        self._expert_pairs: dict = {}  # (layer, pool index) -> that layer's pairs sorted by virtual slot

    def apply_experts(
        self,
        layer: int,
        which: str,
        x_pairs: torch.Tensor,
        pair_expert: torch.Tensor,
        pair_token: torch.Tensor,
        out_pairs: torch.Tensor,
    ) -> None:
        """LoRA on a mixture-of-experts layer's experts (app/replica/lora/experts.py's apply_experts)."""
        apply_experts(
            self.plans, self._expert_pairs, layer, which, x_pairs, pair_expert, pair_token, out_pairs
        )

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[:, fused columns] += the LoRA deltas of `group` in `layer`: one shrink per pool, then one expand
        per module of the group (kernels' expand_sliced), whatever the number of adapters.

        Contract (DoRA): `out` must hold the base linear's output, bias included, for every row when this is
        called (base GEMM first, then apply): a DoRA pool rescales its rows' base output per column."""
        for pool, s, e, seg in self.plans:
            gw = pool.groups.get((layer, group))
            if gw is None:
                continue
            hw = seg.num_slots
            z = K.shrink(x[s:e], gw.A[:hw], seg)
            ys, Bs = [out[s:e, p.c0 : p.c1] for p in gw.parts], [p.B[:hw] for p in gw.parts]
            if pool.signature.dora:
                fs, bs = [p.base_scale[:hw] for p in gw.parts], [p.base_bias for p in gw.parts]
                K.expand_sliced(ys, z, Bs, seg, base_scales=fs, base_biases=bs)
            else:
                K.expand_sliced(ys, z, Bs, seg)

    def embed(self, ids: torch.Tensor, h: torch.Tensor) -> None:
        """h [T, hidden], the base embedding of ids [T]: rows of adapters with a copy of embed_tokens become that
        copy's rows, then LoRA on embed_tokens adds scale * B @ A[:, id] per token (one gather and one expand per
        pool, whatever the number of adapters)."""
        for pool, s, e, seg in self.plans:
            held = pool.copies.get("embed_tokens")
            if held:
                for slot, w in held.items():
                    rows = (seg.token_slot == slot).nonzero().squeeze(1) + s
                    if rows.numel():
                        h[rows] = F.embedding(ids[rows], w)
            gw = pool.vocab_groups.get("embed_tokens")
            if gw is not None:
                hw = seg.num_slots
                z = K.shrink_embedding(ids[s:e], gw.A[:hw], seg)
                K.expand(h[s:e], z, gw.parts[0].B[:hw], seg)

    def head(self, rows: torch.Tensor, x: torch.Tensor, logits: torch.Tensor) -> None:
        """logits [n, vocab] = lm_head(x) for x [n, hidden], row i being flat token rows[i] of the step (the
        model's logits_idx: sampled positions first, then prompt positions, so not sorted by adapter). Rows of
        adapters with a copy of lm_head are recomputed with it; LoRA on lm_head adds its delta to its rows."""
        for pool, s, e, seg in self.plans:
            gw, held = pool.vocab_groups.get("lm_head"), pool.copies.get("lm_head")
            if gw is None and not held:
                continue
            sel = ((rows >= s) & (rows < e)).nonzero().squeeze(1)
            if not sel.numel():
                continue
            slots, order = seg.token_slot[rows[sel] - s].sort(stable=True)  # the kernels want slots ascending
            sel = sel[order]
            for slot, w in (held or {}).items():
                mine = sel[slots == slot]
                if mine.numel():
                    logits[mine] = F.linear(x[mine], w)
            if gw is not None:
                hw = seg.num_slots
                sub = K.build_segments(slots, hw)
                xs = x.index_select(0, sel)
                d = torch.zeros(sel.numel(), logits.shape[1], dtype=logits.dtype, device=logits.device)
                K.expand(d, K.shrink(xs, gw.A[:hw], sub), gw.parts[0].B[:hw], sub)
                logits.index_add_(0, sel, d)
