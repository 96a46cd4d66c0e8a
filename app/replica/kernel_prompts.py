"""LLMKernel's prompts (mixed into LLMKernel, app/replica/kernel.py): text or token ids to the ids a request
runs on, within what the model can hold, and chats through the tokenizer's template."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from app.errors import InvalidRequest
from app.replica.chat import render_chat
from app.replica.engine import Engine
from app.replica.memory import release_free_memory
from app.sampling_params import SamplingParams

Prompt = str | list[int]
LONG_PROMPT_CHARS = 4096  # generate() tokenizes prompts longer than this off the event loop
TRIM_AFTER_CHARS = 1 << 18  # after tokenizing a longer prompt, hand freed heap pages back (memory.py)


class KernelPrompts:
    """Mixed into LLMKernel, whose constructor sets these attributes."""

    tokenizer: Any
    engine: Engine
    max_model_len: int
    max_prompt_chars: int  # no token spells more characters than the longest vocabulary entry

    def tokenize(self, prompt: Prompt, *, special: bool = True) -> list[int]:
        """A prompt's token ids (a list of ids is checked and kept); a string too long to fit is refused before
        tokenizing it. A raw text gets the tokenizer's own special tokens, as transformers' `encode` adds them
        (Gemma's BOS; SmolLM2 adds none); `special=False` for a rendered chat, whose template writes them."""
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise InvalidRequest(
                    f"the prompt has {len(prompt)} characters: more than max_model_len ({self.max_model_len} "
                    f"tokens) can hold with this tokenizer (at most {self.max_prompt_chars} characters); "
                    "shorten it"
                )
            ids = encode_prompt(self.tokenizer, prompt, special)
            if len(prompt) > TRIM_AFTER_CHARS:
                release_free_memory()
            return ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidRequest("each prompt must be a string or a list of token ids")

    async def tokenize_async(self, prompt: Prompt, *, special: bool = True) -> list[int]:
        """`tokenize` without stalling the caller's event loop on a long prompt (the fast tokenizer releases the
        GIL); a short one costs less than the thread hop."""
        if isinstance(prompt, str) and len(prompt) > LONG_PROMPT_CHARS:
            return await asyncio.to_thread(functools.partial(self.tokenize, prompt, special=special))
        return self.tokenize(prompt, special=special)

    def render_chat(
        self,
        messages: Seq[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Seq[Mapping[str, Any]] | None = None,
    ) -> str:
        """A chat's prompt text, through the tokenizer's chat template (given `tools`, OpenAI's tool objects)."""
        return render_chat(
            list(messages), self.tokenizer, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if this prompt with these parameters cannot run on this model (vocabulary,
        max_model_len, KV capacity): what a caller checks before fetching adapters for it."""
        self.engine.check(prompt_ids, params)


def encode_prompt(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    """`text`'s ids as transformers' tokenizer gives them with its default special tokens (`special`), except
    that a text which already starts with the BOS token's text (a chat template rendered by the caller) gets no
    second one."""
    bos = getattr(tokenizer, "bos_token", None)
    if special and isinstance(bos, str) and bos and text.startswith(bos):
        special = False
    return tokenizer.encode(text, add_special_tokens=special)
