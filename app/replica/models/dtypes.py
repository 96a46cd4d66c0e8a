"""The serving dtype: asked for by name, or picked for the device ("auto")."""

from __future__ import annotations

from pathlib import Path

import torch

from app.config.model_config import ModelConfig

_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _NAMES:
        return _NAMES[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype {dtype!r} is not supported: use 'auto', 'float32', 'bfloat16' or 'float16'")
    if device.type == "cuda":
        return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls only beat fp32 on CPUs with AVX512-BF16 or AMX; elsewhere they are ~4x slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("\nflags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
