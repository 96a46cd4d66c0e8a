"""One request's sampling parameters, validated once where they are built (the ingress, or a caller of
LLMKernel), and carried as they are to the sampler: every field, its range, and the message naming it.

Pure Python (no torch): the ingress builds a `SamplingParams` and it crosses Ray inside the `ReplicaRequest`;
app/replica/sampling.py samples with it. What is accepted here the sampler can honour for any logits; what
needs the model (token ids inside the vocabulary, prompt + max_tokens within max_model_len) is checked by the
replica before it fetches any adapter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property

from app.errors import InvalidRequest

# The most top log probabilities one token may ask for (completions `logprobs`, chat `top_logprobs`): vLLM's
# default max_logprobs. The ingress's schema refuses more with a 400 naming the OpenAI field.
MAX_LOGPROBS = 20
# Temperatures below this are greedy (argmax): vLLM's _SAMPLING_EPS. Scaling by 1/t that small only sharpens a
# distribution that is already one-hot to float32 precision, and 1e-300 would overflow logits / t.
SAMPLING_EPS = 1e-5
# Seeds are signed 64-bit integers, the range vLLM's OpenAI server accepts (torch.iinfo(torch.long)).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0  # far beyond any useful value; bounds how far it can push a logit
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)


def _invalid(param: str, message: str) -> InvalidRequest:
    err = InvalidRequest(f"{param}: {message}")  # "field: what was wrong", the project's convention
    err.param = param
    return err


def _show(value: object) -> str:
    """A value for an error message, cut short (a 10 kB integer is not echoed back whole)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; the checks below name the field and its accepted range.

    temperature: a finite number >= 0; below SAMPLING_EPS (1e-5) the request is greedy. top_p: in (0, 1].
    top_k: -1 or 0 = off, else a positive integer (>= the vocabulary size = off). seed: an integer in
    [-2**63, 2**63 - 1] (SEED_MIN..SEED_MAX), as vLLM accepts; it seeds this request's own generator.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top log probabilities per token (0: the sampled token's alone); None = off
    prompt_logprobs: int | None = None  # the same for each prompt token (completions' echo); None = off
    presence_penalty: float = 0.0  # [-2, 2], over generated tokens: minus p once a token has appeared
    frequency_penalty: float = 0.0  # [-2, 2], over generated tokens: minus f x how often it appeared
    repetition_penalty: float = 1.0  # (0, 100], HF's: over prompt + generated tokens; 1 = off
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the most likely one (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) and stop strings are ignored until this many
    # None, "json_object", or a JSON schema as canonical JSON text (app/replica/grammar.py's format_key)
    response_format: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _invalid("max_tokens", f"must be an integer >= 1, got {_show(self.max_tokens)}")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise _invalid(
                "temperature",
                f"must be a finite number >= 0 (below {SAMPLING_EPS} means greedy), got {_show(t)}",
            )
        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise _invalid("top_p", f"must be a number in (0, 1], got {_show(p)}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _invalid("top_k", f"must be -1, 0 (off) or a positive integer, got {_show(self.top_k)}")
        s = self.seed
        if s is not None and (not _is_int(s) or not SEED_MIN <= s <= SEED_MAX):
            raise _invalid(
                "seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (signed 64-bit), got {_show(s)}"
            )
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise _invalid("stop", "stop strings must be non-empty strings")
        if not all(_is_int(x) for x in self.stop_token_ids):
            raise _invalid("stop_token_ids", "must be a list of integer token ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise _invalid(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {_show(k)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise _invalid(name, f"must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {_show(v)}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or not 0 < r <= MAX_REPETITION_PENALTY:
            raise _invalid(
                "repetition_penalty",
                f"must be a number in (0, {MAX_REPETITION_PENALTY}] (1 = off), got {_show(r)}",
            )
        m = self.min_p
        if not _is_real(m) or not math.isfinite(m) or not 0 <= m <= 1:
            raise _invalid("min_p", f"must be a number in [0, 1], got {_show(m)}")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0):
                raise _invalid("logit_bias", f"keys must be token ids (integers >= 0), got {_show(pair)}")
            b = pair[1]
            if not _is_real(b) or not math.isfinite(b) or not -MAX_BIAS <= b <= MAX_BIAS:
                raise _invalid(
                    "logit_bias", f"values must be numbers in [-{MAX_BIAS}, {MAX_BIAS}], got {_show(b)}"
                )
        n = self.min_tokens
        if not _is_int(n) or not 0 <= n <= self.max_tokens:
            raise _invalid(
                "min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {_show(n)}"
            )

        rf = self.response_format
        if rf is not None and not isinstance(rf, str):
            raise _invalid("response_format", "must be grammar.format_key's text")
        if rf is not None and self.ignore_eos:
            raise _invalid("response_format", "cannot be combined with ignore_eos (the JSON must end)")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @cached_property
    def penalized(self) -> bool:
        """Uses a penalty that needs the row's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @cached_property
    def processed(self) -> bool:
        """Its logits go through a processor (penalties, logit_bias, min_tokens) before sampling."""
        return (
            self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.response_format is not None
        )

    @classmethod
    def from_kwargs(cls, **kw) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; supported: {sorted(known)}")
        if isinstance(kw.get("stop"), str):
            kw["stop"] = (kw["stop"],)
        for key in ("stop", "stop_token_ids"):
            if kw.get(key) is None:
                kw.pop(key, None)
            else:
                kw[key] = tuple(kw[key])
        if isinstance(kw.get("logit_bias"), Mapping):  # {token id: bias}, as the OpenAI field (ids as ints)
            kw["logit_bias"] = tuple(
                (int(k) if isinstance(k, str) and k.isdecimal() else k, v)
                for k, v in kw["logit_bias"].items()
            )
        elif kw.get("logit_bias") is not None:
            kw["logit_bias"] = tuple(tuple(x) if isinstance(x, list) else x for x in kw["logit_bias"])
        kw = {k: v for k, v in kw.items() if v is not None or k == "seed"}
        return cls(**kw)
