"""One pool's tensors for one fused linear of one layer (app/replica/lora/pools.py holds the pools): A for
the whole group, [cap, in, sum of ranks] (q/k/v and gate/up A's side by side, so one shrink serves all three),
and one B [cap, r, out] per module with alpha/r folded in; in a DoRA pool also each module's factor f and the
base linear's bias.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
    "router": ("gate",),  # a mixture-of-experts layer's router (app/replica/models/moe.py MoE.route)
}
MODULE_GROUP = {m: g for g, ms in GROUPS.items() for m in ms}


class ModuleB(NamedTuple):
    """One module of a fused linear in a pool: where it sits in the shrink and in the fused output, and its B."""

    module: str
    r0: int  # its rank columns r0:r1 of the group's A (and of the shrink's z)
    r1: int
    c0: int  # its columns c0:c1 of the fused output (q/k/v side by side)
    c1: int
    B: torch.Tensor  # [cap, r1 - r0, c1 - c0], scale (and DoRA's f) folded in
    base_scale: torch.Tensor | None = None  # DoRA pools: f [cap, c1 - c0], fp32
    base_bias: torch.Tensor | None = (
        None  # DoRA pools: the base linear's bias [c1 - c0], fp32 (None: no bias)
    )


class GroupWeights:
    """One pool's tensors for one fused linear of one layer."""

    def __init__(
        self,
        cap: int,
        d_in: int,
        modules: list[tuple[str, int, int, int]],
        dtype,
        device,
        biases: dict[str, torch.Tensor | None] | None = None,
    ):
        # modules: (module, rank, out_features, column offset in the fused output), in fused-output order;
        # biases: DoRA pools only, module -> the base linear's bias (or None)
        self.rank_total = sum(r for _, r, _, _ in modules)
        self.A = torch.empty(cap, d_in, self.rank_total, dtype=dtype, device=device)
        self.parts: list[ModuleB] = []
        r0 = 0
        for module, r, out, col in modules:
            B = torch.empty(cap, r, out, dtype=dtype, device=device)
            f = bias = None
            if biases is not None:  # fp32 whatever the pool dtype: f is ~1 and bf16 would round it by 0.4%
                f = torch.empty(cap, out, dtype=torch.float32, device=device)
                b = biases.get(module)
                bias = None if b is None else b.to(device=device, dtype=torch.float32)
            self.parts.append(ModuleB(module, r0, r0 + r, col, col + out, B, f, bias))
            r0 += r

    def grow(self, cap: int) -> None:
        def bigger(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            n = torch.empty(cap, *t.shape[1:], dtype=t.dtype, device=t.device)
            n[: t.shape[0]] = t
            return n

        self.A = bigger(self.A)
        self.parts = [p._replace(B=bigger(p.B), base_scale=bigger(p.base_scale)) for p in self.parts]

    def nbytes_per_slot(self) -> int:
        per = self.A[0].numel() * self.A.element_size()
        for p in self.parts:
            per += p.B[0].numel() * p.B.element_size()
            if p.base_scale is not None:
                per += p.base_scale[0].numel() * p.base_scale.element_size()
        return per
