"""One decoder layer's weights in the family-neutral form the forward runs (app/replica/models/decoder.py),
and the loader every family with separate q/k/v and gate/up weights shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.config.model_config import ModelConfig
from app.replica.linear import PackedLinear
from app.replica.models.moe import MoE
from app.replica.models.norms import RMSNorm
from app.replica.models.weights import WeightReader

# (weight, bias) -> the layer's linear (prepacked for the CPU GEMM kernels, or plain)
MakeLinear = Callable[[torch.Tensor, torch.Tensor | None], PackedLinear]


@dataclass
class Layer:
    attn_norm: RMSNorm
    qkv: PackedLinear  # q, k, v projections fused by rows: [H*d + 2*Hkv*d, hidden]
    o: PackedLinear
    mlp_norm: RMSNorm
    gate_up: PackedLinear | None  # gate and up fused by rows: [2*I, hidden]; None on an MoE layer
    down: PackedLinear | None
    q_norm: RMSNorm | None = None  # per head, before RoPE (Qwen3, Gemma 3)
    k_norm: RMSNorm | None = None
    attn_out_norm: RMSNorm | None = None  # on the attention output before the residual add (Gemma 3)
    mlp_out_norm: RMSNorm | None = None  # on the MLP output before the residual add (Gemma 3)
    moe: MoE | None = None  # a mixture-of-experts MLP (router + experts) instead of gate_up/down

    def linears(self) -> list[PackedLinear]:
        return [lin for lin in (self.qkv, self.o, self.gate_up, self.down) if lin is not None]

    def moe_tensors(self) -> list[torch.Tensor]:
        return [] if self.moe is None else self.moe.tensors()

    def norm_weights(self) -> list[torch.Tensor]:
        norms = (
            self.attn_norm,
            self.mlp_norm,
            self.q_norm,
            self.k_norm,
            self.attn_out_norm,
            self.mlp_out_norm,
        )
        return [n.weight for n in norms if n is not None]


def norm(w: WeightReader, name: str, c: ModelConfig) -> RMSNorm:
    return RMSNorm(w.get(name), c.rms_norm_eps, c.norm_style)


def split_projections(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear, mlp: bool = True) -> dict:
    """qkv, o, gate_up, down and the q/k norms of layer i from HF's separate q/k/v/o, gate/up/down weights
    (without gate_up/down when `mlp` is False: an MoE layer reads its experts itself)."""
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    qkv_b = torch.cat([w.get(a + f"{p}_proj.bias") for p in "qkv"]) if c.qkv_bias else None
    out = {
        "qkv": linear(torch.cat([w.get(a + f"{p}_proj.weight") for p in "qkv"]), qkv_b),
        "o": linear(w.get(a + "o_proj.weight"), w.get(a + "o_proj.bias") if c.o_bias else None),
    }
    if mlp:
        out |= {
            "gate_up": linear(torch.cat([w.get(m + "gate_proj.weight"), w.get(m + "up_proj.weight")]), None),
            "down": linear(w.get(m + "down_proj.weight"), None),
        }
    if c.qk_norm:
        out |= {"q_norm": norm(w, a + "q_norm.weight", c), "k_norm": norm(w, a + "k_norm.weight", c)}
    return out
