"""PEFT LoRA adapters as published: read and validate against the base model, summarise, merge.

An adapter folder holds adapter_config.json and adapter_model.safetensors (PEFT's `save_pretrained`). Pickled
weights (adapter_model.bin) are never opened: unpickling runs arbitrary code. Everything that would make our
forward differ from PEFT's (DoRA, biases, modules_to_save, embeddings, fan_in_fan_out, ...) is refused with an
InvalidAdapter that names the field, rather than served subtly wrong.

Invariant of LoraWeights: for each module, every layer that carries it has the same rank (module_rank). A
per-layer rank_pattern, or a merge where only some terms touch a layer, is padded with zero rows of A and zero
columns of B, which leaves the delta unchanged. (layer, module) pairs absent from `tensors` contribute zero.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config.model_config import ATTN_MODULES, LORA_MODULES, ModelConfig
from app.errors import InvalidAdapter, InvalidRequest
from app.files import sha256_file

if TYPE_CHECKING:  # torch is imported where tensors are made, so `adapters validate/push` start fast
    import torch

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")

# Config fields that change PEFT's forward in ways a plain B@A delta does not reproduce: each must be falsy.
_REFUSED_FIELDS = {
    "use_dora": "DoRA rescales the whole weight per column; retrain or merge it into the base model",
    "modules_to_save": "it replaces whole modules (often lm_head or a classifier); LoRA-Land only adds deltas",
    "fan_in_fan_out": "it is for Conv1D (GPT-2 style) layers, which Llama/Mistral/Qwen2 do not have",
    "lora_bias": "LoRA-Land's deltas carry no bias; retrain with lora_bias=False",
    "trainable_token_indices": "it edits embedding rows; LoRA on embeddings is not supported",
    "layer_replication": "it duplicates decoder layers, which changes the base model",
    "target_parameters": "LoRA on raw parameters (e.g. MoE experts) is not supported",
    "use_qalora": "QA-LoRA pools the input; not supported",
    "alora_invocation_tokens": "activated LoRA switches on mid-sequence; not supported",
    "megatron_config": "Megatron-parallel LoRA layers are not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing between experts is not supported",
    "velora_config": "not a plain LoRA; not supported",
    "monteclora_config": "not a plain LoRA; not supported",
}
_TASK_TYPES = (None, "CAUSAL_LM", "FEATURE_EXTRACTION")
_KEY = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>\w+)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[\w\-]+))?\.weight$"
)


@dataclass
class LoraWeights:
    name: str
    rank: int  # the largest module rank
    alpha: float
    use_rslora: bool
    scale: (
        float  # alpha/r, or alpha/sqrt(r) with rslora; 1.0 when per-module scales are folded into A (merges)
    )
    target_modules: frozenset[str]  # subset of LORA_MODULES actually present
    layers: tuple[int, ...]  # layers that carry tensors
    tensors: dict[
        tuple[int, str], tuple[torch.Tensor, torch.Tensor]
    ]  # (layer, module) -> (A [r, in], B [out, r])
    source: str = ""

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values()
        )

    def module_rank(self, module: str) -> int:
        """Rank of `module` (the same in every layer that carries it); 0 when the adapter does not target it."""
        return next((a.shape[0] for (_, m), (a, _) in self.tensors.items() if m == module), 0)

    def delta(self, layer: int, module: str) -> torch.Tensor:
        """The dense weight delta [out, in] this adapter adds to `module` of `layer` (zeros when untargeted)."""
        a, b = self.tensors[(layer, module)]
        return self.scale * (b @ a)


def _refuse(folder: Path, msg: str) -> InvalidAdapter:
    return InvalidAdapter(f"adapter {folder}: {msg}")


def _load_config(folder: Path) -> dict[str, Any]:
    """Read adapter_config.json and refuse, by field, everything no model is needed to rule out."""
    if not folder.is_dir():
        raise _refuse(
            folder, "not a directory: give a folder holding adapter_config.json and adapter_model.safetensors"
        )
    if not (folder / WEIGHTS_FILE).is_file():
        pickled = [p for p in PICKLED_FILES if (folder / p).exists()]
        if pickled:
            raise _refuse(
                folder,
                f"{pickled[0]} is a pickle and LoRA-Land never unpickles (it can run code): convert it to "
                f"{WEIGHTS_FILE} (PEFT save_pretrained(..., safe_serialization=True)) in a trusted environment",
            )
        raise _refuse(folder, f"missing {WEIGHTS_FILE}: a PEFT adapter folder needs it next to {CONFIG_FILE}")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(folder, f"missing {CONFIG_FILE}: save the adapter with PEFT's save_pretrained")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _refuse(folder, f"{CONFIG_FILE} is not valid JSON ({e}): re-save it with PEFT") from None
    if not isinstance(cfg, dict):
        raise _refuse(folder, f"{CONFIG_FILE} must hold a JSON object, not {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(
            folder, f"peft_type is {cfg['peft_type']!r}: only LoRA adapters (peft_type LORA) are served"
        )
    if cfg.get("task_type") not in _TASK_TYPES:
        raise _refuse(folder, f"task_type {cfg['task_type']!r} is not a causal LM adapter: use CAUSAL_LM")
    for key, why in _REFUSED_FIELDS.items():
        if cfg.get(key):
            raise _refuse(folder, f"{key}={cfg[key]!r} is not supported: {why}")
    if cfg.get("bias", "none") != "none":
        raise _refuse(
            folder,
            f"bias={cfg['bias']!r} is not supported: LoRA-Land's deltas carry no bias; use bias='none'",
        )
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise _refuse(folder, f"{key}={v!r} must be a positive number")
    if int(cfg["r"]) != cfg["r"]:
        raise _refuse(folder, f"r={cfg['r']!r} must be an integer")
    for key in ("rank_pattern", "alpha_pattern"):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in pat.values()
        ):
            raise _refuse(folder, f"{key} must map module-name patterns to positive numbers, got {pat!r}")
    return cfg


def _parse_keys(folder: Path, keys: list[str]) -> dict[tuple[int, str, str], str]:
    """Map (layer, module, 'A'|'B') -> tensor key; refuse anything that is not a LoRA A/B of a decoder linear."""
    out: dict[tuple[int, str, str], str] = {}
    names: set[str] = set()
    for key in keys:
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise _refuse(
                folder, f"tensor {key}: LoRA on embed_tokens/lm_head is not supported (target_modules)"
            )
        if "lora_magnitude_vector" in key:
            raise _refuse(folder, f"tensor {key} is a DoRA magnitude (use_dora): not supported")
        m = _KEY.match(key)
        if m is None:
            raise _refuse(
                folder, f"tensor {key} is not a LoRA lora_A/lora_B weight of a decoder layer linear"
            )
        module, block = m["module"], m["block"]
        if module not in LORA_MODULES or block != ("self_attn" if module in ATTN_MODULES else "mlp"):
            raise _refuse(
                folder, f"tensor {key}: unknown target module {block}.{module}; supported: {LORA_MODULES}"
            )
        names.add(m["adapter"] or "")
        out[(int(m["layer"]), module, m["ab"])] = key
    if len(names) > 1:
        raise _refuse(folder, f"{WEIGHTS_FILE} holds several adapters {sorted(names)}: save one per folder")
    return out


def _linear_names(model: ModelConfig) -> dict[str, tuple[int, str]]:
    blocks = {m: "self_attn" if m in ATTN_MODULES else "mlp" for m in LORA_MODULES}
    return {
        f"model.layers.{i}.{blocks[m]}.{m}": (i, m) for i in range(model.num_layers) for m in LORA_MODULES
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


def _targets(folder: Path, cfg: dict[str, Any], model: ModelConfig) -> set[tuple[int, str]]:
    """(layer, module) pairs that PEFT would wrap in LoRA for this config on this base model."""
    targets, exclude = cfg.get("target_modules"), cfg.get("exclude_modules")
    if not isinstance(targets, (str, list)) or not targets or not all(isinstance(t, str) for t in targets):
        raise _refuse(
            folder, f"target_modules={targets!r} must be a non-empty list of module names or a regex"
        )
    linear, others = _linear_names(model), _other_names(model)
    try:
        hit_linear = {n for n in linear if _name_matches(targets, n)}
        hit_other = [n for n in others if _name_matches(targets, n)]
        if exclude:
            hit_linear = {n for n in hit_linear if not _name_matches(exclude, n)}
            hit_other = [n for n in hit_other if not _name_matches(exclude, n)]
    except re.error as e:
        raise _refuse(folder, f"target_modules/exclude_modules is not a valid regex ({e})") from None
    emb = [n for n in hit_other if n.endswith(("embed_tokens", "lm_head"))]
    if emb:
        raise _refuse(
            folder,
            f"target_modules={targets!r} matches {emb[0]}: LoRA on embed_tokens/lm_head is not supported; "
            f"target only the decoder projections {LORA_MODULES}",
        )
    unknown = hit_other or (
        [t for t in targets if not any(_name_matches([t], n) for n in linear)]
        if isinstance(targets, list)
        else []
    )
    if unknown or not hit_linear:
        raise _refuse(
            folder,
            f"target_modules={targets!r}: unknown target module {unknown[:3] or targets!r}; supported: {LORA_MODULES}",
        )
    if cfg.get("layers_pattern") not in (None, "", "layers", ["layers"], []):
        raise _refuse(folder, f"layers_pattern={cfg['layers_pattern']!r}: Llama-family models use 'layers'")
    wanted = cfg.get("layers_to_transform")
    if wanted is not None and wanted != []:
        if isinstance(targets, str):
            raise _refuse(
                folder, "layers_to_transform cannot be combined with a regex target_modules (PEFT refuses it)"
            )
        wanted = [wanted] if isinstance(wanted, int) else wanted
        bad = [i for i in wanted if not isinstance(i, int) or not 0 <= i < model.num_layers]
        if bad:
            raise _refuse(
                folder,
                f"layers_to_transform {bad} out of range: the base model has {model.num_layers} layers",
            )
        hit_linear = {n for n in hit_linear if linear[n][0] in wanted}
    if not hit_linear:
        raise _refuse(
            folder, "target_modules, exclude_modules and layers_to_transform leave no module to adapt"
        )
    return {linear[n] for n in hit_linear}


def _pattern_value(folder: Path, pattern: dict[str, float], name: str, default: float) -> float:
    for key, value in pattern.items():  # PEFT's get_pattern_key: first key matching a dotted suffix wins
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        except re.error as e:
            raise _refuse(
                folder, f"rank_pattern/alpha_pattern key {key!r} is not a valid regex ({e})"
            ) from None
    return default


def _loose_name(s: str | None) -> str:
    return re.sub(r"[^a-z0-9]", "", (s or "").rstrip("/").split("/")[-1].lower())


def read_adapter(
    folder: str | Path,
    model: ModelConfig,
    *,
    max_rank: int = 64,
    name: str | None = None,
    max_bytes: int | None = None,
) -> LoraWeights:
    """Read a PEFT LoRA adapter folder, validated against `model`, as fp32 CPU tensors in PEFT layout."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    cfg = _load_config(folder)
    base_cls = (cfg.get("auto_mapping") or {}).get("base_model_class")
    family = re.split(r"For|Model", str(base_cls))[0]
    if str(base_cls).endswith(("ForCausalLM", "Model")) and family != model.architecture.split("For")[0]:
        raise _refuse(
            folder,
            f"auto_mapping.base_model_class is {base_cls} but the base model is {model.architecture}: "
            "use an adapter trained for this base model",
        )
    base_name, served = cfg.get("base_model_name_or_path"), model.raw.get("_name_or_path")
    if base_name and served and _loose_name(base_name) != _loose_name(served):
        log.warning(
            "adapter %s was trained on %s, serving it on %s (shapes match)", folder, base_name, served
        )
    weights = folder / WEIGHTS_FILE
    if max_bytes is not None and weights.stat().st_size > max_bytes:
        raise _refuse(
            folder, f"{WEIGHTS_FILE} is {weights.stat().st_size} bytes, over the {max_bytes}-byte limit"
        )
    targets = _targets(folder, cfg, model)
    linear = {v: k for k, v in _linear_names(model).items()}
    rank_pat, alpha_pat = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    ranks = {t: int(_pattern_value(folder, rank_pat, linear[t], cfg["r"])) for t in targets}
    if max(ranks.values()) > max_rank:
        raise _refuse(
            folder,
            f"r={max(ranks.values())} (r/rank_pattern) exceeds max_lora_rank={max_rank}: use a smaller rank",
        )
    rslora = bool(cfg.get("use_rslora"))
    scales = {
        t: float(_pattern_value(folder, alpha_pat, linear[t], cfg["lora_alpha"]))
        / (math.sqrt(r) if rslora else r)
        for t, r in ranks.items()
    }
    try:
        with safe_open(weights, framework="pt", device="cpu") as f:
            tensors = _read_tensors(folder, f, model, ranks)
    except SafetensorError as e:
        raise _refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    scale = next(iter(scales.values()))
    if any(s != scale for s in scales.values()):  # alpha/rank patterns: fold each module's scale into its A
        tensors = {k: (a * scales[k], b) for k, (a, b) in tensors.items()}
        scale = 1.0
    tensors = _pad_ranks(tensors)
    return LoraWeights(
        name=name or folder.name,
        rank=max(a.shape[0] for a, _ in tensors.values()),
        alpha=float(cfg["lora_alpha"]),
        use_rslora=rslora,
        scale=scale,
        target_modules=frozenset(m for _, m in tensors),
        layers=tuple(sorted({lay for lay, _ in tensors})),
        tensors=tensors,
        source=str(folder),
    )


def _read_tensors(folder: Path, f: Any, model: ModelConfig, ranks: dict[tuple[int, str], int]) -> dict:
    """Check the file's keys against the config's targets and each tensor against the base model, then load
    the (A, B) pairs as fp32. Shapes are checked from the header before any tensor data is read."""
    import torch

    shapes = model.linear_shapes()
    keys = _parse_keys(folder, list(f.keys()))
    for layer, _module, _ in keys:
        if layer >= model.num_layers:
            raise _refuse(
                folder,
                f"tensors for layer {layer} but the base model has {model.num_layers} layers "
                "(num_hidden_layers): this adapter is for a different base model",
            )
    present = {(lay, mod) for lay, mod, _ in keys}
    for lay, mod in sorted(present):
        for ab in "AB":
            if (lay, mod, ab) not in keys:
                raise _refuse(
                    folder,
                    f"layer {lay} {mod} has lora_{'BA'[ab == 'B']} but no lora_{ab}: the file is incomplete",
                )
    if present - set(ranks):
        raise _refuse(
            folder,
            f"tensors for (layer, module) {sorted(present - set(ranks))[:3]} which target_modules/"
            "layers_to_transform do not name: adapter_config.json does not describe these weights",
        )
    if set(ranks) - present:
        raise _refuse(
            folder,
            f"no tensors for {sorted(set(ranks) - present)[:3]} named by target_modules: the file is incomplete",
        )
    tensors = {}
    for lay, mod in sorted(present):
        (n_in, n_out), r = shapes[mod], ranks[(lay, mod)]
        pair = []
        for ab, want in (("A", [r, n_in]), ("B", [n_out, r])):
            key = keys[(lay, mod, ab)]
            got = list(f.get_slice(key).get_shape())
            if got != want:
                raise _refuse(
                    folder,
                    f"tensor {key} has shape {got}, expected {want} (r={r}, {mod} is "
                    f"{n_in}->{n_out}): the adapter does not fit this base model or its r is wrong",
                )
            t = f.get_tensor(key)
            if not t.is_floating_point():
                raise _refuse(
                    folder, f"tensor {key} has dtype {t.dtype}: LoRA weights must be floating point"
                )
            t = t.to(torch.float32)
            if not torch.isfinite(t).all():
                raise _refuse(folder, f"tensor {key} holds NaN or inf values: the adapter is corrupt")
            # Same values, column-major storage: the device pools hold A^T and B^T, so installing an adapter
            # (on the engine's step thread) is then a plain copy; the transpose is paid here, off that thread.
            pair.append(t.t().contiguous().t())
        tensors[(lay, mod)] = (pair[0], pair[1])
    return tensors


def _pad_ranks(tensors: dict) -> dict:
    """Zero-pad every layer of a module to that module's largest rank (exact: the padding adds nothing)."""
    import torch

    width: dict[str, int] = {}
    for (_, m), (a, _) in tensors.items():
        width[m] = max(width.get(m, 0), a.shape[0])
    out = {}
    for (lay, m), (a, b) in tensors.items():
        pad = width[m] - a.shape[0]
        if pad:
            a = torch.cat([a, a.new_zeros(pad, a.shape[1])], 0)
            b = torch.cat([b, b.new_zeros(b.shape[0], pad)], 1)
        out[(lay, m)] = (a, b)
    return out


def adapter_summary(folder: str | Path) -> dict:
    """What the catalog records, without a base model: config facts, the modules and layers present in the
    weights (read from the safetensors header only), and sha256/size of the two files that define the adapter."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    cfg = _load_config(folder)
    try:
        with safe_open(folder / WEIGHTS_FILE, framework="pt", device="cpu") as f:
            keys = _parse_keys(folder, list(f.keys()))
    except SafetensorError as e:
        raise _refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    files = {n: sha256_file(folder / n) for n in (CONFIG_FILE, WEIGHTS_FILE)}
    return {
        "rank": int(max([cfg["r"], *(cfg.get("rank_pattern") or {}).values()])),
        "alpha": float(cfg["lora_alpha"]),
        "use_rslora": bool(cfg.get("use_rslora")),
        "target_modules": sorted({m for _, m, _ in keys}),
        "layers": sorted({lay for lay, _, _ in keys}),
        "files": files,
        "size": sum((folder / n).stat().st_size for n in files),
        "base_model_name_or_path": cfg.get("base_model_name_or_path"),
        "peft_type": cfg.get("peft_type", "LORA"),
    }


def merge_adapters(
    terms: list[tuple[LoraWeights, float]], name: str, *, max_rank: int | None = None
) -> LoraWeights:
    """Linear merge sum_i w_i * delta_i as one wider adapter: per (layer, module), A = [w1*s1*A1; w2*s2*A2; ...],
    B = [B1, B2, ...], scale 1.0, concatenating only the terms that carry that (layer, module); then ranks are
    zero-padded per module (see the module docstring).

    Equals PEFT's add_weighted_adapter(..., combination_type="cat") delta for delta, with two PEFT quirks we do
    not copy: its merged config takes use_rslora and layers_to_transform from the FIRST adapter, so when that one
    uses rslora PEFT's merge is scaled by sqrt(total rank) instead of 1, and when it has layers_to_transform
    PEFT drops the other adapters' other layers. Ours is always exactly sum_i w_i * delta_i."""
    import torch

    if not terms:
        raise InvalidRequest("a merge needs at least one adapter term, e.g. 'a*0.7+b*0.3'")
    for lw, w in terms:
        if not isinstance(w, (int, float)) or not math.isfinite(w):
            raise InvalidRequest(f"merge weight {w!r} for adapter {lw.name!r} must be a finite number")
    keys = sorted({k for lw, _ in terms for k in lw.tensors})
    tensors = {}
    for key in keys:
        parts = [(lw.tensors[key], w * lw.scale) for lw, w in terms if key in lw.tensors]
        shapes = {(a.shape[1], b.shape[0]) for (a, b), _ in parts}
        if len(shapes) > 1:
            raise InvalidRequest(
                f"merge {name!r}: adapters disagree on the shape of layer {key[0]} {key[1]}: {shapes}"
            )
        a = torch.cat([a * s for (a, _), s in parts], 0)
        b = torch.cat([b for (_, b), _ in parts], 1)
        tensors[key] = (a, b)
    tensors = _pad_ranks(tensors)
    rank = max((a.shape[0] for a, _ in tensors.values()), default=0)
    if max_rank is not None and rank > max_rank:
        raise InvalidRequest(
            f"merge {name!r} has rank {rank} (sum of its terms' ranks), over max_lora_rank={max_rank}"
        )
    return LoraWeights(
        name=name,
        rank=rank,
        alpha=float(rank),  # alpha == r, as in PEFT's merged config: scale 1.0, the weights are folded into A
        use_rslora=False,
        scale=1.0,
        target_modules=frozenset(m for _, m in tensors),
        layers=tuple(sorted({lay for lay, _ in tensors})),
        tensors=tensors,
        source="merge:" + "+".join(f"{lw.name}*{w:g}" for lw, w in terms),
    )
