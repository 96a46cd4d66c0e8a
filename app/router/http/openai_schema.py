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
from app.protocol import ChoiceDelta, TokenLogprob
from app.sampling_params import MAX_LOGPROBS

MAX_N = 16
MAX_STOP = 16
# The longest `model` accepted: far beyond any real chain or merge (8 stages x 8 terms of short names), short
# enough that parsing and echoing it costs nothing.
MAX_MODEL_CHARS = 4096
ECHO_CHARS = 100  # how much of a caller's string an error message repeats
MAX_BIAS = 100  # logit_bias values lie in [-100, 100], as OpenAI's
MAX_SCHEMA_CHARS = 64 * 1024  # response_format's JSON schema, as canonical JSON text


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
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # vLLM's extra (HF semantics)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's extra
    min_tokens: StrictInt | None = Field(default=None, ge=0)  # vLLM's extra
    logit_bias: Any = None  # {"token id": bias in [-100, 100]}; checked in _check_logit_bias
    response_format: Any = None  # {"type": "text" | "json_object" | "json_schema", ...}: format_key


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: Any = None  # an integer in [0, MAX_LOGPROBS]: the top log probabilities per token
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
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0)


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


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict:
    """The JSON object in a request body, or InvalidRequest saying why not (not JSON, nested deeper than the
    parser's recursion limit, or a string holding a lone UTF-16 surrogate, which no tokenizer can encode)."""
    try:
        data = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid("body", f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise invalid("body", "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise invalid("body", "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise invalid(
            "body",
            "a string holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair): send valid Unicode",
        )
    return data


def _has_lone_surrogate(data: object) -> bool:
    """Whether any string (key or value) in parsed JSON holds a surrogate code point; json.loads joins valid
    escaped pairs into one character, so only lone halves are left."""
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            try:
                x.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return False


def validate(cls: type[BaseModel], data: dict) -> Any:
    """Validate a completion or chat with pydantic; the first problem becomes a 400 naming the field."""
    req = validate_model(cls, data)
    _check_unsupported(req)
    return req


def validate_model(cls: type[BaseModel], data: dict) -> Any:
    """`data` as a `cls`, or a 400 naming the first field pydantic found at fault."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = _field(tuple(first.get("loc", ())))
        raise invalid(param, _UNION_HINTS.get(param, first.get("msg", "invalid value"))) from None


def _check_unsupported(req: _Sampling) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise invalid("stop", f"give at most {MAX_STOP} non-empty stop strings")
    _check_logprobs(req)
    _check_logit_bias(req.logit_bias)
    if format_key(req.response_format) is not None and req.ignore_eos:
        raise invalid("response_format", "cannot be combined with ignore_eos (the JSON must end)")
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise invalid("min_tokens", f"must be at most max_tokens ({max_tokens}), got {req.min_tokens}")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise invalid("suffix", "suffix is not supported by this server; omit the field")
        if req.best_of not in (None, req.n):
            raise invalid("best_of", "best_of must equal n (or be omitted)")
        if isinstance(req.prompt, list) and not req.prompt:
            raise invalid("prompt", "give at least one prompt")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "only allowed when stream is true")


def _check_logprobs(req: _Sampling) -> None:
    top = f"an integer in [0, {MAX_LOGPROBS}] (this server's max_logprobs, as vLLM's default)"
    if isinstance(req, CompletionRequest):
        k = req.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise invalid("logprobs", f"must be {top}, got {clip(repr(k))}")
        return
    if req.top_logprobs is not None:
        if req.top_logprobs > MAX_LOGPROBS:
            raise invalid("top_logprobs", f"must be {top}, got {req.top_logprobs}")
        if not req.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")


def _check_logit_bias(bias: Any) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise invalid("logit_bias", 'must be an object mapping token ids to biases, e.g. {"50256": -100}')
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise invalid("logit_bias", f"keys must be token ids (non-negative integers), got {clip(key)!r}")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -MAX_BIAS <= value <= MAX_BIAS  # NaN fails too
        ):
            raise invalid(
                "logit_bias", f"values must be numbers in [-100, 100], got {clip(repr(value))} for {key}"
            )


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
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens"):
        value = getattr(req, key)
        if value is not None:
            out[key] = value
    if (key := format_key(req.response_format)) is not None:
        out["response_format"] = key
    if req.logit_bias:
        out["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            out["logprobs"] = req.logprobs
            if req.echo:  # vLLM's rule: echo with logprobs=k lists the prompt tokens' too, with their top k
                out["prompt_logprobs"] = req.logprobs
    elif req.logprobs:
        out["logprobs"] = req.top_logprobs or 0
    return out


def format_key(response_format: Any) -> str | None:
    """The sampler's key for an OpenAI `response_format` ({"type": "text" | "json_object" | "json_schema"}),
    or a 400 naming the problem (the schema itself is compiled later, by `Grammars.compile`)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise invalid(
            "response_format", 'must be an object with a "type": "text", "json_object" or "json_schema"'
        )
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object"
    if kind != "json_schema":
        raise invalid(
            "response_format", f'unknown type {kind[:40]!r}; use "text", "json_object" or "json_schema"'
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise invalid(
            "response_format", 'json_schema must be an object {"name", "schema", "strict"} with a string name'
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("response_format", "json_schema.schema must be a JSON schema (an object)")
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise invalid("response_format", f"the schema is {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
    return text


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
