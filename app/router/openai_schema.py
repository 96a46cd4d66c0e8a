"""OpenAI request validation, response shapes and server-sent-event framing (pure: no Ray, no FastAPI)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from app.errors import InvalidRequest
from app.protocol import ChoiceDelta

MAX_N = 16
MAX_STOP = 16
# The longest `model` accepted: far beyond any real chain or merge (8 stages x 8 terms of short names), short
# enough that parsing and echoing it costs nothing.
MAX_MODEL_CHARS = 4096
ECHO_CHARS = 100  # how much of a caller's string an error message repeats


class _Sampling(BaseModel):
    # Unknown fields are accepted and ignored, as vLLM does: clients send extras such as `user`.
    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=MAX_MODEL_CHARS)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    # OpenAI fields this server does not implement: accepted only at their neutral values.
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)


# pydantic reports only one branch of a union; say what the field accepts instead.
_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "must be a string or a list of strings",
}


def _field(loc: tuple) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in ("str", "list[str]", "list[int]", "list[list[int]]", "function-after") or "[" in str(p):
            continue  # pydantic's union-branch labels are noise for a caller
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or "body"


def invalid(param: str, message: str) -> InvalidRequest:
    err = InvalidRequest(f"{param}: {message}")
    err.param = param
    return err


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` cut to `limit` characters and an ellipsis: what a message may echo of a caller's string."""
    return text if len(text) <= limit else text[:limit] + "…"


_LONG = ECHO_CHARS + 1
_LONG_QUOTED = re.compile(rf"'[^']{{{_LONG},}}'|\"[^\"]{{{_LONG},}}\"")


def clipped(err: InvalidRequest) -> InvalidRequest:
    """`err` with every quoted string longer than ECHO_CHARS in its message clipped (a huge `model` was echoed
    whole, twice); the same class and `param`."""
    message = _LONG_QUOTED.sub(lambda m: repr(clip(m.group(0)[1:-1])), str(err))
    if message == str(err):
        return err
    out = type(err)(message)
    out.__dict__.update(err.__dict__)
    return out


def parse_body(raw: bytes) -> dict:
    """The JSON object in a request body, or InvalidRequest saying why not."""
    try:
        data = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid("body", f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise invalid("body", "the request body must be a JSON object")
    return data


def validate(cls: type[BaseModel], data: dict) -> Any:
    """Validate with pydantic; the first problem becomes a 400 naming the field."""
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = _field(tuple(first.get("loc", ())))
        raise invalid(param, _UNION_HINTS.get(param, first.get("msg", "invalid value"))) from None
    _check_unsupported(req)
    return req


def _check_unsupported(req: _Sampling) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise invalid("stop", f"give at most {MAX_STOP} non-empty stop strings")
    if req.logprobs not in (None, False, 0):
        raise invalid("logprobs", "log probabilities are not supported by this server; omit the field")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise invalid(name, "penalties are not supported by this server; omit the field or use 0")
    if req.logit_bias:
        raise invalid("logit_bias", "logit_bias is not supported by this server; omit the field")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise invalid("echo", "echo is not supported by this server; omit the field")
        if req.suffix:
            raise invalid("suffix", "suffix is not supported by this server; omit the field")
        if req.best_of not in (None, req.n):
            raise invalid("best_of", "best_of must equal n (or be omitted)")
        if isinstance(req.prompt, list) and not req.prompt:
            raise invalid("prompt", "give at least one prompt")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "only allowed when stream is true")


def sampling_of(req: _Sampling) -> dict[str, Any]:
    """The kernel's sampling keywords (only those the caller set, so the kernel's defaults apply)."""
    out: dict[str, Any] = {}
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "seed", "stop", "stop_token_ids"):
        value = getattr(req, key)
        if value is not None:
            out[key] = value
    if req.top_k is not None and req.top_k > 0:  # vLLM's -1 / 0 mean "no top-k"
        out["top_k"] = req.top_k
    if req.ignore_eos:
        out["ignore_eos"] = True
    return out


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


def messages_of(req: ChatRequest) -> list[dict[str, str]]:
    """Messages as plain {"role", "content"} dicts; content parts other than text are refused."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None or isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content or ""})
            continue
        texts = []
        for j, part in enumerate(m.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}]", "only text parts are supported")
            texts.append(part["text"])
        out.append({"role": m.role, "content": "".join(texts)})
    return out


# ---- responses -------------------------------------------------------------------------------------------


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
                "logprobs": None,
                "finish_reason": finish_reason(c.finish_reason),
            }
            for c in choices
        ]
        obj = "chat.completion"
    else:
        shaped = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None,
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
) -> dict:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


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
