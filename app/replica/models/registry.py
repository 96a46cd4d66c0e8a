"""family (app/config/model_families.py) -> the function that reads one decoder layer's weights. Adding a family:
its config reader there, its layer loader in a file here, one line below, and a test against transformers."""

from __future__ import annotations

from collections.abc import Callable

from app.config.model_config import ModelConfig
from app.replica.models import gemma3, llama, mixtral, olmoe, phi3, qwen3, qwen3_moe
from app.replica.models.layer import Layer, MakeLinear
from app.replica.models.weights import WeightReader

LoadLayer = Callable[[WeightReader, int, ModelConfig, MakeLinear], Layer]

LAYER_LOADERS: dict[str, LoadLayer] = {
    "llama": llama.load_layer,
    "mistral": llama.load_layer,
    "qwen2": llama.load_layer,
    "qwen3": qwen3.load_layer,
    "qwen3_moe": qwen3_moe.load_layer,
    "mixtral": mixtral.load_layer,
    "olmoe": olmoe.load_layer,
    "gemma3": gemma3.load_layer,
    "phi3": phi3.load_layer,
}


def layer_loader(c: ModelConfig) -> LoadLayer:
    if c.family not in LAYER_LOADERS:
        raise ValueError(f"no forward for family {c.family!r}: served are {sorted(LAYER_LOADERS)}")
    return LAYER_LOADERS[c.family]
