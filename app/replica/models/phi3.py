"""Phi-3 / Phi-4-mini: the checkpoint already fuses q/k/v (qkv_proj) and gate/up (gate_up_proj) in the order
the forward wants; partial rotary (Phi-4-mini rotates 3/4 of each head) and LongRoPE are config. PEFT adapters
on the fused modules are split per projection when read (app/replica/lora/peft_format.py)."""

from __future__ import annotations

from app.config.model_config import ModelConfig
from app.replica.models.layer import Layer, MakeLinear, norm
from app.replica.models.weights import WeightReader


def load_layer(w: WeightReader, i: int, c: ModelConfig, linear: MakeLinear) -> Layer:
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    return Layer(
        attn_norm=norm(w, p + "input_layernorm.weight", c),
        mlp_norm=norm(w, p + "post_attention_layernorm.weight", c),
        qkv=linear(w.get(a + "qkv_proj.weight"), w.get(a + "qkv_proj.bias", required=False)),
        o=linear(w.get(a + "o_proj.weight"), w.get(a + "o_proj.bias", required=False)),
        gate_up=linear(w.get(m + "gate_up_proj.weight"), None),
        down=linear(w.get(m + "down_proj.weight"), None),
    )
