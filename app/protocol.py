"""What crosses Ray between the ingress and a replica: small, typed, picklable dataclasses.

The ingress sends one `ReplicaRequest`; the replica streams back a `ReplicaHello` (which replica took it),
then `ChoiceDelta`s (new text per choice, possibly several piled-up deltas coalesced into one), and ends the
stream, or sends one `Failure` and ends. New output of several choices found at one wake-up (n > 1, several
prompts: each engine step has a token for every choice) travels as one `DeltaBatch`: every item is a Ray message
and an actor hop, so a request costs one message per step, not one per choice. A `Failure` carries the error's class name, message and whether a
retry may succeed; only the ingress maps it to an HTTP status (app/router/http/errors.py). The one rule that
turns a failure back into an exception is `Failure.to_exception`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app import errors
from app.adapter_record import AdapterRecord
from app.names import ModelSpec
from app.sampling_params import SamplingParams

# The error classes a Failure may name (a subclass travels as the first of these it derives from); the base
# class keeps its message (HTTP 500), anything that is not a LoraLandError travels as "internal", message hidden.
_KNOWN: dict[str, type[errors.LoraLandError]] = {
    cls.__name__: cls
    for cls in (
        errors.InvalidRequest,
        errors.UnknownAdapter,
        errors.InvalidAdapter,
        errors.AdapterUnavailable,
        errors.QueueFull,
        errors.CatalogUnavailable,
        errors.LoraLandError,
    )
}
_RETRYABLE = {"AdapterUnavailable", "QueueFull", "CatalogUnavailable"}


@dataclass(frozen=True)
class Failure:
    """Why a request (or one sequence of it) failed: `kind` is an app.errors class name, or "internal"."""

    kind: str
    message: str
    retryable: bool = False
    param: str | None = None  # the request field at fault, when one is
    retry_after_s: float | None = None

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """The failure to send for `exc`; internals of an unexpected exception stay in the replica's log."""
        if not isinstance(exc, errors.LoraLandError):
            return cls("internal", f"internal error ({type(exc).__name__}); see the server log")
        if isinstance(exc, errors.InternalError):
            return cls("internal", str(exc))
        # A private subclass (e.g. the hub's AdapterUnavailable for a missing repo) travels as its public base.
        kind = next(k.__name__ for k in type(exc).__mro__ if _KNOWN.get(k.__name__) is k)
        return cls(
            kind,
            str(exc),
            kind in _RETRYABLE,
            getattr(exc, "param", None),
            getattr(exc, "retry_after_s", None),
        )

    def to_exception(self) -> errors.LoraLandError:
        """The one rule that turns a failure back into an exception: the kernel raises it for a failed
        sequence, and the ingress maps it to an HTTP status through the same table as any other error."""
        cls = errors.InternalError if self.kind == "internal" else _KNOWN.get(self.kind)
        if cls is None:
            return errors.LoraLandError(self.message)
        exc = cls(self.message, self.retry_after_s or 1.0) if cls is errors.QueueFull else cls(self.message)
        if self.param is not None:
            exc.param = self.param
        if self.retry_after_s is not None:
            exc.retry_after_s = self.retry_after_s
        return exc


@dataclass(frozen=True)
class ToolFunction:
    """One of a chat's `tools` (OpenAI's {"type": "function", "function": {...}}), checked by the ingress
    (app/router/http/tool_calls.py); the replica hands it to the chat template. `parameters`: its JSON schema as
    JSON text, None when the caller gave none."""

    name: str
    description: str | None = None
    parameters: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's tool object, what `tokenizer.apply_chat_template(..., tools=...)` expects."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ReplicaRequest:
    """One OpenAI request, parsed, resolved and validated once by the ingress: `spec` is the `model` field with
    every term's version pinned (app/names.py; empty = the base model), `records` the catalog record of every
    adapter version it needs, `sampling` the validated parameters of each choice."""

    request_id: str
    spec: ModelSpec = ModelSpec()
    records: tuple[AdapterRecord, ...] = ()
    prompts: tuple[str | tuple[int, ...], ...] = ()
    # a chat, rendered by the replica's tokenizer: OpenAI's messages ("role", "content"; an assistant's
    # "tool_calls", a tool's "tool_call_id"), and the `tools` its template is given
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[ToolFunction, ...] = ()
    sampling: SamplingParams = SamplingParams()
    n: int = 1
    tenant: str | None = None  # the caller's tenant, for fair admission (None: no auth, or the admin)
    echo: bool = False  # completions' echo: each choice's first delta carries its prompt's text

    @property
    def model_id(self) -> str:
        """The canonical id of `spec` ("" = base): the multiplexed model id the router sees."""
        return self.spec.canonical()


@dataclass(frozen=True)
class ReplicaStats:
    """What a replica reports about itself, read by every consumer through this one type: the router (as Serve's
    `record_routing_stats()`, every routing_stats_period_s) and the catalog (each heartbeat). `at` is the
    replica's wall clock when taken (the router compares it with when it last sent there)."""

    replica_id: str
    resident: tuple[str, ...] = ()  # adapter refs in host memory or a device slot (servable without a fetch)
    device_resident: tuple[str, ...] = ()  # those of them in a device slot
    loading: tuple[str, ...] = ()  # refs being fetched right now
    free_slots: int = 0
    queue_len: int = 0  # sequences waiting in the kernel
    running: int = 0  # sequences in the kernel's batch
    ongoing: int = 0  # generate() calls in progress (the router corrects its counts with it)
    kv_usage: float = 0.0
    at: float = 0.0
    node: dict[str, str | int] = field(
        default_factory=dict
    )  # where it runs: actor_name, node_ip, node_id, threads
    warmed: tuple[str, ...] | None = None  # what it loaded before its first request (None: warm-up not done)

    @staticmethod
    def of(obj: object) -> ReplicaStats | None:
        """A replica's stats as Serve hands them to the router: Serve's placeholder before the first report is an
        empty dict, which means nothing is known yet."""
        return obj if isinstance(obj, ReplicaStats) else None

    @property
    def busy(self) -> int:
        """Sequences in the kernel, running or waiting."""
        return self.running + self.queue_len

    def fresh(self, now: float, max_age_s: float) -> bool:
        """Taken at most `max_age_s` ago: recent enough to count as the replica's load."""
        return self.at > 0 and now - self.at <= max_age_s


@dataclass(frozen=True)
class ReplicaHello:
    """The first item of every reply stream: which replica is serving it."""

    replica_id: str


@dataclass(frozen=True)
class TokenLogprob:
    """One token and its log probability (the model's raw distribution: see app/replica/sampling.py), as the
    OpenAI shapes print it: `token` its text alone, `token_bytes` its exact bytes (a token may hold part of a
    UTF-8 character). `top`: the most likely tokens at that position, most likely first (empty unless asked)."""

    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it)
    token_bytes: bytes = b""
    top: tuple[TokenLogprob, ...] = ()


@dataclass
class ChoiceDelta:
    """New output of one choice (index = prompt index * n + sample index) since its previous delta."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # one entry per new token when the request asked for log probabilities, else None
    logprobs: list[TokenLogprob] | None = None
    # the first delta of a choice only: its prompt's text (echo) and the prompt tokens' log probabilities
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    # an activated LoRA's choice: whether its invocation sequence was found (False: served as the base model)
    alora_activated: bool | None = None

    def merge(self, later: ChoiceDelta) -> None:
        """Fold a later delta of the same choice into this one (coalescing, or accumulating a reply)."""
        self.text += later.text
        if self.prompt_text is None:
            self.prompt_text = later.prompt_text
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        self.finish_reason = later.finish_reason or self.finish_reason
        if later.alora_activated is not None:
            self.alora_activated = later.alora_activated
        self.prompt_tokens = later.prompt_tokens
        self.completion_tokens = later.completion_tokens


@dataclass(frozen=True)
class DeltaBatch:
    """The new output of several choices of one request, in one message (at most one delta per choice)."""

    deltas: tuple[ChoiceDelta, ...]


ReplyItem = ReplicaHello | ChoiceDelta | DeltaBatch | Failure


@dataclass(frozen=True)
class TokenizeCall:
    """vLLM's /tokenize or /detokenize for the replica's tokenizer (adapters share the base's): exactly one of
    `text` (a completion's prompt), `messages` (a chat, rendered as generation would) or `tokens` (detokenize)."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    tokens: tuple[int, ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class TokenizeReply:
    """The answer to a TokenizeCall: `tokens` (tokenize) or `text` (detokenize), and the replica's limit."""

    tokens: tuple[int, ...] = ()
    text: str = ""
    max_model_len: int = 0
