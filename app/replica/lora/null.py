"""The adapter hooks the engine calls, and the manager of an engine that serves the base model only.

`AdapterHooks` names what the engine needs from app/replica/lora/manager.py's AdapterManager; `NullAdapters`
implements it for no adapters at all, so the engine never asks whether it has a manager.
"""

from __future__ import annotations

from typing import Any, Protocol

from app.errors import InvalidRequest
from app.replica.sequence import Sequence


class AdapterHooks(Protocol):
    def submitted(self, key: str) -> None: ...  # a request for adapter `key` entered the engine
    def finished(self, seq: Sequence) -> None: ...  # a sequence ended (any reason)
    def admit(self, seq: Sequence) -> bool: ...  # False: its adapter is not on the device yet
    def release(self, seq: Sequence) -> None: ...  # a sequence stopped running (finished or preempted)
    def sort_key(self, seq: Sequence) -> tuple[int, int]: ...  # groups a batch's tokens by adapter slot
    def lora_batch(self, seqs_tokens: list[tuple[Sequence, int]]) -> Any: ...  # the step's LoRA plan or None
    def poll(self) -> dict[str, str]: ...  # {key: error} of background loads that failed
    def close(self) -> None: ...


class NullAdapters:
    """No adapters: every sequence runs on the base model."""

    def submitted(self, key: str) -> None:
        raise InvalidRequest(f"this engine serves the base model only, not adapter {key!r}")

    def finished(self, seq: Sequence) -> None:
        pass

    def admit(self, seq: Sequence) -> bool:
        return True

    def release(self, seq: Sequence) -> None:
        pass

    def sort_key(self, seq: Sequence) -> tuple[int, int]:
        return (-1, -1)

    def lora_batch(self, seqs_tokens: list[tuple[Sequence, int]]) -> None:
        return None

    def poll(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass
