"""RMSNorm in the two roundings the families use, and the MLP activations: the fused CPU ops where they are
built (loraland_kernels.fused), the same math in torch ops otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraland_kernels import fused


class RMSNorm:
    """Llama style: normalise in fp32, round to the model dtype, then multiply by w. Gemma style ("gemma"):
    the weight is applied as (1 + w), the whole in fp32, rounded at the end. The (1 + w) is formed once, here."""

    def __init__(self, weight: torch.Tensor, eps: float, style: str = "llama"):
        if style not in ("llama", "gemma"):
            raise ValueError(f"unknown norm style {style!r}")
        self.eps, self.style = eps, style
        self.weight = 1.0 + weight.float() if style == "gemma" else weight
        self.fused = fused.enabled(weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and x.stride(-1) == 1:
            return fused.rms_norm(x, self.weight, self.eps, self.style == "gemma")
        return self._torch(x)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """h += delta (the residual stream, in place), then the norm of h; one pass where fused."""
        if delta is None:
            return self(h)
        if self.fused and delta.stride(-1) == 1 and h.stride(-1) == 1:
            return fused.rms_norm(delta, self.weight, self.eps, self.style == "gemma", residual=h)
        h.add_(delta)
        return self._torch(h)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # HF's ops in HF's order (composite on CPU), with fewer temporaries
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)  # HF rounds to the model dtype before the weight multiply


def act_mul_(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for the fused [T, 2 * I] projection output (gate first): SiLU in one fused pass on CPU,
    else reusing act(gate)'s memory."""
    if act == "silu" and gate_up.dim() == 2 and gate_up.stride(-1) == 1 and fused.enabled(gate_up.device):
        return fused.silu_mul(gate_up)
    g, u = gate_up.chunk(2, dim=-1)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return a.mul_(u)
