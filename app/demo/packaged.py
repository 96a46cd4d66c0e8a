"""Whether a real demo model packaged on PyPI (app/replica/gguf_import.py's PACKAGED) can be served here."""

from __future__ import annotations

import importlib.util


def why_missing(short_name: str, label: str, install_hint: str) -> str | None:
    """None when the model's GGUF and the `gguf` reader are installed; else why not (for skips and messages)."""
    from app.replica.gguf_import import packaged_files

    try:
        packaged_files(short_name)
    except ValueError as e:
        return f"{label} is not installed ({e}); {install_hint}"
    if importlib.util.find_spec("gguf") is None:
        return f"the package gguf (transformers' GGUF reader) is not installed; {install_hint}"
    return None
