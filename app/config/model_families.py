"""What each served family's config.json means, read into ModelConfig's family-neutral fields.

One reader per family; the forward that uses the fields is in app/replica/models/ (one file per family there).
A config we cannot serve exactly (an unknown architecture, a RoPE type or layer type we do not implement) is
refused here, by name, with the list of what is served: never a silently different model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# architecture (config.json "architectures") -> family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
_HINTS = {
    "Gemma3ForConditionalGeneration": "serve its text model: a Gemma3ForCausalLM checkpoint (270M/1B, or the "
    "language model of 4B+ saved on its own)",
    "Gemma2ForCausalLM": "Gemma 2 is not served (its attention soft-capping is not implemented)",
    "Qwen2MoeForCausalLM": "Qwen2-MoE's shared expert is not implemented (Qwen3-MoE, Mixtral and OLMoE are served)",
}
SUPPORTED_ROPE = ("default", "linear", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


def read_config(cls: type, cfg: dict[str, Any]) -> Any:
    """A ModelConfig (`cls`) for a Hugging Face config dict, or ValueError naming what is unsupported."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        hint = next((f" ({_HINTS[a]})" for a in archs if a in _HINTS), "")
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}{hint}: LoRA-Land serves "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    fields = _common(cfg, family) | _READERS[family](cfg)
    return cls(architecture=arch, family=family, raw=cfg, **fields)


def _common(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    theta, scaling = _rope(cfg, cfg.get("rope_parameters"), cfg.get("rope_scaling"))
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias") if cfg.get("attention_bias") is not None else False),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        hidden_act=_act(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu", family),
    )


def _act(name: str, family: str) -> str:
    if name in ("silu", "gelu_pytorch_tanh"):
        return name
    raise ValueError(
        f"{family}: activation {name!r} is not supported: served are 'silu' and 'gelu_pytorch_tanh'"
    )


def _rope(cfg: dict[str, Any], params: Any, legacy: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5's rope_parameters or the older rope_theta + rope_scaling."""
    params = dict(params) if isinstance(params, dict) else {}
    scaling = dict(legacy) if isinstance(legacy, dict) else None
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    theta = float(theta if theta is not None else 10000.0)
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    kind = "longrope" if kind in ("su", "longrope") else kind
    if kind not in SUPPORTED_ROPE:
        raise ValueError(f"unsupported rope_scaling type {kind!r}: supported are {list(SUPPORTED_ROPE)}")
    if kind == "default":
        return theta, None
    scaling = {**scaling, "rope_type": kind}
    if kind == "longrope":
        orig = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if orig is None or "short_factor" not in scaling or "long_factor" not in scaling:
            raise ValueError("longrope needs short_factor, long_factor and original_max_position_embeddings")
        factor = scaling.get("factor") or cfg.get("max_position_embeddings", orig) / orig
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        scaling |= {"original_max_position_embeddings": orig, "factor": factor, "attention_factor": attn}
    return theta, scaling


def _windows(cfg: dict[str, Any], default_sliding: Callable[[int], bool]) -> tuple[int | None, ...]:
    """Each layer's sliding window: `layer_types` where the config lists them, else the family's rule."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer types {bad} are not supported: served are {list(LAYER_TYPES)}")
        if len(types) != n:
            raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n}")
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = [default_sliding(i) for i in range(n)]
    return tuple(window if s and window else None for s in sliding)


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"layer_windows": _windows({**cfg, "layer_types": None}, lambda i: False)}


def _mistral_like(cfg: dict[str, Any]) -> dict[str, Any]:
    # Mistral and Phi-3 slide every layer when the config sets a window
    return {
        "layer_windows": _windows({**cfg, "layer_types": None}, lambda i: cfg.get("use_sliding_window", True))
    }


def _qwen(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    slide, first = bool(cfg.get("use_sliding_window", False)), cfg.get("max_window_layers", 0)
    out: dict[str, Any] = {"layer_windows": _windows(cfg, lambda i: slide and i >= first)}
    if family == "qwen2" and cfg.get("attention_bias") is None:
        out["attention_bias"] = True  # Qwen2's q/k/v always have biases
    if family in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
    return out


def _moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Experts, top-k and which layers are sparse: Qwen2/3-MoE's rule (every decoder_sparse_step-th layer, except
    mlp_only_layers, which keep a dense MLP of intermediate_size)."""
    n, experts = cfg["num_hidden_layers"], cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts (shared_expert_intermediate_size) are not supported")
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", 0),
        "moe_intermediate_size": cfg.get("moe_intermediate_size", 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_layers": tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)),
    }


def _all_sparse(cfg: dict[str, Any], experts_key: str, norm_topk_prob: bool) -> dict[str, Any]:
    """Mixtral and OLMoE: every layer's MLP is the experts, each intermediate_size wide."""
    experts = cfg.get(experts_key) or 0
    if experts < 1:
        raise ValueError(f"{experts_key}={experts!r}: a mixture-of-experts model needs at least one expert")
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", 0),
        "moe_intermediate_size": cfg["intermediate_size"],
        "norm_topk_prob": norm_topk_prob,
        "moe_layers": (True,) * cfg["num_hidden_layers"],
    }


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers' MixtralAttention passes config.sliding_window to every layer (no use_sliding_window flag);
    # its router always renormalises the top-k (app/replica/models/moe.py MIXTRAL)
    windows = _windows({**cfg, "layer_types": None}, lambda i: True)
    return {"layer_windows": windows} | _all_sparse(cfg, "num_local_experts", True)


def _olmoe(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"olmoe: clip_qkv={cfg['clip_qkv']!r} is not supported (served: clip_qkv null)")
    heads = cfg["num_attention_heads"]
    if (cfg.get("head_dim") or cfg["hidden_size"] // heads) * heads != cfg["hidden_size"]:
        raise ValueError(
            "olmoe: head_dim * num_attention_heads must equal hidden_size (q_norm is hidden_size wide)"
        )
    return {
        "layer_windows": _windows({**cfg, "layer_types": None}, lambda i: False),
        "qk_norm": True,  # over the whole q and k projections (app/replica/models/olmoe.py)
    } | _all_sparse(cfg, "num_experts", bool(cfg.get("norm_topk_prob", False)))


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 keeps one rope_parameters entry per layer type; older configs rope_theta (global),
    # rope_local_base_freq (sliding) and rope_scaling (global only)
    per_type = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    full, local = per_type.get("full_attention"), per_type.get("sliding_attention")
    theta, scaling = _rope(cfg, full if full is not None else {"rope_theta": cfg.get("rope_theta", 1e6)},
                           cfg.get("rope_scaling"))  # fmt: skip
    local_theta, local_scaling = _rope(
        cfg, local or {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}, None
    )
    if local_scaling is not None:
        raise ValueError("gemma3: RoPE scaling on sliding layers is not supported (only on global layers)")
    pattern = cfg.get("sliding_window_pattern", 6)
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "local_rope_theta": local_theta,
        "layer_windows": _windows(cfg, lambda i: bool((i + 1) % pattern)),
        "qk_norm": True,
        "norm_style": "gemma",
        "sandwich_norms": True,
        "embed_scale": cfg["hidden_size"] ** 0.5,
        "attn_scale": cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping (it is stored, not passed on):
        # neither do we, so the outputs agree
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    return _mistral_like(cfg) | {
        "partial_rotary_factor": float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    }


_READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral_like,
    "qwen2": lambda cfg: _qwen(cfg, "qwen2"),
    "qwen3": lambda cfg: _qwen(cfg, "qwen3"),
    "qwen3_moe": lambda cfg: _qwen(cfg, "qwen3_moe") | _moe(cfg),
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "gemma3": _gemma3,
    "phi3": _phi3,
}
