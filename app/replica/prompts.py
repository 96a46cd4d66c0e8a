"""A request's prompts, checked against the model before anything is fetched for it, and vLLM's
/tokenize and /detokenize answered with the replica's tokenizer."""

from __future__ import annotations

import asyncio

from app.errors import InvalidRequest
from app.protocol import ReplicaRequest, TokenizeCall, TokenizeReply
from app.replica.fan_in import PreparedPrompt
from app.replica.kernel import LLMKernel


async def prepare_prompts(kernel: LLMKernel, request: ReplicaRequest) -> list[PreparedPrompt]:
    """Every prompt of `request` tokenized and checked with its sampling (vocabulary, max_model_len, KV
    capacity), and its response_format compiled (a bad schema is a 400): all before any adapter is fetched,
    so a request that cannot run pulls nothing."""
    chat = request.messages is not None
    if chat:
        tools = [t.to_openai() for t in request.tools]
        texts: list[str | tuple[int, ...]] = [kernel.render_chat(request.messages, tools=tools)]
    else:
        texts = list(request.prompts)
    prompts = []
    for p in texts:  # a rendered chat's special tokens are its template's: none added
        ids = await kernel.tokenize_async(p if isinstance(p, str) else list(p), special=not chat)
        kernel.check(ids, request.sampling)
        prompts.append(PreparedPrompt(ids, p if isinstance(p, str) else None))
    if request.sampling.response_format is not None:  # cached: the kernel's own compile finds it
        await asyncio.to_thread(kernel.grammars.compile, request.sampling.response_format)
    return prompts


def tokenize_call(kernel: LLMKernel, call: TokenizeCall) -> TokenizeReply:
    """vLLM's /tokenize (a text or a chat) or /detokenize (token ids)."""
    tok, limit = kernel.tokenizer, kernel.max_model_len
    if call.tokens is not None:
        vocab = len(tok)
        bad = next((t for t in call.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            err = InvalidRequest(f"tokens: {bad} is not a token id of this model (0 <= id < {vocab})")
            err.param = "tokens"
            raise err
        return TokenizeReply(text=tok.decode(list(call.tokens)), max_model_len=limit)
    if call.messages is not None:
        text = kernel.render_chat(call.messages, add_generation_prompt=call.add_generation_prompt)
    else:
        text = call.text or ""
    if len(text) > kernel.max_prompt_chars:
        err = InvalidRequest(
            f"prompt: {len(text)} characters, more than max_model_len ({limit} tokens) can hold"
        )
        err.param = "prompt"
        raise err
    ids = tok.encode(text, add_special_tokens=call.add_special_tokens)
    return TokenizeReply(tokens=tuple(ids), max_model_len=limit)
