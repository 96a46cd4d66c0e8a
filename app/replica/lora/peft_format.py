"""PEFT LoRA adapter folders as published: read and validate against the base model; summarise for the catalog.

An adapter folder holds adapter_config.json (checked by peft_config.py) and adapter_model.safetensors (PEFT's
`save_pretrained`): lora_A/lora_B per targeted linear, and with use_dora a lora_magnitude_vector. Pickled weights (adapter_model.bin) are never opened: unpickling runs arbitrary code. The
tensor file is checked from its header (keys, shapes) before any tensor data is read.

embed_tokens/lm_head (weights.py's VOCAB_MODULES) as PEFT saves them: LoRA on embed_tokens as
`embed_tokens.lora_embedding_A/B` (no `.weight`), on lm_head as `lm_head.lora_A/B.weight`, the base weight beside a
LoRA on either as `<module>.base_layer.weight` (save_embedding_layers, on by default then), and modules_to_save as
`<module>.weight`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from app.config.kernel_config import KernelConfig
from app.config.model_config import FUSED_MODULES, ROUTER_MODULE, TARGET_MODULES, ModelConfig
from app.files import sha256_file
from app.replica.lora import experts as X
from app.replica.lora import peft_config as C
from app.replica.lora.peft_config import CONFIG_FILE, WEIGHTS_FILE, refuse
from app.replica.lora.weights import LoraWeights, Tensors, pad_ranks, split_fused

log = logging.getLogger(__name__)

_KEY = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>\w+)\.(?P<module>\w+)"
    r"\.(?:lora_(?P<ab>A|B)(?:\.(?P<adapter>[\w\-]+))?\.weight"
    r"|lora_magnitude_vector(?:\.(?!weight$)(?P<mag_adapter>[\w\-]+))?(?:\.weight)?)$"
)

_VOCAB_KEY = re.compile(
    r"^(?:.*\.)?(?P<module>embed_tokens|lm_head)\.(?:"
    r"lora_embedding_(?P<eab>A|B)(?:\.(?P<eadapter>[\w\-]+))?"
    r"|lora_(?P<ab>A|B)(?:\.(?P<adapter>[\w\-]+))?\.weight"
    r"|(?P<base>base_layer\.)?weight)$"
)


def _parse_keys(
    folder: Path, keys: list[str], vocab: dict[tuple[str, str], str] | None = None
) -> dict[tuple[int, str, str], str]:
    """Map (layer, module, 'A'|'B'|'M') -> tensor key ('M': DoRA's magnitude); refuse anything that is not a
    LoRA A/B (or DoRA magnitude) of a decoder linear, or one of embed_tokens/lm_head's tensors. Those go into
    `vocab` (when given) as (module, 'A'|'B'|'base'|'copy') -> key."""
    out: dict[tuple[int, str, str], str] = {}
    names: set[str] = set()
    for key in keys:
        v = _VOCAB_KEY.match(key)
        if v is not None:
            ab = v["eab"] or v["ab"]
            if ab is not None and (v["eab"] is not None) != (v["module"] == "embed_tokens"):
                raise refuse(
                    folder,
                    f"tensor {key}: PEFT saves LoRA on embed_tokens as lora_embedding_A/B and on lm_head as "
                    "lora_A/B.weight; this file mixes them up",
                )
            if ab is not None:
                names.add(v["eadapter"] or v["adapter"] or "")
            if vocab is not None:
                vocab[(v["module"], ab or ("base" if v["base"] else "copy"))] = key
            continue
        m = _KEY.match(key)
        if m is None:
            raise refuse(
                folder,
                f"tensor {key} is not a LoRA lora_A/lora_B weight (or DoRA lora_magnitude_vector) of a "
                "decoder layer linear",
            )
        module, block = m["module"], m["block"]
        if module not in (*TARGET_MODULES, ROUTER_MODULE) or block != ModelConfig.block_of(module):
            raise refuse(
                folder, f"tensor {key}: unknown target module {block}.{module}; supported: {TARGET_MODULES}"
            )
        names.add(m["adapter"] or m["mag_adapter"] or "")
        out[(int(m["layer"]), module, m["ab"] or "M")] = key
    if len(names) > 1:
        raise refuse(folder, f"{WEIGHTS_FILE} holds several adapters {sorted(names)}: save one per folder")
    return out


def _loose_name(s: str | None) -> str:
    return re.sub(r"[^a-z0-9]", "", (s or "").rstrip("/").split("/")[-1].lower())


def _check_base_model(folder: Path, cfg: dict[str, Any], model: ModelConfig) -> None:
    """Refuse an adapter whose config names another model family; warn on another checkpoint of this one."""
    base_cls = (cfg.get("auto_mapping") or {}).get("base_model_class")
    family = re.split(r"For|Model", str(base_cls))[0]
    if str(base_cls).endswith(("ForCausalLM", "Model")) and family != model.architecture.split("For")[0]:
        raise refuse(
            folder,
            f"auto_mapping.base_model_class is {base_cls} but the base model is {model.architecture}: "
            "use an adapter trained for this base model",
        )
    base_name, served = cfg.get("base_model_name_or_path"), model.raw.get("_name_or_path")
    if base_name and served and _loose_name(base_name) != _loose_name(served):
        log.warning(
            "adapter %s was trained on %s, serving it on %s (shapes match)", folder, base_name, served
        )


def read_adapter(
    folder: str | Path,
    model: ModelConfig,
    *,
    max_rank: int = KernelConfig.max_lora_rank,
    name: str | None = None,
    max_bytes: int | None = None,
) -> LoraWeights:
    """Read a PEFT LoRA adapter folder, validated against `model`, as fp32 CPU tensors in PEFT layout."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    cfg = C.load_config(folder)
    _check_base_model(folder, cfg, model)
    weights = folder / WEIGHTS_FILE
    if max_bytes is not None and weights.stat().st_size > max_bytes:
        raise refuse(
            folder, f"{WEIGHTS_FILE} is {weights.stat().st_size} bytes, over the {max_bytes}-byte limit"
        )
    xtargets = X.expert_targets(folder, cfg, model)
    router = {k: xtargets.pop(k) for k in [k for k in xtargets if k[1] == ROUTER_MODULE]}
    only_experts = bool(xtargets or router) and not cfg.get("target_modules")  # target_parameters only
    ranks = {} if only_experts else C.ranks(folder, cfg, model)
    vranks, vscales = ({}, {}) if only_experts else C.vocab_ranks_scales(folder, cfg, model)
    saved = C.saved_modules(folder, cfg, C.module_names(model))
    if cfg.get("ensure_weight_tying") and (saved or vranks) and model.tie_word_embeddings:
        raise refuse(
            folder,
            "ensure_weight_tying=true on a model with tied embeddings ties the adapter's embed_tokens and "
            "lm_head: not supported; train without it (PEFT then adapts the two modules independently, as "
            "LoRA-Land serves them)",
        )
    both = saved & set(vranks)
    if both:
        raise refuse(
            folder,
            f"{sorted(both)[0]} is in both target_modules and modules_to_save: PEFT trains one or the other",
        )
    # the router's LoRA is a linear's (mlp.gate.lora_A/B.weight): read beside target_modules' modules
    scales = C.scales(folder, cfg, model, ranks) | {k: s for k, (_, s) in router.items()}
    ranks |= {k: r for k, (r, _) in router.items()}
    top = max([*ranks.values(), *vranks.values(), *(r for r, _ in xtargets.values())])
    if top > max_rank:
        raise refuse(folder, f"r={top} (r/rank_pattern) exceeds max_lora_rank={max_rank}: use a smaller rank")
    use_dora = bool(cfg.get("use_dora"))
    fused = sorted({m for _, m in ranks if m in FUSED_MODULES})
    if use_dora and fused:
        raise refuse(
            folder, f"use_dora=true on the fused {fused}: DoRA on fused projections is not supported"
        )
    try:
        with safe_open(weights, framework="pt", device="cpu") as f:
            vkeys: dict[tuple[str, str], str] = {}
            tensors, magnitude = _read_tensors(folder, f, model, ranks, use_dora, vkeys)
            vocab, copies, base_layers = _read_vocab(folder, f, model, vkeys, vranks, saved)
            experts = X.read_expert_tensors(folder, f, model, xtargets, lambda k: _float_tensor(folder, f, k))
    except SafetensorError as e:
        raise refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    every = [*scales.values(), *vscales.values()]
    scale = every[0] if every else 1.0  # expert LoRA carries its scales folded into B
    folded = any(s != scale for s in every)
    if folded:  # alpha/rank patterns: fold each module's scale into its A
        tensors = {k: (a * scales[k], b) for k, (a, b) in tensors.items()}
        vocab = {k: (a * vscales[k], b) for k, (a, b) in vocab.items()}
        scale = 1.0
    padded = pad_ranks(tensors)
    patterned = folded or any(padded[k][0].shape != tensors[k][0].shape for k in tensors)
    tensors = split_fused(padded, model.linear_shapes())
    return LoraWeights(
        name=name or folder.name,
        rank=top,
        alpha=float(cfg["lora_alpha"]),
        use_rslora=bool(cfg.get("use_rslora")),
        scale=scale,
        target_modules=frozenset(m for _, m in tensors),
        layers=tuple(sorted({lay for lay, _ in [*tensors, *experts]})),
        tensors=tensors,
        source=str(folder),
        magnitude=magnitude if use_dora else None,
        patterned=patterned,
        vocab_tensors=vocab,
        vocab_copies=copies,
        base_layers=base_layers,
        expert_tensors=experts,
        alora_invocation_tokens=C.alora_tokens(folder, cfg, model),
    )


def _check_keys(folder: Path, keys: dict, model: ModelConfig, ranks: dict[tuple[int, str], int]) -> None:
    """The file's (layer, module) pairs are the config's targets, each with both lora_A and lora_B."""
    for layer, _module, _ in keys:
        if layer >= model.num_layers:
            raise refuse(
                folder,
                f"tensors for layer {layer} but the base model has {model.num_layers} layers "
                "(num_hidden_layers): this adapter is for a different base model",
            )
    present = {(lay, mod) for lay, mod, ab in keys if ab != "M"}
    for lay, mod in sorted(present):
        for ab in "AB":
            if (lay, mod, ab) not in keys:
                raise refuse(
                    folder,
                    f"layer {lay} {mod} has lora_{'BA'[ab == 'B']} but no lora_{ab}: the file is incomplete",
                )
    if present - set(ranks):
        raise refuse(
            folder,
            f"tensors for (layer, module) {sorted(present - set(ranks))[:3]} which target_modules/"
            "layers_to_transform do not name: adapter_config.json does not describe these weights",
        )
    if set(ranks) - present:
        raise refuse(
            folder,
            f"no tensors for {sorted(set(ranks) - present)[:3]} named by target_modules/target_parameters: the "
            "file is incomplete",
        )


def _read_tensors(
    folder: Path,
    f: Any,
    model: ModelConfig,
    ranks: dict[tuple[int, str], int],
    use_dora: bool,
    vocab: dict[tuple[str, str], str] | None = None,
) -> tuple[Tensors, dict]:
    """Check the file's keys against the config's targets and each tensor against the base model, then load
    the (A, B) pairs (and DoRA's magnitudes) as fp32. Shapes are checked from the header before any tensor
    data is read."""

    shapes = model.linear_shapes()
    keys = _parse_keys(folder, [k for k in f.keys() if not X.is_expert_key(k)], vocab)
    _check_keys(folder, keys, model, ranks)
    magnitude = _read_magnitudes(folder, f, keys, ranks, shapes, use_dora)
    tensors = {}
    for lay, mod in sorted(ranks):
        (n_in, n_out), r = shapes[mod], ranks[(lay, mod)]
        pair = []
        for ab, want in (("A", [r, n_in]), ("B", [n_out, r])):
            key = keys[(lay, mod, ab)]
            got = list(f.get_slice(key).get_shape())
            if got != want:
                raise refuse(
                    folder,
                    f"tensor {key} has shape {got}, expected {want} (r={r}, {mod} is "
                    f"{n_in}->{n_out}): the adapter does not fit this base model or its r is wrong",
                )
            # Same values, column-major storage: the device pools hold A^T and B^T, so installing an adapter
            # (on the engine's step thread) is then a plain copy; the transpose is paid here, off that thread,
            # fused with the finiteness check into the one copy out of the file.
            pair.append(_float_tensor(folder, f, key, column_major=True))
        tensors[(lay, mod)] = (pair[0], pair[1])
    return tensors, magnitude


def _float_tensor(folder: Path, f: Any, key: str, *, column_major: bool = False) -> Any:
    """Tensor `key` as fp32, refused unless floating point and finite; `column_major`: a 2-D tensor with the
    same values stored transposed (t().contiguous().t()). NumPy does the check and the copy: one thread, no
    thread-pool hand-offs per tensor, which cost more than the work on tensors of a few hundred KB."""
    import numpy as np
    import torch

    t = f.get_tensor(key)
    if not t.is_floating_point():
        raise refuse(folder, f"tensor {key} has dtype {t.dtype}: LoRA weights must be floating point")
    t = t.to(torch.float32)
    a = t.numpy()
    if column_major and a.ndim == 2:
        a = np.ascontiguousarray(a.T)  # the copy; the check below reads it while it is in cache
        t = torch.from_numpy(a).t()
    # NaN propagates through min and max and inf is one of them: both finite exactly when every value is.
    if a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):
        raise refuse(folder, f"tensor {key} holds NaN or inf values: the adapter is corrupt")
    return t


def _read_vocab(
    folder: Path,
    f: Any,
    model: ModelConfig,
    keys: dict[tuple[str, str], str],
    ranks: dict[str, int],
    saved: set[str],
) -> tuple[dict, dict, dict]:
    """embed_tokens/lm_head: (LoRA (A, B) per targeted module, modules_to_save copies, saved base weights), each
    checked against the config (targets, modules_to_save) and the base model's shapes, as fp32."""
    V, H = model.vocab_size, model.hidden_size
    for (mod, kind), key in keys.items():
        expected = mod in saved if kind == "copy" else mod in ranks
        if not expected:
            why = "modules_to_save" if kind == "copy" else "target_modules"
            raise refuse(
                folder,
                f"tensor {key} but {why} does not name {mod}: adapter_config.json does not describe these weights",
            )
    lora, copies, base = {}, {}, {}
    for mod, r in sorted(ranks.items()):
        want = {"A": [r, V], "B": [H, r]} if mod == "embed_tokens" else {"A": [r, H], "B": [V, r]}
        pair = []
        for ab in "AB":
            key = keys.get((mod, ab))
            if key is None:
                raise refuse(folder, f"target_modules names {mod} but {WEIGHTS_FILE} has no lora_{ab} for it")
            got = list(f.get_slice(key).get_shape())
            if got != want[ab]:
                raise refuse(
                    folder,
                    f"tensor {key} has shape {got}, expected {want[ab]} (r={r}, vocabulary {V}, hidden size "
                    f"{H}): the adapter does not fit this base model (a resized vocabulary?)",
                )
            pair.append(_float_tensor(folder, f, key))
        lora[mod] = (pair[0], pair[1])
    for mod, kind, into in [(m, "copy", copies) for m in sorted(saved)] + [
        (m, "base", base) for m in sorted(ranks)
    ]:
        key = keys.get((mod, kind))
        if key is None:
            if kind == "copy":
                raise refuse(folder, f"modules_to_save names {mod} but {WEIGHTS_FILE} has no {mod}.weight")
            continue  # saved with save_embedding_layers=False: the base weight is the served one
        got = list(f.get_slice(key).get_shape())
        if got != [V, H]:
            raise refuse(
                folder,
                f"tensor {key} has shape {got}, expected [{V}, {H}] (vocabulary, hidden size): the adapter was "
                "trained with a resized vocabulary or for another base model",
            )
        into[mod] = _float_tensor(folder, f, key)
    return lora, copies, base


def _read_magnitudes(folder: Path, f: Any, keys: dict, ranks: dict, shapes: dict, use_dora: bool) -> dict:
    """DoRA's magnitude m [out] of every target when use_dora; refuses one that is missing or stray."""
    import torch

    mags = {(lay, mod): k for (lay, mod, ab), k in keys.items() if ab == "M"}
    if not use_dora:
        if mags:
            raise refuse(
                folder,
                f"tensor {next(iter(mags.values()))} is a DoRA magnitude but adapter_config.json has no "
                "use_dora=true: the config does not describe these weights",
            )
        return {}
    missing = sorted(set(ranks) - set(mags))
    if missing or set(mags) - set(ranks):
        what = (
            f"no lora_magnitude_vector for {missing[:3]}" if missing else "magnitudes for untargeted modules"
        )
        raise refuse(folder, f"use_dora=true but the file has {what}: the file is incomplete or mislabelled")
    out = {}
    for (lay, mod), key in sorted(mags.items()):
        got, want = list(f.get_slice(key).get_shape()), [shapes[mod][1]]
        if got != want:
            raise refuse(folder, f"tensor {key} has shape {got}, expected {want} (the {mod} output size)")
        t = f.get_tensor(key)
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise refuse(
                folder, f"tensor {key} must hold finite floating-point values: the adapter is corrupt"
            )
        out[(lay, mod)] = t.to(torch.float32)
    return out


def adapter_summary(folder: str | Path) -> dict:
    """What the catalog records, without a base model: config facts, the modules and layers present in the
    weights (read from the safetensors header only), and sha256/size of the two files that define the adapter."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    cfg = C.load_config(folder)
    try:
        with safe_open(folder / WEIGHTS_FILE, framework="pt", device="cpu") as f:
            vocab: dict[tuple[str, str], str] = {}
            keys = _parse_keys(folder, [k for k in f.keys() if not X.is_expert_key(k)], vocab)
    except SafetensorError as e:
        raise refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    files = {n: sha256_file(folder / n) for n in (CONFIG_FILE, WEIGHTS_FILE)}
    return {
        "rank": int(max([cfg["r"], *(cfg.get("rank_pattern") or {}).values()])),
        "alpha": float(cfg["lora_alpha"]),
        "use_rslora": bool(cfg.get("use_rslora")),
        "use_dora": bool(cfg.get("use_dora")),
        "target_modules": sorted({m for _, m, _ in keys} | {m for m, k in vocab if k in ("A", "B")}),
        "layers": sorted({lay for lay, _, _ in keys}),
        "files": files,
        "size": sum((folder / n).stat().st_size for n in files),
        "base_model_name_or_path": cfg.get("base_model_name_or_path"),
        "peft_type": cfg.get("peft_type", "LORA"),
        "alora_invocation_tokens": cfg.get("alora_invocation_tokens"),
    }
