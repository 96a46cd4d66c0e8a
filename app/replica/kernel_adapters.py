"""LLMKernel's adapter administration (mixed into LLMKernel, app/replica/kernel.py): reading and registering
adapter versions, unloading, pinning, the adaptive chain and the tenants' fair-share weights."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from app.errors import UnknownAdapter
from app.names import check_name
from app.replica.adapter_reader import AdapterReader
from app.replica.composition import Composition
from app.replica.fairness import AdmissionPolicy
from app.replica.lora.manager import AdapterManager


class KernelAdapters:
    """Mixed into LLMKernel, whose constructor sets these attributes."""

    reader: AdapterReader
    adapter_manager: AdapterManager
    composition: Composition
    fairness: AdmissionPolicy
    _versions: dict[str, int]
    _adapter_lock: threading.Lock

    @property
    def hub(self) -> Any:
        return self.reader.hub

    def load_adapter(
        self,
        name: str,
        source: str | Path,
        *,
        version: int | None = None,
        files: dict[str, str] | None = None,
    ) -> None:
        """Parse and validate an adapter and make it servable under `name` (a new version if it exists).
        `files` (filename -> sha256) makes the hub verify what it fetches, now and on every re-read.
        Blocks the caller only; requests already running keep decoding."""
        check_name(name)
        weights = self.reader.read(source, name, files)
        with self._adapter_lock:
            v = version if version is not None else self._versions.get(name, 0) + 1
            self._versions[name] = max(v, self._versions.get(name, 0))
        self.adapter_manager.register(name, v, self.reader.loader(source, name, files), weights)

    def unload_adapter(self, name: str) -> None:
        """Requests already submitted for `name` finish; new ones get UnknownAdapter."""
        try:
            self.adapter_manager.unload(name)
        except KeyError:
            raise UnknownAdapter(f"adapter {name!r} is not loaded; loaded: {self.adapters()}") from None
        self.composition.forget(name)

    def pin(self, name: str) -> None:
        self._pin(name, True)

    def unpin(self, name: str) -> None:
        self._pin(name, False)

    def _pin(self, name: str, pinned: bool) -> None:
        try:
            self.adapter_manager.set_pinned(name, pinned)
        except KeyError:
            raise UnknownAdapter(f"adapter {name!r} is not loaded") from None

    def has_adapter(self, name: str) -> bool:
        return self.adapter_manager.resolve(name) is not None

    def adapters(self) -> list[str]:
        return self.adapter_manager.names()

    def set_tenant_weights(self, weights: Mapping[str | None, float]) -> None:
        """Replace the tenants' shares under the "vtc" policy (tenant -> positive weight; one not named weighs 1,
        None is the anonymous tenant): weight 2 gets twice the tokens of weight 1 while both wait."""
        self.fairness.set_weights(weights)

    def set_adaptive_chain(self, names: Seq[str] | None) -> None:
        """Requests that name no adapter run through this chain (also addressable as "a|b"); None clears it."""
        self.composition.set_chain(names)
