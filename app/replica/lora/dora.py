"""DoRA adapters (PEFT use_dora=True) on the grouped LoRA path: the per-output factor, computed once at load.

PEFT's DoRA linear at eval (peft/tuners/lora/dora.py, DoraLinearLayer; dropout is the identity at eval, and
PEFT passes the base output in), for a base linear y = x W^T + bias and LoRA scale s:
    n      = ||W + s * B @ A|| over the input axis: one norm per output row of W (detached)
    f      = m / n                                            (m: the trained lora_magnitude_vector)
    result = base + (f - 1) * (base - bias) + f * s * (x A^T) B^T
           = f * (x W^T + s * x A^T B^T) + bias               (PEFT subtracts the bias first: not rescaled)
W is fixed, so f is a constant vector per (layer, module) of each adapter: `dora_scales` computes it once,
off the step loop, from the base weights read by `BaseWeights`. On the device, f is folded into B
(B' = s * f * B, per output column) and the kernels rescale the base output of the adapter's rows by f
(kernels/loraland_kernels/lora.py expand's base_scale/base_bias): resident memory is one f vector per module, nothing per token.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import torch

from app.config.model_config import ATTN_MODULES
from app.errors import InvalidAdapter
from app.replica.lora.weights import LoraWeights


def _module_prefix(layer: int, module: str) -> str:
    block = "self_attn" if module in ATTN_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


class BaseWeights:
    """The base model's linear weights and biases, read from its safetensors files (a single file or a sharded
    index) as fp32, one module at a time: the served Model's own tensors may be in another dtype or layout
    (fused, prepacked), the checkpoint is the weights PEFT trained against. Thread-safe (loads run on the
    caller's thread and the manager's loader thread)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text())["weight_map"]
            self._files = {k: self.folder / v for k, v in wm.items()}
        else:
            from safetensors import safe_open

            self._files = {}
            for f in sorted(self.folder.glob("*.safetensors")):
                with safe_open(f, "pt") as fh:
                    self._files.update({k: f for k in fh.keys()})
        self._biases: dict[tuple[int, str], torch.Tensor | None] = {}
        self._lock = threading.Lock()

    def _get(self, name: str) -> torch.Tensor | None:
        from safetensors import safe_open

        path = self._files.get(name)
        if path is None:
            return None
        with safe_open(path, "pt") as fh:
            return fh.get_tensor(name).to(torch.float32)

    def weight(self, layer: int, module: str) -> torch.Tensor:
        """W [out, in] of `module` in `layer`, fp32."""
        name = _module_prefix(layer, module) + ".weight"
        w = self._get(name)
        if w is None:
            raise InvalidAdapter(
                f"the base model in {self.folder} has no {name}: DoRA needs the base weights of every target"
            )
        return w

    def vocab_weight(self, module: str) -> torch.Tensor:
        """The [vocab, hidden] weight of embed_tokens or lm_head (a tied lm_head is the embedding), fp32."""
        w = self._get("lm_head.weight") if module == "lm_head" else None
        w = self._get("model.embed_tokens.weight") if w is None else w
        if w is None:
            raise InvalidAdapter(f"the base model in {self.folder} has no model.embed_tokens.weight")
        return w

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        """bias [out] of `module` in `layer` (fp32), None when the base linear has none; cached (small)."""
        key = (layer, module)
        with self._lock:
            if key in self._biases:
                return self._biases[key]
        b = self._get(_module_prefix(layer, module) + ".bias")
        with self._lock:
            self._biases[key] = b
        return b


def dora_scales(lw: LoraWeights, base: BaseWeights) -> dict[tuple[int, str], torch.Tensor]:
    """f = m / ||W + delta|| per output of every (layer, module) of the DoRA adapter `lw` (PEFT's norm: over
    the input axis of W + scale * B @ A, in fp32)."""
    out = {}
    for key, (a, b) in sorted(lw.tensors.items()):
        w = base.weight(*key)
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise InvalidAdapter(
                f"adapter {lw.name!r}: base weight of layer {key[0]} {key[1]} is {tuple(w.shape)}, the adapter "
                f"expects {(b.shape[0], a.shape[1])}: it was trained for another base model"
            )
        norm = torch.linalg.norm(w + lw.scale * (b @ a), dim=1)
        if not bool((norm > 0).all()):
            raise InvalidAdapter(
                f"adapter {lw.name!r}: layer {key[0]} {key[1]} has a zero row in W + delta, so DoRA's "
                "m / ||W + delta|| is undefined there"
            )
        out[key] = lw.magnitude[key] / norm
        base.bias(*key)  # cached now, so the engine thread's pool creation never reads the disk
    return out


def with_dora_scales(lw: LoraWeights, base: BaseWeights | None) -> LoraWeights:
    """`lw` ready for the device pools: a DoRA adapter gains its dora_scale (a new LoraWeights sharing the
    tensors); a plain LoRA, or one already prepared, is returned as is."""
    if not lw.is_dora or lw.dora_scale is not None:
        return lw
    if base is None:
        raise InvalidAdapter(
            f"adapter {lw.name!r} is a DoRA adapter (use_dora): serving it needs the base model's weights, "
            "and this adapter manager was built without base_weights"
        )
    return dataclasses.replace(lw, dora_scale=dora_scales(lw, base))
