"""A chat's prompt: the tokenizer's chat template, or a plain transcript for a tokenizer without one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any = None,
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` (OpenAI's role/content dicts); `tools` (OpenAI's tool objects) go to the
    template, which describes them to the model if it knows how."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
