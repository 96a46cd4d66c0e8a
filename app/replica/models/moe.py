"""A mixture-of-experts MLP (Qwen3-MoE's sparse block) run grouped: one GEMM pair per expert over its tokens.

Semantics (transformers' Qwen3MoeSparseMoeBlock, in its order of operations so fp32 tokens agree):
  x [T, H] -> router logits x W_r^T [T, E] -> softmax in fp32 -> top-k (values, experts) [T, k]
  -> (norm_topk_prob) values / their sum -> cast to x's dtype = weights w [T, k]
  out[t] = sum_j w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),  e = experts[t, j]
summed into zeros in ascending expert order (HF's eager loop over experts; index_add_ per expert there, one
index_add_ over the expert-sorted rows here).

The (token, expert) pairs are sorted by expert once (a stable argsort), the tokens gathered into that order with
one index_select, each expert's contiguous rows go through its gate_up and down projections, the weighted rows
are scattered back with one index_add_. The Python loop runs over experts (tens to hundreds), never tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from app.replica.models.norms import act_mul_

if TYPE_CHECKING:
    from app.replica.models.batch import LoraHook

# Called with each layer's top-k expert ids [T, k] when set (tests: which experts a batch reaches).
RouteHook = Callable[[torch.Tensor], None]


class MoE:
    """gate_up [E, 2*I, H] (gate rows first), down [E, H, I], router [E, H]."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        norm_topk_prob: bool,
        act: str,
    ):
        E, two_i, H = gate_up.shape
        if router.shape != (E, H) or down.shape != (E, H, two_i // 2):
            raise ValueError(
                f"MoE weights disagree: router {tuple(router.shape)}, gate_up {tuple(gate_up.shape)}, "
                f"down {tuple(down.shape)} (want [E, H], [E, 2I, H], [E, H, I])"
            )
        self.router, self.gate_up, self.down = router, gate_up.contiguous(), down.contiguous()
        self.num_experts, self.top_k, self.norm_topk_prob, self.act = E, top_k, norm_topk_prob, act
        self.on_route: RouteHook | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.router, self.gate_up, self.down]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as transformers' Qwen3MoeTopKRouter picks them."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), experts

    def __call__(self, x: torch.Tensor, lora: LoraHook | None = None, layer: int = 0) -> torch.Tensor:
        """x [T, H] -> [T, H], a fresh tensor (the caller adds it to the residual). With `lora`, each pair's
        adapter's expert deltas are added to the gate_up output (before the activation) and to the down output
        (before the routing weight) of every expert at once, between per-expert GEMMs."""
        weights, experts = self.route(x)
        if self.on_route is not None:
            self.on_route(experts)
        T = x.shape[0]
        # pairs by expert; within one by top-k rank, then token: transformers' row order, so each GEMM sees
        # the rows where HF's does (a GEMM's rounding may depend on a row's place in its blocking)
        flat = experts.t().flatten()
        order = torch.argsort(flat, stable=True)
        rows = order % T  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        xs = x.index_select(0, rows)
        ws = weights.t().flatten().index_select(0, order).unsqueeze(1)
        ys = torch.empty_like(xs)
        spans = [(e, s, s + n) for e, s, n in zip(range(len(counts)), _starts(counts), counts) if n]
        if lora is None:
            for e, s, t in spans:
                m = act_mul_(F.linear(xs[s:t], self.gate_up[e]), self.act)
                torch.mul(F.linear(m, self.down[e]), ws[s:t], out=ys[s:t])
            return torch.zeros_like(x).index_add_(0, rows, ys)
        # the same GEMMs, in two passes so the LoRA deltas see every expert's rows together
        pair_expert = flat.index_select(0, order)
        gu = xs.new_empty(xs.shape[0], self.gate_up.shape[1])
        for e, s, t in spans:
            gu[s:t] = F.linear(xs[s:t], self.gate_up[e])
        lora.apply_experts(layer, "gate_up", xs, pair_expert, rows, gu)
        ms = xs.new_empty(xs.shape[0], self.down.shape[2])
        for e, s, t in spans:
            ms[s:t] = act_mul_(gu[s:t], self.act)
            ys[s:t] = F.linear(ms[s:t], self.down[e])
        lora.apply_experts(layer, "down", ms, pair_expert, rows, ys)
        return torch.zeros_like(x).index_add_(0, rows, ys.mul_(ws))


def _starts(counts: list[int]) -> list[int]:
    out, s = [], 0
    for n in counts:
        out.append(s)
        s += n
    return out
