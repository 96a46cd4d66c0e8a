"""Llama, Mistral and Qwen2: pre-norm decoder layers, separate q/k/v and gate/up weights (Qwen2: q/k/v biases),
SiLU MLP. Their differences (biases, sliding windows, RoPE scaling) are config fields the shared forward reads."""

from __future__ import annotations

from app.config.model_config import ModelConfig
from app.replica.models.layer import Layer, MakeLinear, norm, split_projections
from app.replica.models.weights import WeightReader


def load_layer(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear) -> Layer:
    p = f"model.layers.{i}."
    return Layer(
        attn_norm=norm(w, p + "input_layernorm.weight", c),
        mlp_norm=norm(w, p + "post_attention_layernorm.weight", c),
        **split_projections(w, i, c, linear),
    )
