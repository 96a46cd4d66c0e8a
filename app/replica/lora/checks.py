"""Adapter checks that need no base model: what `loraland adapters push/register` (with or without --model) and
the admin register path (POST /v1/adapters) refuse before anything is recorded.

read_adapter (peft_format.py) checks an adapter against one base model when a replica loads it: shapes, layer
count, targets resolved on that model. Everything here holds for any Llama/Mistral/Qwen2 model, so an adapter
that fails it can never load anywhere and is refused at registration, by field, instead of on every request:

- adapter_config.json as peft_config.load_config reads it (pickles, unsupported fields, unsafe regexes, r);
- auto_mapping naming another model family than Llama/Mistral/Qwen2;
- target_modules entries that name no Llama/Mistral/Qwen2 linear; tensors the config does not target;
- tensor layer indices of MAX_LAYERS or more;
- lora_A without lora_B (or the reverse), non-float dtypes (read from the header), tensors that are not 2-D,
  ranks that disagree with r/rank_pattern or exceed max_rank, and in/out sizes that no single model has;
- NaN/inf values, and deltas too large to be a trained adapter (MAX_DELTA_NORM).
- embed_tokens/lm_head (LoRA on them, modules_to_save copies, saved base weights): named by the config, 2-D,
  floating point, finite, the rank r/rank_pattern says, and one vocabulary and hidden size across them.

What needs the base model (hidden size, layer count) is checked by the replica at first load; a failure there
marks the catalog record unloadable (app/replica/core.py, app/catalog/registry.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from app.config.model_config import TARGET_MODULES, ModelConfig
from app.config.model_families import SUPPORTED_ARCHITECTURES
from app.replica.lora import experts as X
from app.replica.lora import peft_config as C
from app.replica.lora.peft_config import WEIGHTS_FILE, refuse
from app.replica.lora.peft_format import _parse_keys
from app.replica.lora.weights import VOCAB_MODULES

# Decoder layer indices must be below this. The deepest published Llama-family models have ~126 layers
# (Llama-3.1-405B); 1024 leaves ample room for anything real and still refuses "layers.5000" at once.
MAX_LAYERS = 1024

# ||scale * B @ A||_F of any one module must be at most this. It bounds every entry of the delta, and 65504 is
# the largest finite float16 value: a delta beyond it cannot be held by a half-precision forward pass. Trained
# adapters are far below: LoRA updates are small next to the base weights (whose own Frobenius norms are of
# order 10-1000 per matrix); the test fixtures here reach ~3, randomly drawn N(0, 0.1) factors at rank 64 on a
# 4096-wide model ~700. An adapter whose lora_B was multiplied by 1e18 is ~1e18: refused.
MAX_DELTA_NORM = 65504.0

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors header names; F8_* variants are floats too
_FAMILIES = {name.split("For")[0].lower() for name in SUPPORTED_ARCHITECTURES}  # llama, mistral, qwen2
_TARGET = re.compile(
    r"^(?:(?:model\.)?layers\.(?P<layer>\d+)\.)?(?:(?P<block>self_attn|mlp)\.)?(?P<module>[A-Za-z0-9_]+)$"
)
_GLOBAL_NAMES = ("model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
_VOCAB_TARGETS = ("embed_tokens", "model.embed_tokens", "lm_head")  # target_modules entries naming them


def _block(module: str) -> str:
    return ModelConfig.block_of(module)


def full_name(layer: int, module: str) -> str:
    """The module's name in a Llama/Mistral/Qwen2 causal LM (what PEFT matches target_modules against)."""
    return f"model.layers.{layer}.{_block(module)}.{module}"


def check_adapter(folder: str | Path, *, max_rank: int) -> dict[str, Any]:
    """Run every base-model-free check on an adapter folder; raise InvalidAdapter naming what to fix.
    Returns {"max_delta_norm": largest ||scale * B @ A||_F over its modules}."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    cfg = C.load_config(folder)
    _check_base_class(folder, cfg)
    only_experts = bool(cfg.get("target_parameters")) and not cfg.get("target_modules")  # PEFT's MoE MLP
    if not only_experts:
        _check_config_targets(folder, cfg, max_rank)
    try:
        with safe_open(folder / WEIGHTS_FILE, framework="pt", device="cpu") as f:
            X.check_expert_tensors(folder, f, cfg, max_rank)  # LoRA on MoE experts (target_parameters)
            if only_experts:
                return {"max_delta_norm": 0.0}  # not computed for expert LoRA
            vocab: dict[tuple[str, str], str] = {}
            keys = _parse_keys(
                folder, [k for k in f.keys() if not (X.is_expert_key(k) or X.is_router_key(k))], vocab
            )
            _check_vocab(folder, f, vocab, cfg, max_rank)
            ranks = _check_header(folder, f, keys, cfg, max_rank, bool(vocab))
            _check_covered(folder, cfg, ranks)
            norm = _check_values(folder, f, keys, cfg, ranks)
    except SafetensorError as e:
        raise refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    return {"max_delta_norm": norm}


def _check_base_class(folder: Path, cfg: dict) -> None:
    mapping = cfg.get("auto_mapping") or {}
    if not isinstance(mapping, dict):
        raise refuse(folder, f"auto_mapping={mapping!r} must be an object")
    cls, lib = mapping.get("base_model_class"), mapping.get("parent_library")
    family = re.split(r"For|Model|LMHead", str(cls))[0].lower() if cls else None
    lib_family = re.match(r"^transformers\.models\.(\w+)\.", str(lib or ""))
    if (family is not None and family not in _FAMILIES) or (lib_family and lib_family[1] not in _FAMILIES):
        raise refuse(
            folder,
            f"auto_mapping.base_model_class is {cls!r} (from {lib!r}): the adapter was trained for another "
            f"model family; LoRA-Land serves {sorted(SUPPORTED_ARCHITECTURES)}",
        )


def _check_config_targets(folder: Path, cfg: dict, max_rank: int) -> None:
    ranks = [cfg["r"], *(cfg.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise refuse(folder, f"r={max(ranks)} (r/rank_pattern) exceeds the maximum rank {max_rank}")
    targets = cfg.get("target_modules")
    if not targets or not (isinstance(targets, str) or all(isinstance(t, str) for t in targets)):
        raise refuse(
            folder, f"target_modules={targets!r} must be a non-empty list of module names or a regex"
        )
    if cfg.get("use_dora") and (
        any(t in _VOCAB_TARGETS for t in targets)
        if isinstance(targets, list)
        else any(C._name_matches(targets, n) for n in ("model.embed_tokens", "lm_head"))
    ):
        raise refuse(
            folder, "use_dora=true with embed_tokens/lm_head in target_modules: DoRA on them is not supported"
        )
    for t in [] if isinstance(targets, str) else targets:
        if t in _VOCAB_TARGETS:
            continue
        m = _TARGET.match(t)
        if (
            m is None
            or m["module"] not in TARGET_MODULES
            or (m["block"] and m["block"] != _block(m["module"]))
        ):
            raise refuse(
                folder,
                f"target_modules: unknown target module {t!r} (it is not a linear of a Llama/Mistral/Qwen2 "
                f"decoder layer, nor embed_tokens/lm_head); supported: {TARGET_MODULES + VOCAB_MODULES}",
            )
        if m["layer"] is not None and int(m["layer"]) >= MAX_LAYERS:
            raise refuse(folder, f"target_modules entry {t!r}: layer {m['layer']} is past {MAX_LAYERS}")
    layers = cfg.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers or []
    if not isinstance(layers, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_LAYERS for i in layers
    ):
        raise refuse(folder, f"layers_to_transform={layers!r} must hold layer indices in [0, {MAX_LAYERS})")


def _shape(f: Any, key: str) -> list[int]:
    return list(f.get_slice(key).get_shape())


def _check_header(
    folder: Path, f: Any, keys: dict, cfg: dict, max_rank: int, has_vocab: bool = False
) -> dict[tuple[int, str], int]:
    """Layer indices, A/B pairs, dtypes, ranks and sizes from the header alone; -> {(layer, module): rank}."""
    for (layer, _module, _ab), key in sorted(keys.items()):
        if layer >= MAX_LAYERS:
            raise refuse(
                folder,
                f"tensor {key}: layer {layer} is past any supported model (layer indices must be below "
                f"{MAX_LAYERS}; the deepest Llama-family models have ~126): the file is corrupt",
            )
        dtype = f.get_slice(key).get_dtype()
        if dtype not in _FLOAT_DTYPES and not dtype.startswith("F8"):
            raise refuse(folder, f"tensor {key} has dtype {dtype}: LoRA weights must be floating point")
    pairs = {(lay, mod) for lay, mod, ab in keys if ab != "M"}
    for lay, mod in sorted(pairs):
        for ab in "AB":
            if (lay, mod, ab) not in keys:
                raise refuse(
                    folder,
                    f"layer {lay} {mod} has lora_{'BA'[ab == 'B']} but no lora_{ab}: the file is incomplete",
                )
    if not pairs and not has_vocab:
        raise refuse(folder, f"{WEIGHTS_FILE} holds no lora_A/lora_B tensors")
    _check_magnitudes(folder, f, keys, pairs, bool(cfg.get("use_dora")))
    ranks, sizes = {}, {}
    pattern = cfg.get("rank_pattern") or {}
    for lay, mod in sorted(pairs):
        ka, kb = keys[(lay, mod, "A")], keys[(lay, mod, "B")]
        a, b = _shape(f, ka), _shape(f, kb)
        if len(a) != 2 or len(b) != 2 or min(a + b) < 1 or a[0] != b[1]:
            raise refuse(
                folder,
                f"{ka} has shape {a} and {kb} {b}: expected [r, in] and [out, r] with the same r >= 1",
            )
        want = int(C._pattern_value(folder, pattern, full_name(lay, mod), cfg["r"]))
        if a[0] != want:
            raise refuse(
                folder,
                f"tensor {ka} has rank {a[0]} but adapter_config.json says r={want} (r/rank_pattern): the config "
                "does not describe these weights",
            )
        if a[0] > max_rank:
            raise refuse(folder, f"tensor {ka} has rank {a[0]}, over the maximum rank {max_rank}")
        ranks[(lay, mod)] = a[0]
        if sizes.setdefault(mod, (a[1], b[0])) != (a[1], b[0]):
            raise refuse(
                folder,
                f"{mod} is {sizes[mod][0]}->{sizes[mod][1]} in one layer but {a[1]}->{b[0]} in layer {lay}: "
                "no model has layers of different sizes",
            )
    _check_sizes(folder, sizes)
    return ranks


def _check_sizes(folder: Path, sizes: dict[str, tuple[int, int]]) -> None:
    """Sizes every Llama/Mistral/Qwen2 layer shares: one hidden size in and out, q_proj's output is o_proj's
    input, k/v agree, gate/up outputs are down_proj's input."""
    same = {
        "hidden size": [(m, 0) for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
        + [("o_proj", 1), ("down_proj", 1)],
        "attention width": [("q_proj", 1), ("o_proj", 0)],
        "key/value width": [("k_proj", 1), ("v_proj", 1)],
        "intermediate size": [("gate_proj", 1), ("up_proj", 1), ("down_proj", 0)],
    }
    for what, where in same.items():
        seen = {f"{m} {'in' if i == 0 else 'out'}": sizes[m][i] for m, i in where if m in sizes}
        if len(set(seen.values())) > 1:
            raise refuse(
                folder,
                f"the tensors disagree on the {what} ({seen}): no Llama/Mistral/Qwen2 model has these "
                "shapes; the file is corrupt or mixes adapters",
            )


def _check_magnitudes(folder: Path, f: Any, keys: dict, pairs: set, use_dora: bool) -> None:
    mags = {(lay, mod): k for (lay, mod, ab), k in keys.items() if ab == "M"}
    if mags and not use_dora:
        raise refuse(
            folder,
            f"tensor {next(iter(mags.values()))} is a DoRA magnitude but adapter_config.json has no "
            "use_dora=true: the config does not describe these weights",
        )
    if use_dora and set(mags) != pairs:
        raise refuse(folder, "use_dora=true needs one lora_magnitude_vector per lora_A/lora_B pair")
    for (lay, mod), key in mags.items():
        if len(_shape(f, key)) != 1 or _shape(f, key)[0] != _shape(f, keys[(lay, mod, "B")])[0]:
            raise refuse(folder, f"tensor {key} has shape {_shape(f, key)}: expected [out] of its lora_B")


def _check_covered(folder: Path, cfg: dict, ranks: dict[tuple[int, str], int]) -> None:
    """Every tensor is for a module the config targets (PEFT's matching rules), and a regex targets no
    embedding, head or norm."""
    targets, exclude = cfg["target_modules"], cfg.get("exclude_modules")
    layers = cfg.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers
    for lay, mod in sorted(ranks):
        name = full_name(lay, mod)
        if (
            not C._name_matches(targets, name)
            or (exclude and C._name_matches(exclude, name))
            or (layers and lay not in layers)
        ):
            raise refuse(
                folder,
                f"tensors for {name}, which target_modules={targets!r} (with exclude_modules/"
                "layers_to_transform) does not name: adapter_config.json does not describe these weights",
            )
    if isinstance(targets, str):
        present = sorted({lay for lay, _ in ranks})
        others = [n for n in _GLOBAL_NAMES if n not in C.VOCAB_NAMES.values()] + [
            f"model.layers.{i}.{part}"
            for i in present
            for part in ("self_attn", "mlp", "mlp.act_fn", "input_layernorm", "post_attention_layernorm")
        ]
        hit = next((n for n in others if C._name_matches(targets, n)), None)
        if hit is not None:
            raise refuse(
                folder,
                f"target_modules={targets!r} also matches {hit}, which is not a LoRA-able linear; supported: "
                f"{TARGET_MODULES}",
            )
    elif not exclude:
        modules = {mod for _, mod in ranks}
        missing = [
            t
            for t in targets
            if t not in _VOCAB_TARGETS and not any(C._name_matches([t], full_name(0, m)) for m in modules)
        ]
        missing = [t for t in missing if (m := _TARGET.match(t)) and m["layer"] is None]
        if missing:
            raise refuse(
                folder,
                f"target_modules names {missing} but {WEIGHTS_FILE} has no tensors for it: the file is "
                "incomplete",
            )


def _check_values(folder: Path, f: Any, keys: dict, cfg: dict, ranks: dict) -> float:
    """Finite values everywhere, and ||scale * B @ A||_F <= MAX_DELTA_NORM per module, computed exactly in
    rank space: ||BA||_F^2 = trace((B^T B)(A A^T)), two r x r Gram matrices, in float64."""
    import torch

    for (_lay, _mod, ab), key in keys.items():
        if ab == "M" and not torch.isfinite(f.get_tensor(key).to(torch.float64)).all():
            raise refuse(folder, f"tensor {key} holds NaN or inf values: the adapter is corrupt")
    alpha_pattern, rslora, worst = cfg.get("alpha_pattern") or {}, bool(cfg.get("use_rslora")), 0.0
    for (lay, mod), r in sorted(ranks.items()):
        pair = []
        for ab in "AB":
            t = f.get_tensor(keys[(lay, mod, ab)]).to(torch.float64)  # float8 has no isfinite
            if not torch.isfinite(t).all():
                raise refuse(
                    folder, f"tensor {keys[(lay, mod, ab)]} holds NaN or inf values: the adapter is corrupt"
                )
            pair.append(t)
        a, b = pair
        alpha = float(C._pattern_value(folder, alpha_pattern, full_name(lay, mod), cfg["lora_alpha"]))
        scale = alpha / (math.sqrt(r) if rslora else r)
        norm = scale * math.sqrt(max(0.0, float(((b.T @ b) * (a @ a.T)).sum())))
        if not norm <= MAX_DELTA_NORM:  # also catches inf/NaN from overflow
            raise refuse(
                folder,
                f"layer {lay} {mod}: the delta scale*B@A has Frobenius norm {norm:.3g}, over the limit "
                f"{MAX_DELTA_NORM:g} (float16's largest value; trained adapters stay far below): the weights "
                "are corrupt or mis-scaled",
            )
        worst = max(worst, norm)
    return worst


def _check_vocab(folder: Path, f: Any, vocab: dict[tuple[str, str], str], cfg: dict, max_rank: int) -> None:
    """embed_tokens/lm_head tensors: those the config names (LoRA by target_modules, copies by
    modules_to_save) and no others, with the ranks it says, one vocabulary and hidden size, finite floats."""
    import torch

    names = [*_GLOBAL_NAMES] + [full_name(0, m) for m in TARGET_MODULES]
    saved = C.saved_modules(folder, cfg, names)
    targets = cfg["target_modules"]
    lora = {
        m for m, n in C.VOCAB_NAMES.items() if C._name_matches(targets, n) and not (
            cfg.get("exclude_modules") and C._name_matches(cfg["exclude_modules"], n))
    }  # fmt: skip
    if lora & saved:
        raise refuse(folder, f"{sorted(lora & saved)[0]} is in both target_modules and modules_to_save")
    sizes: dict[str, int] = {}
    for (mod, kind), key in sorted(vocab.items()):
        if not (mod in saved if kind == "copy" else mod in lora):
            why = "modules_to_save" if kind == "copy" else "target_modules"
            raise refuse(
                folder, f"tensor {key} but {why} does not name {mod}: the config does not describe it"
            )
        shape, dtype = _shape(f, key), f.get_slice(key).get_dtype()
        if dtype not in _FLOAT_DTYPES and not dtype.startswith("F8"):
            raise refuse(folder, f"tensor {key} has dtype {dtype}: weights must be floating point")
        if len(shape) != 2 or min(shape) < 1:
            raise refuse(folder, f"tensor {key} has shape {shape}: expected a 2-D weight")
        emb = mod == "embed_tokens"
        if kind in ("A", "B"):
            r = shape[0] if kind == "A" else shape[1]
            want = int(C._pattern_value(folder, cfg.get("rank_pattern") or {}, C.VOCAB_NAMES[mod], cfg["r"]))
            if r != want or r > max_rank:
                raise refuse(
                    folder, f"tensor {key} has rank {r}; adapter_config.json says r={want} (max {max_rank})"
                )
            other = shape[1] if kind == "A" else shape[0]
            dim = "vocab" if (kind == "A") == emb else "hidden"
        else:
            if sizes.setdefault("vocab", shape[0]) != shape[0]:
                raise refuse(
                    folder,
                    f"tensor {key} has {shape[0]} rows, other tensors a vocabulary of {sizes['vocab']}",
                )
            other, dim = shape[1], "hidden"
        if sizes.setdefault(dim, other) != other:
            raise refuse(
                folder,
                f"tensor {key} has {dim} size {other}, other tensors {sizes[dim]}: the file is corrupt",
            )
        if not torch.isfinite(f.get_tensor(key).to(torch.float64)).all():
            raise refuse(folder, f"tensor {key} holds NaN or inf values: the adapter is corrupt")
    for m in saved:
        if (m, "copy") not in vocab:
            raise refuse(folder, f"modules_to_save names {m} but {WEIGHTS_FILE} has no {m}.weight")
    for m in lora:
        if not {(m, "A"), (m, "B")} <= set(vocab):
            raise refuse(folder, f"target_modules names {m} but {WEIGHTS_FILE} lacks its LoRA A or B")
