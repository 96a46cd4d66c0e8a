"""LoraWeights: one adapter's host tensors in PEFT layout, whatever produced them (a PEFT folder, a merge).

Invariant: for each module, every layer that carries it has the same rank (module_rank). A per-layer
rank_pattern, or a merge where only some terms touch a layer, is padded with zero rows of A and zero columns of
B (pad_ranks), which leaves the delta unchanged. (layer, module) pairs absent from `tensors` contribute zero.

DoRA (PEFT use_dora): `magnitude` holds the trained vector m [out] of every (layer, module). The forward needs
m / ||W + scale*B@A|| per output, which depends on the base weights W: app/replica/lora/dora.py computes it
once per adapter (`dora_scale`) before the adapter is installed.

The vocabulary-sized modules (VOCAB_MODULES: embed_tokens, lm_head) live beside `tensors`, not in it (they have
no layer): `vocab_tensors` holds LoRA on them as PEFT saves it (embed_tokens: lora_embedding_A [r, vocab],
lora_embedding_B [hidden, r]; lm_head: lora_A [r, hidden], lora_B [vocab, r]), at the adapter's `scale`;
`vocab_copies` holds full per-adapter weights [vocab, hidden] that replace the base's for this adapter's tokens
(PEFT modules_to_save); `base_layers` holds the base weights PEFT's save_embedding_layers wrote beside a LoRA on
them, until app/replica/lora/vocab.py compares them with the served base (equal: dropped; different: a copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.config.model_config import FUSED_MODULES

if TYPE_CHECKING:  # torch is imported where tensors are made, so `adapters validate/push` start fast
    import torch

VOCAB_MODULES = ("embed_tokens", "lm_head")


@dataclass
class LoraWeights:
    name: str
    rank: int  # the largest module rank
    alpha: float
    use_rslora: bool
    # alpha/r, or alpha/sqrt(r) with rslora; 1.0 when per-module scales are folded into A (merges, patterns)
    scale: float
    target_modules: frozenset[str]  # subset of LORA_MODULES actually present
    layers: tuple[int, ...]  # layers that carry tensors
    # (layer, module) -> (A [r, in], B [out, r])
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    source: str = ""
    # DoRA: (layer, module) -> magnitude m [out] as trained; None for a plain LoRA
    magnitude: dict[tuple[int, str], torch.Tensor] | None = None
    # DoRA: (layer, module) -> m / ||W + scale*B@A|| [out] (dora.py, against the base weights); None until then
    dora_scale: dict[tuple[int, str], torch.Tensor] | None = None
    # rank_pattern/alpha_pattern made module ranks or scales differ: ranks are zero-padded and each module's
    # scale is folded into its A, so the per-module A and B are not PEFT's (merges that mix A's and B's
    # entrywise refuse such adapters)
    patterned: bool = False
    # module ("embed_tokens" | "lm_head") -> (A, B) in PEFT's layout (see the module docstring)
    vocab_tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # module -> full weight [vocab, hidden] replacing the base's (modules_to_save)
    vocab_copies: dict[str, torch.Tensor] = field(default_factory=dict)
    # module -> the base weight [vocab, hidden] saved beside a LoRA on it (save_embedding_layers), unresolved
    base_layers: dict[str, torch.Tensor] = field(default_factory=dict)
    # LoRA on a mixture-of-experts layer's experts (PEFT target_parameters; app/replica/lora/experts.py):
    # (layer, "gate_up"|"down") -> (A [E, in, r], scale * B [E, r, out]), the device pool's layout, scale folded
    expert_tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # activated LoRA (PEFT alora_invocation_tokens): the delta applies from the start of the last occurrence of
    # these tokens in the prompt on (app/replica/sequence.py alora_start); None for a plain LoRA
    alora_invocation_tokens: tuple[int, ...] | None = None

    @property
    def touches_vocab(self) -> bool:
        """LoRA on embed_tokens/lm_head, or a full copy of one of them."""
        return bool(self.vocab_tensors or self.vocab_copies or self.base_layers)

    @property
    def is_dora(self) -> bool:
        return self.magnitude is not None

    def nbytes(self) -> int:
        """Bytes of the adapter's tensors on a device: A and B, and one vector per module for DoRA."""
        own = sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values()
        )
        own += sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in self.vocab_tensors.values()
        )
        own += sum(
            t.numel() * t.element_size() for t in (*self.vocab_copies.values(), *self.base_layers.values())
        )
        own += sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in self.expert_tensors.values()
        )
        return own + sum(m.numel() * m.element_size() for m in (self.magnitude or {}).values())

    def module_rank(self, module: str) -> int:
        """Rank of `module` (the same in every layer that carries it); 0 when the adapter does not target it."""
        return next((a.shape[0] for (_, m), (a, _) in self.tensors.items() if m == module), 0)

    def delta(self, layer: int, module: str) -> torch.Tensor:
        """The dense weight delta [out, in] this adapter adds to `module` of `layer`."""
        a, b = self.tensors[(layer, module)]
        return self.scale * (b @ a)


Tensors = dict[tuple[int, str], tuple["torch.Tensor", "torch.Tensor"]]


def pad_ranks(tensors: Tensors) -> Tensors:
    """Zero-pad every layer of a module to that module's largest rank (exact: the padding adds nothing). The
    padded tensors keep read_adapter's column-major layout (A [r, in] stored as [in, r], B [out, r] as
    [r, out]), so installing them into a device pool stays a plain copy."""
    width: dict[str, int] = {}
    for (_, m), (a, _) in tensors.items():
        width[m] = max(width.get(m, 0), a.shape[0])
    out = {}
    for (lay, m), (a, b) in tensors.items():
        r, w = a.shape[0], width[m]
        if w > r:
            pa = a.new_zeros(a.shape[1], w).t()
            pa[:r].copy_(a)
            pb = b.new_zeros(w, b.shape[0]).t()
            pb[:, :r].copy_(b)
            a, b = pa, pb
        out[(lay, m)] = (a, b)
    return out


def split_fused(tensors: Tensors, shapes: dict[str, tuple[int, int]]) -> Tensors:
    """A LoRA on a fused module (qkv_proj, gate_up_proj) as one LoRA per projection: the same A, B's rows of
    that projection (`shapes`: (in, out) per module). The delta x A^T B^T is the same numbers, split by rows."""
    out = {}
    for (lay, mod), (a, b) in tensors.items():
        if mod not in FUSED_MODULES:
            out[(lay, mod)] = (a, b)
            continue
        start = 0
        for part in FUSED_MODULES[mod]:
            n = shapes[part][1]
            out[(lay, part)] = (a, b[start : start + n])
            start += n
    return out
