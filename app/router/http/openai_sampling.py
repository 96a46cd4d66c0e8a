"""OpenAI's sampling fields as the kernel's sampling keywords."""

from __future__ import annotations

import json
from typing import Any

from app.router.http.openai_requests import CompletionRequest, SamplingFields, invalid

MAX_SCHEMA_CHARS = 64 * 1024  # response_format's JSON schema, as canonical JSON text


def sampling_of(req: SamplingFields) -> dict[str, Any]:
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
