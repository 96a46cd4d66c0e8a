"""What the engine hands a request's consumer (`Delta`) and the per-request output state it keeps
(`OutputState`): a leaf, so the sequence can hold its output state without importing the output side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.errors import LoraLandError
from app.replica.logprobs import SampleLogprobs


@dataclass
class Delta:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # why the request failed (finish_reason "abort"): an app.errors exception, raised by the kernel's stream
    error: LoraLandError | None = None
    logprobs: list[SampleLogprobs] | None = None  # one per token of token_ids, when the request asked
    prompt_logprobs: list[SampleLogprobs] | None = None  # one per prompt token, in the first delta only
    # an activated LoRA's request: whether its prompt held the invocation (False: served as the base model)
    alora_activated: bool | None = None


@dataclass
class OutputState:
    """One request's output side: where its deltas go and how far its text has been decoded and sent."""

    on_delta: Callable[[Delta], None]
    stops: tuple[str, ...]
    hold: int  # characters held back because they may begin a stop string
    prefix_offset: int = 0  # output tokens [prefix_offset, read_offset) decode to `prefix_text`
    read_offset: int = 0  # output tokens before it are committed text
    prefix_text: str = ""
    pending: str = ""  # what the tokens past read_offset add so far (ends in U+FFFD, or is empty)
    tail: str = ""  # committed text from (sent characters - hold) on, at most
    tail_sent: int = 0  # how many characters of `tail + pending` were already sent
    sent_tokens: int = 0
