"""Reading a model folder's safetensors weights by name (single file or a sharded index), at the serving dtype
and device. Pickled weights (.bin) are refused."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> file, from a single safetensors file or a sharded index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in wm.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = [p.name for p in folder.glob("*.bin")]
        hint = f" (found {bins}: pickled weights are refused, convert them to safetensors)" if bins else ""
        raise ValueError(f"{folder} has no *.safetensors weights{hint}")
    out = {}
    for f in files:
        with safe_open(f, "pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


class WeightReader:
    """`get(name)` -> the tensor at the serving dtype and device; a missing required weight names itself."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: torch.device):
        self.folder, self.dtype, self.device = Path(folder), dtype, device
        self.files = weight_files(self.folder)
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, required: bool = True) -> torch.Tensor | None:
        if name not in self.files:
            if required:
                raise ValueError(f"{self.folder}: weight {name!r} is missing from the safetensors files")
            return None
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, "pt")
        return self._handles[f].get_tensor(name).to(device=self.device, dtype=self.dtype)

    def close(self) -> None:
        self._handles.clear()
