"""RMSNorm in the two roundings the families use, and the MLP activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm:
    """Llama style: normalise in fp32, round to the model dtype, then multiply by w. Gemma style ("gemma"):
    the weight is applied as (1 + w), the whole in fp32, rounded at the end. The (1 + w) is formed once, here."""

    def __init__(self, weight: torch.Tensor, eps: float, style: str = "llama"):
        if style not in ("llama", "gemma"):
            raise ValueError(f"unknown norm style {style!r}")
        self.eps, self.style = eps, style
        self.weight = 1.0 + weight.float() if style == "gemma" else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # HF's ops in HF's order (composite on CPU), with fewer temporaries
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)  # HF rounds to the model dtype before the weight multiply


def act_mul_(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for the fused [T, 2 * I] projection output (gate first), reusing act(gate)'s memory."""
    g, u = gate_up.chunk(2, dim=-1)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return a.mul_(u)
