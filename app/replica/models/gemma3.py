"""Gemma 3 (text, Gemma3ForCausalLM): sandwich norms (input, post-attention, pre- and post-feed-forward), all
applied as (1 + w) in fp32; per-head q/k norms; GeLU-tanh MLP; embeddings scaled by sqrt(hidden); softmax scale
query_pre_attn_scalar ** -0.5; sliding-window layers interleaved with global ones, each kind with its own RoPE
base; optional final logit soft-capping. All of it is config (app/config/model_families.py) but the weights'
names, read here."""

from __future__ import annotations

from app.config.model_config import ModelConfig
from app.replica.models.layer import Layer, MakeLinear, norm, split_projections
from app.replica.models.weights import WeightReader


def load_layer(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear) -> Layer:
    p = f"model.layers.{i}."
    return Layer(
        attn_norm=norm(w, p + "input_layernorm.weight", c),
        attn_out_norm=norm(w, p + "post_attention_layernorm.weight", c),
        mlp_norm=norm(w, p + "pre_feedforward_layernorm.weight", c),
        mlp_out_norm=norm(w, p + "post_feedforward_layernorm.weight", c),
        **split_projections(w, i, c, linear),
    )
