"""Chains and merges: what an adapter id names, as one adapter key per pipeline stage.

A chain `a|b` is a pipeline: the kernel runs stage a to completion and feeds its text to stage b. A merge
`a*0.7+b*0.3` is one forward through a virtual adapter, the terms' LoRAs concatenated along the rank axis
(merge_adapters); `ties(a*0.7+b*0.3;density=0.5)` and PEFT's other combination types likewise build one
virtual adapter, named by its canonical text with the terms' versions. The virtual adapter is registered with the AdapterManager with its components as `parts`:
unloading or replacing a component retires it, and after a host eviction its loader merges again from the
components' weights, read under the manager's lock.

Building a merge reads every component's weights (a re-read may fetch from S3 or the Hub) and concatenates
tensors: callers on an event loop use `lookup` (dictionary reads only) and run `stages` in a thread when
`lookup` says a merge must be built first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from app.errors import InvalidRequest, UnknownAdapter
from app.merge_methods import MergeMethod
from app.names import ModelSpec, Term, parse_model
from app.replica.lora.manager import AdapterManager
from app.replica.lora.merge import merge_adapters
from app.replica.lora.weights import LoraWeights

Stages = list[str | None]  # one adapter key per pipeline stage; None = the base model


class Composition:
    """Resolves adapter ids (plain, versioned, chains, merges) against one AdapterManager, and holds the
    adaptive chain that requests naming no adapter run through."""

    def __init__(self, manager: AdapterManager, base_ids: tuple[str, ...]):
        self.manager = manager
        self.base_ids = base_ids
        self.chain: ModelSpec | None = None
        self._build = threading.Lock()  # two requests for a new merge build it once

    # ------------------------------------------------------------------ the adaptive chain
    def set_chain(self, names: Sequence[str] | None) -> None:
        """Requests that name no adapter run through this chain (also addressable as "a|b"); None clears it."""
        if not names:
            self.chain = None
            return
        spec = parse_model("|".join(names))
        for t in spec.terms():
            self.term_key(t)
        self.chain = spec

    def forget(self, name: str) -> None:
        """`name` was unloaded: a chain through it ends (its merges are retired by the manager)."""
        if self.chain is not None and name in {t.name for t in self.chain.terms()}:
            self.chain = None

    # ------------------------------------------------------------------ resolution
    def spec(self, adapter_id: str | ModelSpec | None) -> ModelSpec:
        """The parsed adapter id (a ModelSpec is already parsed: the replica's requests arrive so); None means
        the adaptive chain, or the base model when there is none."""
        if adapter_id is None:
            return self.chain or ModelSpec()
        if isinstance(adapter_id, ModelSpec):
            return adapter_id
        if not isinstance(adapter_id, str):
            raise InvalidRequest(f"adapter id must be a string or None, got {type(adapter_id).__name__}")
        return parse_model(adapter_id, self.base_ids)

    def stages(self, adapter_id: str | ModelSpec | None) -> Stages:
        """Adapter keys, one per pipeline stage, building the virtual adapter of any new merge (blocking)."""
        spec = self.spec(adapter_id)
        return [self._stage_key(st, spec.method(i), build=True) for i, st in enumerate(spec.stages)] or [None]

    def lookup(self, adapter_id: str | ModelSpec | None) -> Stages | None:
        """As `stages`, without building: None when a merge has no virtual adapter yet (then call `stages`
        off the event loop). Raises as `stages` does for unknown adapters and bad ids."""
        spec = self.spec(adapter_id)
        keys = [self._stage_key(st, spec.method(i), build=False) for i, st in enumerate(spec.stages)]
        if any(k == "" for k in keys):
            return None
        return keys or [None]

    def term_key(self, t: Term) -> str:
        m = self.manager
        if t.version is None:
            key = m.resolve(t.name)
        else:
            key = f"{t.name}@{t.version}"
            key = key if m.is_live(key) else None
        if key is None:
            raise UnknownAdapter(f"adapter {t.ref!r} is not loaded on this kernel; loaded: {m.names()}")
        return key

    def _stage_key(self, stage: tuple[Term, ...], method: MergeMethod | None, *, build: bool) -> str:
        """The adapter key serving one stage: the adapter itself, or a merge's virtual adapter ("" when that
        is not built yet and `build` is False)."""
        if len(stage) == 1 and method is None:
            return self.term_key(stage[0])
        while True:
            keys = tuple(self.term_key(t) for t in stage)
            name = "+".join(f"{k}*{t.weight:g}" for k, t in zip(keys, stage))
            if method is not None and (method.kind != "cat" or len(stage) == 1):
                name = method.text(name)
            key = self.manager.resolve(name)
            if key is not None or not build:
                return key or ""
            with self._build:
                key = self.manager.resolve(name)
                if key is not None:
                    return key
                load = self._merger(name, keys, tuple(t.weight for t in stage), method)
                try:
                    return self.manager.register(name, 1, load, load(), parts=keys).key
                except KeyError:
                    # A component was unloaded or replaced while this merge was built: resolve the terms
                    # again (an unloaded one now raises UnknownAdapter, a replaced one gives its new key).
                    continue

    def _merger(
        self, name: str, keys: tuple[str, ...], weights: tuple[float, ...], method: MergeMethod | None
    ) -> Callable[[], LoraWeights]:
        """The merge's loader: run now, and again after a host eviction (DARE's seed makes it the same)."""
        m = self.manager

        def load() -> LoraWeights:
            terms = [(m.weights_of(k), w) for k, w in zip(keys, weights)]
            alora = [k for k, (lw, _) in zip(keys, terms) if lw.alora_invocation_tokens is not None]
            if alora:  # PEFT cannot merge aLoRA either: its delta applies to part of the sequence only
                raise InvalidRequest(
                    f"adapter {alora[0]!r} is an activated LoRA (alora_invocation_tokens): it cannot be merged or "
                    "combined; use it alone or as a stage of a chain (a|b)"
                )
            return merge_adapters(terms, name, method=method)

        return load
