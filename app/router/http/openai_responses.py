"""OpenAI response shapes: whole completions, streamed chunks, log probabilities, usage, and server-sent-event
framing (pure: no Ray, no FastAPI)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from app.protocol import ChoiceDelta, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(rid: str, model: str, choices: Sequence[ChoiceDelta], use: dict, chat: bool) -> dict:
    """`choices`: each choice's whole output (its deltas merged), in index order."""
    if chat:
        shaped = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": choice_logprobs(c.logprobs, chat),
                "finish_reason": finish_reason(c.finish_reason),
            }
            for c in choices
        ]
        obj = "chat.completion"
    else:
        shaped = [
            {
                "index": c.index,
                "text": (c.prompt_text or "") + c.text,  # prompt_text: echo's
                "logprobs": choice_logprobs(_with_prompt(c), chat),
                "finish_reason": finish_reason(c.finish_reason),
            }
            for c in choices
        ]
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": shaped,
        "usage": use,
    }


def stream_chunk(
    rid: str,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    chat: bool,
    first: bool = False,
    logprobs: dict | None = None,
) -> dict:
    """One streamed choice; `logprobs`: its tokens' log probabilities, shaped by choice_logprobs."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def _with_prompt(c: ChoiceDelta) -> list[TokenLogprob] | None:
    """A completion choice's (or chunk's) log probabilities, its prompt's first when echo asked for them."""
    if c.logprobs is None or not c.prompt_logprobs:
        return c.logprobs
    return [*c.prompt_logprobs, *c.logprobs]


def chunk_of(c: ChoiceDelta, chat: bool) -> tuple[str, list[TokenLogprob] | None]:
    """A streamed delta's text and log probabilities, echo's prompt first (completions only)."""
    if chat:
        return c.text, c.logprobs
    return (c.prompt_text or "") + c.text, _with_prompt(c)


def choice_logprobs(entries: Sequence[TokenLogprob] | None, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's `logprobs` of a choice (or of a streamed chunk of it), None when the request did not ask.

    Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] x k]}].
    Completions (vLLM's shape): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob} of the top k and
    the sampled token], "text_offset"}; `offset` is where the first token starts in the choice's text (a stream
    passes the length of the tokens sent before). Every sampled token is listed, a stop token too; with echo
    the prompt's tokens come first, the first of them with logprob and top_logprobs null (vLLM's shape)."""
    if entries is None:
        return None
    if chat:
        return {
            "content": [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": list(e.token_bytes),
                    "top_logprobs": [
                        {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in e.top
                    ],
                }
                for e in entries
            ]
        }
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        if e.logprob is None:  # a prompt's first token (echo): nothing predicts it
            top_logprobs.append(None)
        else:
            top: dict[str, float] = {}
            for t in (*e.top, e):  # keyed by text: of tokens with the same text, the likeliest one shows
                top.setdefault(t.token, t.logprob)
            top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(e.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def usage_chunk(rid: str, model: str, use: dict, chat: bool) -> dict:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": use,
    }


def sse(obj: dict | str) -> bytes:
    """One server-sent event; the literal "[DONE]" ends an OpenAI stream."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


def finish_reason(kernel_reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; the kernel's "abort" surfaces as an error instead."""
    return kernel_reason if kernel_reason in (None, "stop", "length") else "stop"
