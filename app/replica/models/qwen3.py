"""Qwen3 (dense): Llama's layer plus an RMSNorm over each q and k head before RoPE (q_norm, k_norm [head_dim]),
an explicit head_dim (often not hidden / heads), no q/k/v biases by default, tied or untied embeddings."""

from __future__ import annotations

from app.config.model_config import ModelConfig
from app.replica.models import llama
from app.replica.models.layer import Layer, MakeLinear
from app.replica.models.weights import WeightReader


def load_layer(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear) -> Layer:
    if not c.qk_norm:
        raise ValueError("qwen3: the config must ask for q/k norms (ModelConfig.qk_norm)")
    return llama.load_layer(w, i, c, linear)  # split_projections reads q_norm/k_norm when qk_norm is set
