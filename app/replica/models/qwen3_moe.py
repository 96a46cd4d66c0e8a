"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms per head, explicit head_dim) and, on the sparse
layers, a mixture-of-experts MLP (app/replica/models/moe.py): router `mlp.gate` [E, H], experts with gate/up/down
projections of moe_intermediate_size. Layers in mlp_only_layers (or off decoder_sparse_step) keep a dense MLP.

Experts are read as the Hub's checkpoints store them (`mlp.experts.{e}.gate_proj.weight`, one per expert) or as
transformers 5 holds them in memory (`mlp.experts.gate_up_proj` [E, 2I, H] with gate rows first,
`mlp.experts.down_proj` [E, H, I]); each expert's two projections are prepacked by the model's GEMM factory
(`linear`, as the dense layers' are)."""

from __future__ import annotations

import torch

from app.config.model_config import ModelConfig
from app.replica.models.layer import Layer, MakeLinear, norm, split_projections
from app.replica.models.moe import MoE, Routing
from app.replica.models.weights import WeightReader


def load_layer(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear) -> Layer:
    if not c.qk_norm:
        raise ValueError("qwen3_moe: the config must ask for q/k norms (ModelConfig.qk_norm)")
    p = f"model.layers.{i}."
    sparse = c.moe_layers[i]
    return Layer(
        attn_norm=norm(w, p + "input_layernorm.weight", c),
        mlp_norm=norm(w, p + "post_attention_layernorm.weight", c),
        moe=load_moe(w, p + "mlp.", c, linear) if sparse else None,
        **({"gate_up": None, "down": None} if sparse else {}),
        **split_projections(w, i, c, linear, mlp=not sparse),
    )


# each expert's (gate, up, down) weight names in Hub checkpoints: Qwen3-MoE's and OLMoE's
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def load_moe(
    w: WeightReader,
    prefix: str,
    c: ModelConfig,
    linear: MakeLinear | None = None,
    routing: Routing | None = None,
    names: tuple[str, str, str] = EXPERT_NAMES,
) -> MoE:
    """The sparse block under `prefix` (router `gate.weight`, experts fused or per expert as `names`);
    `routing`: the family's (default: the config's norm_topk_prob, weights cast to the model dtype)."""
    x = prefix + "experts."
    if w.has(x + "gate_up_proj"):
        gate_up, down = w.get(x + "gate_up_proj"), w.get(x + "down_proj")
    else:
        E, (g, u, d) = c.num_experts, names
        gate_up = torch.stack(
            [torch.cat([w.get(f"{x}{e}.{g}.weight"), w.get(f"{x}{e}.{u}.weight")]) for e in range(E)]
        )
        down = torch.stack([w.get(f"{x}{e}.{d}.weight") for e in range(E)])
    want = (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size)
    if tuple(gate_up.shape) != want:
        raise ValueError(
            f"{x}gate_up has shape {tuple(gate_up.shape)}, config says {want} (num_experts, "
            "2 * the experts' intermediate size, hidden_size)"
        )
    return MoE(
        w.get(prefix + "gate.weight"),
        gate_up,
        down,
        c.num_experts_per_tok,
        routing or Routing(c.norm_topk_prob),
        c.hidden_act,
        linear,
    )
