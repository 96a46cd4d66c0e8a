"""OLMoE (OlmoeForCausalLM): Llama's attention with an RMSNorm over the whole q projection ([heads * head_dim])
and one over the whole k projection ([kv_heads * head_dim]) before RoPE (not per head, as Qwen3's), and a
mixture-of-experts MLP on every layer with Qwen3-MoE's routing (softmax in fp32, top-k, renormalised only with
norm_topk_prob, false by default; weights cast to the model dtype). The experts' width is intermediate_size;
checkpoints hold them per expert (`mlp.experts.{e}.gate_proj.weight`, ...) or fused as transformers 5 does.
clip_qkv is refused by the config reader (app/config/model_families.py)."""

from __future__ import annotations

import torch

from app.config.model_config import ModelConfig
from app.replica.models.layer import Layer, MakeLinear, norm, split_projections
from app.replica.models.norms import RMSNorm
from app.replica.models.qwen3_moe import load_moe
from app.replica.models.weights import WeightReader


class WideNorm(RMSNorm):
    """An RMSNorm over a whole projection, called as the forward calls a per-head q/k norm: on [T * heads,
    head_dim] rows (app/replica/models/decoder.py). It normalises each token's heads together, [T, heads *
    head_dim], as transformers' OlmoeAttention does on q_proj's output."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x.reshape(-1, self.weight.shape[0])).view(x.shape)


def load_layer(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear) -> Layer:
    if not c.qk_norm:
        raise ValueError("olmoe: the config must ask for q/k norms (ModelConfig.qk_norm)")
    p = f"model.layers.{i}."
    parts = split_projections(w, i, c, linear, mlp=False)
    for name, width in (("q_norm", c.num_heads * c.head_dim), ("k_norm", c.num_kv_heads * c.head_dim)):
        if tuple(parts[name].weight.shape) != (width,):
            raise ValueError(
                f"{p}self_attn.{name}.weight has shape {tuple(parts[name].weight.shape)}: OLMoE's norm spans the "
                f"whole projection, ({width},)"
            )
        parts[name] = WideNorm(parts[name].weight, c.rms_norm_eps)
    return Layer(
        attn_norm=norm(w, p + "input_layernorm.weight", c),
        mlp_norm=norm(w, p + "post_attention_layernorm.weight", c),
        moe=load_moe(w, p + "mlp.", c, linear),
        gate_up=None,
        down=None,
        **parts,
    )
