"""A chat's prompt: the tokenizer's chat template, or a plain transcript for a tokenizer without one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(
    messages: Sequence[Mapping[str, str]], tokenizer: Any = None, *, add_generation_prompt: bool = True
) -> str:
    """The prompt text for `messages` (OpenAI's role/content dicts)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
