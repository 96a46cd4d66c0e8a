"""Fault injection for tests of isolation on real replicas (off unless the environment asks for it).

A Ray replica runs in its own worker process, where a test cannot call `LLMKernel.set_fault_hook` itself. When the
replica's environment holds LORALAND_TEST_FAULT_PROMPT, every sequence whose prompt tokenizes to exactly that
text raises inside the engine step's sampling, for that row only: the one-row fault of issue 21. Production
never sets it (no config field carries it, so it cannot be turned on through the admin API or a Serve config).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

FAULT_PROMPT_ENV = "LORALAND_TEST_FAULT_PROMPT"

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by the test fault hook for the row whose prompt matches."""


def install_fault_hook(kernel: Any) -> None:
    """Give `kernel` (an LLMKernel) the fault hook the environment asks for; nothing in the normal case."""
    text = os.environ.get(FAULT_PROMPT_ENV)
    if text:
        kernel.set_fault_hook(_hook_for(kernel.tokenizer.encode(text, add_special_tokens=False), text))


def _hook_for(target: list[int], text: str) -> Callable:
    log.warning("test fault injection is ON: prompts equal to %r fail inside sampling", text)

    def hook(seq) -> None:
        if seq.prompt_ids[-len(target) :] == target and len(seq.prompt_ids) <= len(target) + 1:
            raise InjectedFault("injected")

    return hook
