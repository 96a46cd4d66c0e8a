"""The base model's architecture, read from a Hugging Face config.json, in family-neutral fields.

Which architectures are served and what each family's config means is in app/config/model_families.py; the
forward of each family is in app/replica/models/. Everything here is plain Python (no torch): the CLI and the
adapter checks read it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES  # what the device pools hold, per projection
# Checkpoints that fuse projections (Phi-3): a PEFT LoRA on a fused module is served as one LoRA per part with
# the same A and B's rows of that part (exactly PEFT's delta: x A^T B^T split by output rows).
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TARGET_MODULES = LORA_MODULES + tuple(FUSED_MODULES)  # every decoder linear name a PEFT adapter may target
# A mixture-of-experts layer's router (`mlp.gate`, weight [experts, hidden]): PEFT adapts it through
# target_parameters (`gate.weight`), and saves its LoRA as a linear's (mlp.gate.lora_A/B.weight)
ROUTER_MODULE = "gate"
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: plain RoPE; else rope_type linear | llama3 | longrope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v/o biases (Qwen2: q/k/v only, see qkv_bias / o_bias)
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # Per decoder layer: its sliding window (None = global attention) and whether it uses the local RoPE base.
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of sliding layers when it differs (Gemma 3)
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated (Phi-4-mini: 0.75)
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE (Qwen3, Gemma 3)
    norm_style: str = "llama"  # "gemma": weight applied as (1 + w), computed in fp32, then cast
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    final_logit_softcap: float | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral, OLMoE): 0 experts = every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's MLP width (intermediate_size is the dense layers')
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[
        bool, ...
    ] = ()  # per decoder layer: True where the MLP is the experts, False where dense
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise ValueError(f"{len(self.moe_layers)} MoE layer flags for {self.num_layers} layers")
        if any(self.moe_layers) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and num_experts "
                f"({self.num_experts})"
            )

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def sliding_window(self) -> int | None:
        """The widest window when every layer slides; None when any layer attends globally."""
        ws = self.windows()
        return None if any(w is None for w in ws) else max(ws, default=None)

    def windows(self) -> tuple[int | None, ...]:
        return self.layer_windows or (None,) * self.num_layers

    @staticmethod
    def block_of(module: str) -> str:
        """The submodule a decoder linear sits in: self_attn or mlp."""
        return "self_attn" if module in ATTN_MODULES or module == "qkv_proj" else "mlp"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.family != "qwen2"

    def lora_modules(self, layer: int) -> tuple[str, ...]:
        """The linears of decoder layer `layer` a PEFT adapter names (Phi-3: the fused ones). A sparse MoE layer's
        MLP has none: its experts and router take LoRA through target_parameters (app/replica/lora/experts.py);
        an MoE model's dense layers (mlp_only_layers) keep gate/up/down_proj, which PEFT >= 0.22 adapts beside
        the experts when target_modules names them."""
        if self.is_moe and self.moe_layers[layer]:
            return ATTN_MODULES
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if self.family == "phi3" else LORA_MODULES

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable linear in one decoder layer (per projection,
        and the fused modules of a checkpoint that has them)."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if self.family == "phi3":
            shapes |= {"qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}
        if self.is_moe:
            shapes[ROUTER_MODULE] = (h, self.num_experts)
        return shapes

    def identity(self) -> dict[str, Any]:
        """What an adapter must agree with: recorded in the catalog, checked before loading."""
        return {
            "architecture": self.architecture,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
        }

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        from app.config.model_families import read_config  # the families' readers build this class

        return read_config(cls, cfg)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no config.json: give a Hugging Face model folder or Hub id")
        return cls.from_dict(json.loads(path.read_text()))
