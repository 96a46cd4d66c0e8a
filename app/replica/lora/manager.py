"""Adapter tiers: device slots (pools.py) <- host cache <- sources, with LRU eviction and background loads.

The registry maps keys ("name@version", or a merge's name) to entries; `current` names each adapter's newest live
version, what a lookup by bare name finds. An older version stays servable to requests pinned to it
(`name@v`: those the router resolved before the newer one arrived) until it has been unused for
`superseded_grace_s`; then the engine thread drops it (device slot and host copy freed), so a name that gets a
new version every few seconds holds flat memory. Retiring an entry (unload, the catalog removing that version,
or the retirement of a component of a merge; a merge also retires when a component is superseded) makes new
lookups miss it while the sequences already submitted finish on it; it leaves when the last one does.

Threads: the registry (register/unload/set_pinned/submitted/weights_of) is called from caller threads under
`_lock`; everything that touches pools or reference counts runs on the engine thread
(admit/release/poll/lora_batch/finished); loads (disk/S3/Hub reads, parsing, validation) run on a background
thread.

DoRA adapters need the base model's weights once, to compute their per-output factors (dora.py): the manager is
given `base_weights` and prepares every DoRA adapter before it is stored (register, on the caller's thread;
background loads, on the loader thread), never on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from app import metrics
from app.config.model_config import ModelConfig
from app.errors import UnknownAdapter
from app.replica.lora.dora import BaseWeights, with_dora_scales
from app.replica.lora.entry import AdapterEntry
from app.replica.lora.pools import LoraBatch, Pool, signature
from app.replica.lora.step_plan import plan_lora_batch
from app.replica.lora.vocab import with_vocab_copies
from app.replica.lora.weights import LoraWeights
from app.replica.sequence import NEVER, Sequence, alora_start

log = logging.getLogger("loraland.adapters")

SUPERSEDED_GRACE_S = 2.0  # an unused older version is dropped after this long (covers lookup -> submit)
PRUNE_EVERY_S = 0.25


class AdapterManager:
    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        max_adapters: int,
        max_cpu_adapters: int | None,
        dtype,
        device,
        on_ready: Callable[[], None] = lambda: None,
        base_weights: BaseWeights | None = None,
        max_saved_module_bytes: int | None = None,
    ):
        """`base_weights`: the base model's checkpoint, read once per DoRA adapter load (None: DoRA adapters
        are refused with a message saying so) and per adapter carrying embed_tokens/lm_head base weights.
        `max_saved_module_bytes`: the most bytes of full embed_tokens/lm_head copies one adapter may hold
        (vocab.py; None: no limit)."""
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        self.cfg, self.dtype, self.device = model_cfg, dtype, device
        self.base_weights = base_weights
        self.max_saved_module_bytes = max_saved_module_bytes
        self.max_adapters = max_adapters
        self.max_cpu_adapters = max_cpu_adapters or max(2 * max_adapters, 64)
        self.entries: dict[str, AdapterEntry] = {}
        self.current: dict[str, str] = {}  # name -> key of its newest live version
        self.pools: dict[tuple, Pool] = {}
        self.host_lru: OrderedDict[str, None] = OrderedDict()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loraland-adapter-load")
        self._lock = threading.Lock()  # guards entries/current/host_lru against the caller threads
        self._loaded: list[str] = []  # keys whose background load finished (ok or failed)
        self.on_ready = on_ready
        self.loads = 0
        self.evictions = 0
        self.superseded_grace_s = SUPERSEDED_GRACE_S
        self._next_prune = 0.0

    # ------------------------------------------------------------------ registry (caller threads)
    def register(
        self,
        name: str,
        version: int,
        loader: Callable[[], LoraWeights],
        weights: LoraWeights | None = None,
        *,
        parts: tuple[str, ...] = (),
    ) -> AdapterEntry:
        """Register version `version` of `name` (`weights`, re-read by `loader` after host eviction): the current
        one unless a newer version is (then it serves requests pinned to it, beside the newer). `parts`: the keys
        of the adapters a merge is built from; the new entry retires with any of them. Raises KeyError when one
        of them is already unloaded or replaced (the caller raced an unload), and InvalidAdapter for a DoRA
        adapter the base weights do not fit."""
        key = f"{name}@{version}"
        if weights is not None:
            weights = self._prepare(weights)  # the caller's thread, not the engine's
        with self._lock:
            gone = [k for k in parts if k not in self.entries or self.entries[k].retired]
            if gone:
                raise KeyError(gone[0])
            old = self.current.get(name)
            prev = self.entries.get(key)
            if prev is not None:
                # The same name@version again (a request pinned to an older version, or a reload): versions are
                # immutable, so the entry comes back to life with its device slot, which a new entry would leak
                entry, prev.retired, prev.loader, prev.last_used = prev, False, loader, time.monotonic()
                if prev.weights is None:
                    prev.weights = weights
            else:
                entry = AdapterEntry(key, name, version, loader, weights=weights, parts=tuple(parts))
            self.entries[key] = entry
            older = old is not None and old != key and self.entries[old].version > version
            if not older:
                if old is not None and old != key:
                    entry.pinned = self.entries[old].pinned
                    self._supersede(self.entries[old])
                self.current[name] = key
            if weights is not None:
                self._touch_host(key)
        return entry

    def unload(self, name: str) -> None:
        with self._lock:
            key = self.current.get(name)
            if key is None:
                raise KeyError(name)
            self._retire(self.entries[key])

    def retire(self, key: str) -> None:
        """No new lookups of the version `key` (the catalog removed it); its running sequences finish on it."""
        with self._lock:
            self._retire(self.entries[key])

    def _supersede(self, e: AdapterEntry) -> None:
        """Under the lock: `e` is no longer its name's current version; merges built from it retire."""
        e.pinned, e.last_used = False, time.monotonic()
        for d in [d for d in self.entries.values() if e.key in d.parts and not d.retired]:
            self._retire(d)

    def _retire(self, e: AdapterEntry) -> None:
        """Under the lock: no new lookups find `e`, nor any entry built from it; running sequences finish."""
        if self.current.get(e.name) == e.key:
            del self.current[e.name]
        e.retired, e.pinned = True, False
        for d in [d for d in self.entries.values() if e.key in d.parts and not d.retired]:
            self._retire(d)

    def resolve(self, name: str) -> str | None:
        """Key of the newest live version of `name` (None if not loaded)."""
        return self.current.get(name)

    def weights_of(self, key: str) -> LoraWeights:
        """The host weights of entry `key`, re-read through its loader (outside the lock, on the calling thread)
        when the host cache evicted them. KeyError when there is no such entry."""
        with self._lock:
            e = self.entries[key]
            weights, loader = e.weights, e.loader
        return weights if weights is not None else loader()

    def set_pinned(self, name: str, pinned: bool) -> None:
        with self._lock:
            key = self.current.get(name)
            if key is None:
                raise KeyError(name)
            self.entries[key].pinned = pinned

    def names(self) -> list[str]:
        return sorted(self.current)

    def in_memory(self) -> list[str]:
        """Names whose live version is in host memory, a device slot, or being read back in: what a request can
        use without fetching again (`names` never shrinks: the registry keeps every adapter's loader, to read
        it again after the host LRU drops it). `list()` copies the dict in one step under the GIL, so the
        engine thread's changes cannot break the iteration."""
        entries = list(self.entries.values())
        return sorted({e.name for e in entries if not e.retired and e.in_memory})

    def host_count(self) -> int:
        """Adapters parsed in host memory (the host LRU's length)."""
        return len(self.host_lru)

    def is_live(self, key: str) -> bool:
        """Whether `key` (name@version, or a merge's key) is registered and not retired."""
        e = self.entries.get(key)
        return e is not None and not e.retired

    def submitted(self, key: str) -> None:
        with self._lock:
            e = self.entries.get(key)
            if e is None:  # dropped between the caller's lookup and now (unused past the grace period)
                raise UnknownAdapter(
                    f"adapter {key!r} was unloaded or replaced as the request started: retry"
                )
            e.pending += 1

    # ------------------------------------------------------------------ engine thread
    def finished(self, seq: Sequence) -> None:
        if seq.adapter is None:
            return
        with self._lock:
            e = self.entries.get(seq.adapter)
            if e is not None:
                e.pending -= 1
                self._maybe_drop(e)

    def _maybe_drop(self, e: AdapterEntry) -> None:
        if e.retired and e.pending <= 0 and e.refs <= 0:
            self._drop(e)

    def _drop(self, e: AdapterEntry) -> None:
        """Engine thread, under the lock: forget `e`, freeing its device slot and host copy."""
        if e.slot is not None:
            e.slot[0].remove(e.slot[1])
            e.slot = None
        self.entries.pop(e.key, None)
        self.host_lru.pop(e.key, None)

    def _prune(self) -> None:
        """Engine thread: drop versions that are not current (superseded or retired), idle for the grace period
        and unused (no submitted or running sequence, no read in flight); merges built from them retire."""
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY_S
        with self._lock:
            for e in list(self.entries.values()):
                stale = e.retired or self.current.get(e.name) != e.key
                if stale and e.unused_for(self.superseded_grace_s, now):
                    self._retire(e)
                    self._drop(e)

    def admit(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return True
        e = self.entries[seq.adapter]
        if e.slot is None:
            if e.weights is None:
                self._start_load(e)
                return False
            if not self._install(e):
                return False
        e.refs += 1
        e.last_used = time.monotonic()
        if e.alora is not None:  # PEFT's activation point, from the prompt only: outputs always come after it
            at = alora_start(seq.prompt_ids, e.alora)
            seq.lora_start, seq.alora_activated = (NEVER, False) if at is None else (at, True)
        if e.key in self.host_lru:  # a use makes its host copy the most recently used (LRU, not load order)
            with self._lock:
                if e.key in self.host_lru:
                    self.host_lru.move_to_end(e.key)
        return True

    def release(self, seq: Sequence) -> None:
        if seq.adapter is None:
            return
        e = self.entries.get(seq.adapter)
        if e is not None:
            e.refs -= 1
            e.last_used = time.monotonic()

    def sort_key(self, seq: Sequence) -> tuple[int, int]:
        if seq.adapter is None:
            return (-1, -1)
        pool, slot = self.entries[seq.adapter].slot
        return (pool.index, slot)

    def lora_batch(self, seqs_tokens: list[tuple[Sequence, int]]) -> LoraBatch | None:
        """This step's LoRA plan (step_plan.py), `seqs_tokens` in sort_key order."""
        return plan_lora_batch(self.entries, seqs_tokens, self.device)

    def poll(self) -> dict[str, str]:
        """Collect finished background loads; returns {key: error} for the loads that failed. Prunes unused
        old versions now and then."""
        self._prune()
        with self._lock:
            done, self._loaded = self._loaded, []
        failed = {}
        for key in done:
            e = self.entries.get(key)
            if e is None or e.loading is None:
                continue
            fut, e.loading = e.loading, None
            try:
                weights = fut.result()
            except Exception as ex:  # the adapter fails alone; its waiting requests get the message
                failed[key] = str(ex)
                continue
            with self._lock:  # host_lru is also touched by register() on caller threads
                e.weights = weights
                self._touch_host(key)
        return failed

    def _start_load(self, e: AdapterEntry) -> None:
        if e.loading is not None:
            return
        self.loads += 1
        if metrics.enabled():
            metrics.ADAPTER_RELOADS.labels(metrics.adapter_seen(e.name)).inc()

        def done(_):
            with self._lock:
                self._loaded.append(e.key)
            self.on_ready()

        loader = e.loader
        e.loading = self._loader.submit(lambda: self._prepare(loader()))
        e.loading.add_done_callback(done)

    def _prepare(self, lw: LoraWeights) -> LoraWeights:
        """What an adapter needs from the base weights before it is stored: DoRA's factors, and its saved
        embed_tokens/lm_head weights resolved and size-checked. Never on the engine thread."""
        lw = with_dora_scales(lw, self.base_weights)
        return with_vocab_copies(
            lw,
            self.base_weights,
            max_bytes=self.max_saved_module_bytes,
            dtype=self.dtype,
            tied=self.cfg.tie_word_embeddings,
        )

    def _install(self, e: AdapterEntry) -> bool:
        resident = [x for x in self.entries.values() if x.slot is not None]
        if len(resident) >= self.max_adapters:
            victims = [x for x in resident if x.refs <= 0 and not x.pinned]
            if not victims:
                return False  # every slot serves a running sequence: wait
            victim = min(victims, key=lambda x: x.last_used)
            victim.slot[0].remove(victim.slot[1])
            victim.slot = None
            self.evictions += 1
            if metrics.enabled():
                metrics.EVICTIONS.labels(metrics.adapter_seen(victim.name), "device").inc()
        sig = signature(e.weights)
        pool = self.pools.get(sig)
        if pool is None:
            biases = self.base_weights.bias if self.base_weights is not None else None
            pool = self.pools[sig] = Pool(
                len(self.pools), sig, self.cfg, self.max_adapters, self.dtype, self.device, biases
            )
        e.slot = (pool, pool.install(e.weights))
        e.alora = e.weights.alora_invocation_tokens
        return True

    def _touch_host(self, key: str) -> None:
        """Under the lock: mark `key` most recently used on the host; drop the least recently used host copies
        (not pinned, not running) past max_cpu_adapters."""
        self.host_lru[key] = None
        self.host_lru.move_to_end(key)
        while len(self.host_lru) > self.max_cpu_adapters:
            victim = next(
                (
                    k
                    for k in self.host_lru
                    if not self.entries[k].pinned and self.entries[k].refs <= 0 and k != key
                ),
                None,
            )
            if victim is None:
                break
            del self.host_lru[victim]
            self.entries[victim].weights = None  # device copy (if any) stays; re-read from source when needed
            if metrics.enabled():
                metrics.EVICTIONS.labels(metrics.adapter_seen(self.entries[victim].name), "host").inc()

    # ------------------------------------------------------------------ introspection
    def tiers(self) -> dict[str, str]:
        """Live keys servable without a fetch, each "device" (in a slot) or "host" (host memory, or being read
        in); versions, unlike `resident` and `in_memory`, which name adapters."""
        entries = list(self.entries.values())
        return {e.key: "device" if e.slot else "host" for e in entries if not e.retired and e.in_memory}

    def resident(self) -> list[str]:
        return sorted(e.name for e in self.entries.values() if e.slot is not None and not e.retired)

    def free_slots(self) -> int:
        return self.max_adapters - sum(1 for e in self.entries.values() if e.slot is not None)

    def resident_bytes(self) -> tuple[int, int]:
        """(bytes of touched pool memory, bytes of the resident adapters' own tensors)."""
        touched = sum(p.high_water() * p.nbytes_per_slot() for p in self.pools.values())
        own = 0
        for e in self.entries.values():
            if e.slot is not None:
                own += e.slot[0].nbytes_per_slot()
        return touched, own

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
