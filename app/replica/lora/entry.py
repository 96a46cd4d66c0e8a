"""One registered adapter version in the AdapterManager (manager.py): its tiers, its users, its state."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from app.replica.lora.pools import Pool
from app.replica.lora.weights import LoraWeights


@dataclass
class AdapterEntry:
    key: str  # "name@version": what sequences and prefix hashes refer to
    name: str
    version: int
    loader: Callable[[], LoraWeights]  # reads the adapter again after host eviction
    weights: LoraWeights | None = None
    parts: tuple[str, ...] = ()  # keys this entry is built from (a merge): it retires with any of them
    loading: Future | None = None
    slot: tuple[Pool, int] | None = None
    refs: int = 0  # running sequences using the device slot
    pending: int = 0  # submitted, unfinished sequences
    pinned: bool = False
    retired: bool = False  # unloaded, or removed from the catalog: no new requests
    last_used: float = field(default_factory=time.monotonic)  # also set when registered or superseded
    alora: tuple[int, ...] | None = None  # an activated LoRA's invocation tokens (known once installed)

    @property
    def in_memory(self) -> bool:
        """Servable without a fetch: in host memory, a device slot, or being read back in."""
        return self.weights is not None or self.slot is not None or self.loading is not None

    def unused_for(self, seconds: float, now: float) -> bool:
        """No submitted or running sequence, no read in flight, and not used for `seconds`."""
        idle = self.pending <= 0 and self.refs <= 0 and self.loading is None
        return idle and now - self.last_used >= seconds
