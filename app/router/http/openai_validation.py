"""A completion or chat body validated in full: pydantic's model, then the rules it cannot express (stop
strings, log probabilities, logit_bias, response_format, min_tokens, the fields this server refuses)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from app.router.http.openai_requests import CompletionRequest, SamplingFields, clip, invalid, validate_model
from app.router.http.openai_sampling import format_key
from app.sampling_params import MAX_LOGPROBS

MAX_STOP = 16
MAX_BIAS = 100  # logit_bias values lie in [-100, 100], as OpenAI's


def validate(cls: type[BaseModel], data: dict) -> Any:
    """Validate a completion or chat with pydantic; the first problem becomes a 400 naming the field."""
    req = validate_model(cls, data)
    _check_unsupported(req)
    return req


def _check_unsupported(req: SamplingFields) -> None:
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


def _check_logprobs(req: SamplingFields) -> None:
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
