"""Mixtral (MixtralForCausalLM): Mistral's attention (a sliding window on every layer when the config sets one)
and a mixture-of-experts MLP on every layer (app/replica/models/moe.py) with Mixtral's routing: softmax in fp32,
top-k, always renormalised, the weights kept in fp32 (moe.MIXTRAL).

Experts are read as the Hub's checkpoints store them (`block_sparse_moe.gate.weight`, and per expert
`block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down); transformers 5 saves them so too) or as
transformers 5 holds them in memory (`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2I, H] with the w1 rows
first, `mlp.experts.down_proj` [E, H, I]). The experts' width is the config's intermediate_size."""

from __future__ import annotations

from app.config.model_config import ModelConfig
from app.replica.models.layer import Layer, MakeLinear, norm, split_projections
from app.replica.models.moe import MIXTRAL
from app.replica.models.qwen3_moe import load_moe
from app.replica.models.weights import WeightReader


def load_layer(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear) -> Layer:
    p = f"model.layers.{i}."
    block = p + ("block_sparse_moe." if w.has(p + "block_sparse_moe.gate.weight") else "mlp.")
    return Layer(
        attn_norm=norm(w, p + "input_layernorm.weight", c),
        mlp_norm=norm(w, p + "post_attention_layernorm.weight", c),
        moe=load_moe(w, block, c, linear, MIXTRAL, names=("w1", "w3", "w2")),
        gate_up=None,
        down=None,
        **split_projections(w, i, c, linear, mlp=False),
    )
