"""OpenAI request bodies: the JSON object in a body, the completion and chat models pydantic checks, and the
400s naming the field at fault (pure: no Ray, no FastAPI). The rules pydantic cannot express are in
openai_validation.py; the sampling keywords a request asks for, in openai_sampling.py."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from app.errors import InvalidRequest

MAX_N = 16
# The longest `model` accepted: far beyond any real chain or merge (8 stages x 8 terms of short names), short
# enough that parsing and echoing it costs nothing.
MAX_MODEL_CHARS = 4096
ECHO_CHARS = 100  # how much of a caller's string an error message repeats


class SamplingFields(BaseModel):
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


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: Any = None  # an integer in [0, MAX_LOGPROBS]: the top log probabilities per token
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: Any = None  # an assistant's calls; tool_calls.py checks them
    tool_call_id: Any = None  # a tool message's: the call it answers
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0)
    tools: Any = None  # [{"type": "function", "function": {...}}]: checked in tool_calls.py
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: StrictBool | None = None


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


def validate_model(cls: type[BaseModel], data: dict) -> Any:
    """`data` as a `cls`, or a 400 naming the first field pydantic found at fault."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = _field(tuple(first.get("loc", ())))
        raise invalid(param, _UNION_HINTS.get(param, first.get("msg", "invalid value"))) from None


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
