"""adapter_config.json: what PEFT's config says, checked before any tensor is read.

Everything that would make our forward differ from PEFT's (biases, fan_in_fan_out, modules_to_save of anything
but embed_tokens/lm_head, ...) is refused with an InvalidAdapter that names the field, rather than served subtly
wrong. LoRA on embed_tokens/lm_head and modules_to_save of them are served (weights.py, vocab.py).
Targets, rank_pattern and alpha_pattern are resolved by PEFT's own matching rules against the base model's
module names, so the (layer, module) pairs and ranks we expect are the ones PEFT would have created.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config.model_config import ATTN_MODULES, LORA_MODULES, MLP_MODULES, TARGET_MODULES, ModelConfig
from app.errors import InvalidAdapter
from app.replica.lora import safe_regex
from app.replica.lora.weights import VOCAB_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")

# Config fields that change PEFT's forward in ways a plain B@A delta does not reproduce: each must be falsy.
_REFUSED_FIELDS = {
    "fan_in_fan_out": "it is for Conv1D (GPT-2 style) layers, which Llama/Mistral/Qwen2 do not have",
    "lora_bias": "LoRA-Land's deltas carry no bias; retrain with lora_bias=False",
    "trainable_token_indices": "it trains selected embedding rows (TrainableTokens); not supported: use LoRA on "
    "embed_tokens or modules_to_save",
    "layer_replication": "it duplicates decoder layers, which changes the base model",
    "use_qalora": "QA-LoRA pools the input; not supported",
    "megatron_config": "Megatron-parallel LoRA layers are not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing between experts is not supported",
    "velora_config": "not a plain LoRA; not supported",
    "monteclora_config": "not a plain LoRA; not supported",
}
_TASK_TYPES = (None, "CAUSAL_LM", "FEATURE_EXTRACTION")


def refuse(folder: Path, msg: str) -> InvalidAdapter:
    return InvalidAdapter(f"adapter {folder}: {msg}")


def load_config(folder: Path) -> dict[str, Any]:
    """Read adapter_config.json and refuse, by field, everything no model is needed to rule out."""
    if not folder.is_dir():
        raise refuse(
            folder, "not a directory: give a folder holding adapter_config.json and adapter_model.safetensors"
        )
    if not (folder / WEIGHTS_FILE).is_file():
        pickled = [p for p in PICKLED_FILES if (folder / p).exists()]
        if pickled:
            raise refuse(
                folder,
                f"{pickled[0]} is a pickle and LoRA-Land never unpickles (it can run code): convert it to "
                f"{WEIGHTS_FILE} (PEFT save_pretrained(..., safe_serialization=True)) in a trusted environment",
            )
        raise refuse(folder, f"missing {WEIGHTS_FILE}: a PEFT adapter folder needs it next to {CONFIG_FILE}")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise refuse(folder, f"missing {CONFIG_FILE}: save the adapter with PEFT's save_pretrained")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise refuse(folder, f"{CONFIG_FILE} is not valid JSON ({e}): re-save it with PEFT") from None
    if not isinstance(cfg, dict):
        raise refuse(folder, f"{CONFIG_FILE} must hold a JSON object, not {type(cfg).__name__}")
    _check_types(folder, cfg)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(
            folder, f"peft_type is {cfg['peft_type']!r}: only LoRA adapters (peft_type LORA) are served"
        )
    if cfg.get("task_type") not in _TASK_TYPES:
        raise refuse(folder, f"task_type {cfg['task_type']!r} is not a causal LM adapter: use CAUSAL_LM")
    for key, why in _REFUSED_FIELDS.items():
        if cfg.get(key):
            raise refuse(folder, f"{key}={cfg[key]!r} is not supported: {why}")
    if cfg.get("bias", "none") != "none":
        raise refuse(
            folder,
            f"bias={cfg['bias']!r} is not supported: LoRA-Land's deltas carry no bias; use bias='none'",
        )
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise refuse(folder, f"{key}={v!r} must be a positive number")
    if int(cfg["r"]) != cfg["r"]:
        raise refuse(folder, f"r={cfg['r']!r} must be an integer")
    for key in ("rank_pattern", "alpha_pattern"):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in pat.values()
        ):
            raise refuse(folder, f"{key} must map module-name patterns to positive numbers, got {pat!r}")
        for key_pattern in pat:  # matched the way _pattern_value does
            _check_regex(folder, key, key_pattern, rf"(.*\.)?({key_pattern})$")
    for key in ("target_modules", "exclude_modules"):
        if isinstance(cfg.get(key), str):  # a string is a regex (PEFT); a list holds plain names
            _check_regex(folder, key, cfg[key], cfg[key])
    return cfg


def _is_names(v: object) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _is_layers(v: object) -> bool:
    def one(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    return one(v) or (isinstance(v, list) and all(one(x) for x in v))


# The JSON type of every field the readers use (PEFT's LoraConfig types); null is always allowed (PEFT's default).
_FIELD_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "target_modules": (_is_names, "a list of module names or a regex string"),
    "exclude_modules": (_is_names, "a list of module names or a regex string"),
    "modules_to_save": (_is_names, "a list of module names"),
    "layers_to_transform": (_is_layers, "a layer index or a list of layer indices"),
    "layers_pattern": (_is_names, "a string or a list of strings"),
    "rank_pattern": (lambda v: isinstance(v, dict), "an object mapping module patterns to ranks"),
    "alpha_pattern": (lambda v: isinstance(v, dict), "an object mapping module patterns to alphas"),
    "auto_mapping": (lambda v: isinstance(v, dict), "an object"),
    "base_model_name_or_path": (lambda v: isinstance(v, str), "a string"),
    "peft_type": (lambda v: isinstance(v, str), "a string"),
    "task_type": (lambda v: isinstance(v, str), "a string"),
    "bias": (lambda v: isinstance(v, str), "a string"),
    "use_dora": (lambda v: isinstance(v, bool), "true or false"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "alora_invocation_tokens": (
        lambda v: (
            isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        ),
        "a non-empty list of token ids",
    ),
}


def _check_types(folder: Path, cfg: dict[str, Any]) -> None:
    """Refuse a field of the wrong JSON type by name, before any reader trips over it (a 400, not a 500)."""
    for key, (ok, what) in _FIELD_TYPES.items():
        v = cfg.get(key)
        if v is not None and not ok(v):
            shown = repr(v) if len(repr(v)) <= 80 else repr(v)[:77] + "..."
            err = refuse(folder, f"{key}={shown} must be {what} ({CONFIG_FILE})")
            err.param = key
            raise err


def _check_regex(folder: Path, field: str, pattern: str, matched: str) -> None:
    """Refuse a pattern `re` could take too long to match (app/replica/lora/safe_regex.py), naming the field."""
    try:
        safe_regex.check(matched)
    except safe_regex.UnsafePattern as e:
        err = refuse(folder, f"{field}: the regular expression {pattern[:80]!r} is refused: {e}")
        err.param = field
        raise err from None


def linear_names(model: ModelConfig) -> dict[str, tuple[int, str]]:
    """The base model's LoRA-able linears: full module name -> (layer, module)."""
    return {
        f"model.layers.{i}.{model.block_of(m)}.{m}": (i, m)
        for i in range(model.num_layers)
        for m in model.lora_modules(i)
    }


def _other_names(model: ModelConfig) -> list[str]:
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for i in range(model.num_layers):
        p = f"model.layers.{i}"
        names += [p, f"{p}.self_attn", f"{p}.mlp", f"{p}.mlp.act_fn", f"{p}.input_layernorm"]
        names += [f"{p}.post_attention_layernorm"]
    return names


def _name_matches(pattern: str | list[str], name: str) -> bool:
    # PEFT's rules: a string is a regex fullmatched against the module name; a list entry matches by suffix.
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == t or name.endswith("." + t) for t in pattern)


def vocab_targets(folder: Path, cfg: dict[str, Any], model: ModelConfig) -> set[str]:
    """The VOCAB_MODULES ("embed_tokens", "lm_head") that PEFT would wrap in LoRA for this config."""
    return targets(folder, cfg, model, vocab_only=True)


def targets(folder: Path, cfg: dict[str, Any], model: ModelConfig, *, vocab_only: bool = False) -> set:
    """(layer, module) pairs of decoder linears that PEFT would wrap in LoRA for this config on this base model
    (possibly none when it targets embed_tokens/lm_head only); with vocab_only, those VOCAB_MODULES instead."""
    wanted_mods, exclude = cfg.get("target_modules"), cfg.get("exclude_modules")
    if (
        not isinstance(wanted_mods, (str, list))
        or not wanted_mods
        or not all(isinstance(t, str) for t in wanted_mods)
    ):
        raise refuse(
            folder, f"target_modules={wanted_mods!r} must be a non-empty list of module names or a regex"
        )
    linear, others = linear_names(model), _other_names(model)
    try:
        hit_linear = {n for n in linear if _name_matches(wanted_mods, n)}
        hit_other = [n for n in others if _name_matches(wanted_mods, n)]
        if exclude:
            hit_linear = {n for n in hit_linear if not _name_matches(exclude, n)}
            hit_other = [n for n in hit_other if not _name_matches(exclude, n)]
    except re.error as e:
        raise refuse(folder, f"target_modules/exclude_modules is not a valid regex ({e})") from None
    converted = _expert_conversion(cfg, model)
    _refuse_moe_mlp(folder, wanted_mods, exclude, model, converted)
    vocab = [n for n in hit_other if n.endswith(VOCAB_MODULES)]
    if vocab and cfg.get("use_dora"):
        raise refuse(
            folder,
            f"target_modules={wanted_mods!r} matches {vocab[0]} with use_dora=true: DoRA on embed_tokens/lm_head "
            f"is not supported; use DoRA on the decoder projections {LORA_MODULES} only",
        )
    if vocab and cfg.get("layers_to_transform") not in (None, []):
        raise refuse(
            folder,
            f"target_modules={wanted_mods!r} matches {vocab[0]} together with layers_to_transform: "
            "embed_tokens/lm_head have no layer index; not supported",
        )
    hit_other = [n for n in hit_other if n not in vocab]
    experts = _moe_expert_names(model) if converted else []  # what PEFT's conversion made target_parameters
    unknown = hit_other or (
        [t for t in wanted_mods if not any(_name_matches([t], n) for n in [*linear, *vocab, *experts])]
        if isinstance(wanted_mods, list)
        else []
    )
    if unknown or not (hit_linear or vocab or converted):
        raise refuse(
            folder,
            f"target_modules={wanted_mods!r}: unknown target module {unknown[:3] or wanted_mods!r}; "
            f"supported: {TARGET_MODULES + VOCAB_MODULES}",
        )
    if vocab_only:
        return {n.split(".")[-1] for n in vocab}
    if cfg.get("layers_pattern") not in (None, "", "layers", ["layers"], []):
        raise refuse(folder, f"layers_pattern={cfg['layers_pattern']!r}: Llama-family models use 'layers'")
    layers = cfg.get("layers_to_transform")
    if layers is not None and layers != []:
        if isinstance(wanted_mods, str):
            raise refuse(
                folder, "layers_to_transform cannot be combined with a regex target_modules (PEFT refuses it)"
            )
        layers = [layers] if isinstance(layers, int) else layers
        bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < model.num_layers]
        if bad:
            raise refuse(
                folder,
                f"layers_to_transform {bad} out of range: the base model has {model.num_layers} layers",
            )
        hit_linear = {n for n in hit_linear if linear[n][0] in layers}
    if not hit_linear and not vocab and not converted:
        raise refuse(
            folder, "target_modules, exclude_modules and layers_to_transform leave no module to adapt"
        )
    return {linear[n] for n in hit_linear}


def _moe_expert_names(model: ModelConfig) -> list[str]:
    """A sparse MoE layer's MLP module names as PEFT sees them: the router, the experts, and each expert's
    gate/up/down_proj (transformers 4 built those modules; transformers 5 fuses the experts into parameters)."""
    names = []
    for i, sparse in enumerate(model.moe_layers):
        if sparse:
            p = f"model.layers.{i}.mlp"
            names += [f"{p}.gate", f"{p}.experts"]
            names += [f"{p}.experts.{e}.{m}" for e in range(model.num_experts) for m in MLP_MODULES]
    return names


def _expert_conversion(cfg: dict[str, Any], model: ModelConfig) -> bool:
    """PEFT >= 0.22 on transformers 5 keeps target_modules' gate/up/down_proj and adds the fused experts to
    target_parameters: those names then adapt the experts (and any dense layer's MLP), not per-expert modules."""
    return model.is_moe and bool(cfg.get("target_parameters"))


def _refuse_moe_mlp(
    folder: Path, wanted: str | list[str], exclude: Any, model: ModelConfig, converted: bool
) -> None:
    """On a mixture-of-experts model a target_modules entry on the experts or the router is refused by name
    rather than reported as an unknown module (unless PEFT turned the experts' names into target_parameters)."""
    if not model.is_moe or converted:
        return
    hit = next(
        (
            n
            for n in _moe_expert_names(model)
            if _name_matches(wanted, n) and not (exclude and _name_matches(exclude, n))
        ),
        None,
    )
    if hit is not None:
        raise refuse(
            folder,
            f"target_modules={wanted!r} matches {hit}: LoRA on a mixture-of-experts model's experts or router as "
            f"modules is not supported; attention LoRA ({', '.join(ATTN_MODULES)}) and the dense layers' MLP are "
            "served, and the experts' fused weights and the router through target_parameters "
            "(mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight: what PEFT makes of these targets "
            "on transformers 5)",
        )


def _pattern_value(folder: Path, pattern: dict[str, float], name: str, default: float) -> float:
    for key, value in pattern.items():  # PEFT's get_pattern_key: first key matching a dotted suffix wins
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        except re.error as e:
            raise refuse(
                folder, f"rank_pattern/alpha_pattern key {key!r} is not a valid regex ({e})"
            ) from None
    return default


def ranks(folder: Path, cfg: dict[str, Any], model: ModelConfig) -> dict[tuple[int, str], int]:
    """Rank of every targeted (layer, module): r, or the first rank_pattern key matching its name."""
    names = {v: k for k, v in linear_names(model).items()}
    pat = cfg.get("rank_pattern") or {}
    return {t: int(_pattern_value(folder, pat, names[t], cfg["r"])) for t in targets(folder, cfg, model)}


def scales(
    folder: Path, cfg: dict[str, Any], model: ModelConfig, ranks: dict[tuple[int, str], int]
) -> dict[tuple[int, str], float]:
    """Scale of every (layer, module) in `ranks`: alpha (or alpha_pattern) over r, or over sqrt(r) with rslora."""
    names = {v: k for k, v in linear_names(model).items()}
    pat, rslora = cfg.get("alpha_pattern") or {}, bool(cfg.get("use_rslora"))
    return {
        t: float(_pattern_value(folder, pat, names[t], cfg["lora_alpha"])) / (math.sqrt(r) if rslora else r)
        for t, r in ranks.items()
    }


VOCAB_NAMES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}  # PEFT's full module names


def saved_modules(folder: Path, cfg: dict[str, Any], names: list[str]) -> set[str]:
    """The VOCAB_MODULES that modules_to_save names (PEFT's rule: an entry matches every module name ending with
    it), among the base model's module `names`; any other module it names is refused, by name."""
    entries = cfg.get("modules_to_save") or []
    entries = [entries] if isinstance(entries, str) else entries
    out = set()
    for t in entries:
        hits = [n for n in names if n.endswith(t)]
        other = [n for n in hits if n not in VOCAB_NAMES.values()]
        if other or not hits:
            raise refuse(
                folder,
                f"modules_to_save entry {t!r} names {other[0] if other else 'no module of this model'}: only "
                "embed_tokens and lm_head can be saved whole (modules_to_save); LoRA-Land adds deltas elsewhere",
            )
        out |= {n.split(".")[-1] for n in hits}
    return out


def module_names(model: ModelConfig) -> list[str]:
    """Every module name of the base causal LM (what PEFT matches modules_to_save against)."""
    return [*linear_names(model), *_other_names(model)]


def vocab_ranks_scales(
    folder: Path, cfg: dict[str, Any], model: ModelConfig
) -> tuple[dict[str, int], dict[str, float]]:
    """Rank and scale of every LoRA-targeted VOCAB_MODULE (r/alpha, or rank_pattern/alpha_pattern by its name)."""
    rp, ap, rslora = (
        cfg.get("rank_pattern") or {},
        cfg.get("alpha_pattern") or {},
        bool(cfg.get("use_rslora")),
    )
    ranks, scales = {}, {}
    for m in sorted(vocab_targets(folder, cfg, model)):
        r = int(_pattern_value(folder, rp, VOCAB_NAMES[m], cfg["r"]))
        alpha = float(_pattern_value(folder, ap, VOCAB_NAMES[m], cfg["lora_alpha"]))
        ranks[m], scales[m] = r, alpha / (math.sqrt(r) if rslora else r)
    return ranks, scales


def alora_tokens(folder: Path, cfg: dict[str, Any], model: ModelConfig) -> tuple[int, ...] | None:
    """An activated LoRA's invocation tokens (PEFT alora_invocation_tokens), checked against the vocabulary;
    None for a plain LoRA. aLoRA applies to linear layers only in PEFT: DoRA, embed_tokens/lm_head and
    expert LoRA beside it are refused."""
    toks = cfg.get("alora_invocation_tokens")
    if toks is None:
        return None
    bad = [t for t in toks if not 0 <= t < model.vocab_size]
    if bad:
        raise refuse(
            folder,
            f"alora_invocation_tokens holds {bad[0]}, outside the base model's vocabulary (0..{model.vocab_size - 1})"
            ": the adapter was tokenized for another model",
        )
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                      ("target_parameters", "LoRA on expert parameters")):  # fmt: skip
        if cfg.get(key):
            raise refuse(
                folder, f"alora_invocation_tokens with {what} is not supported (PEFT's aLoRA is plain LoRA)"
            )
    if vocab_targets(folder, cfg, model):
        raise refuse(folder, "alora_invocation_tokens with LoRA on embed_tokens/lm_head is not supported")
    return tuple(toks)
