"""embed_tokens/lm_head weights an adapter carries whole, resolved once per load against the base model.

PEFT saves two kinds of full [vocab, hidden] weights with an adapter (peft_format.py reads them):
- modules_to_save: the adapter's own copy of the module, which replaces the base's for its tokens;
- with LoRA on embed_tokens/lm_head, the base weight itself (`<module>.base_layer.weight`, PEFT's
  save_embedding_layers, on by default then). PEFT loads it into the base model: when it equals the served
  base weight it changes nothing and is dropped here; when it differs (the embedding was trained or replaced)
  it is, for this adapter, a copy like modules_to_save's. With tied embeddings (tie_word_embeddings) PEFT loads
  it into the one parameter embed_tokens and lm_head share, so it becomes the copy of both (a module's own
  modules_to_save copy, loaded into PEFT's separate wrapper, still wins for that module).
Copies are resident per adapter (pools.py holds one per slot) and counted in its bytes; an adapter whose copies
exceed KernelConfig.max_saved_module_bytes (at the served dtype) is refused, naming the limit and the option.
"""

from __future__ import annotations

import dataclasses

import torch

from app.errors import InvalidAdapter
from app.replica.lora.dora import BaseWeights
from app.replica.lora.weights import LoraWeights

OPTION = "max_saved_module_bytes"


_OTHER = {"embed_tokens": "lm_head", "lm_head": "embed_tokens"}


def with_vocab_copies(
    lw: LoraWeights,
    base: BaseWeights | None,
    *,
    max_bytes: int | None,
    dtype: torch.dtype,
    tied: bool = False,
) -> LoraWeights:
    """`lw` with its saved base weights resolved (dropped when equal to the base's, else kept as copies) and its
    copies checked against `max_bytes` (None: no limit). Returns `lw` itself when it holds neither."""
    if not lw.base_layers and not lw.vocab_copies:
        return lw
    copies = dict(lw.vocab_copies)
    for module, saved in sorted(lw.base_layers.items()):
        if base is not None:  # without the base, serving it as a copy is what PEFT's load amounts to
            served = base.vocab_weight(module)
            if tuple(served.shape) == tuple(saved.shape) and torch.equal(served, saved):
                continue
        copies.setdefault(module, saved)
        if tied:
            copies.setdefault(_OTHER[module], saved)
    nbytes = sum(t.numel() for t in copies.values()) * torch.empty(0, dtype=dtype).element_size()
    if max_bytes is not None and nbytes > max_bytes:
        what = ", ".join(
            f"{m} ({'modules_to_save' if m in lw.vocab_copies else 'a base_layer weight that differs from the base'})"
            for m in sorted(copies)
        )
        raise InvalidAdapter(
            f"adapter {lw.name!r} carries full copies of {what}: {nbytes} bytes at {str(dtype).removeprefix('torch.')}"
            f", over the {max_bytes}-byte limit ({OPTION}); raise KernelConfig.{OPTION} to serve it"
        )
    return dataclasses.replace(lw, vocab_copies=copies, base_layers={})
