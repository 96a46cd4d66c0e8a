"""Adapter tiers: device slots (pools) <- host cache <- sources, with LRU eviction and background loads.

Device memory is organised as *pools*: adapters with the same shape signature (rank of every targeted
(layer, module)) share one pool, so a rank-4 adapter never pays for rank-64 slots and a q/v adapter never
pays for MLP slots. Per (layer, fused linear) a pool holds A [cap, in, sum of ranks] (q/k/v and gate/up A's
side by side, so one shrink serves all three) and one B [cap, r, out] per module with alpha/r folded in.

Everything that touches pools or reference counts runs on the engine thread (admit/release/poll/lora_batch);
loads (disk/S3/Hub reads, parsing, validation) run on a background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from app.config.model_config import ModelConfig
from app.replica.lora.peft_format import LoraWeights
from app.replica.sequence import Sequence
from kernels import lora as K

log = logging.getLogger("loraland.adapters")

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_GROUP = {m: g for g, ms in GROUPS.items() for m in ms}


@dataclass
class AdapterEntry:
    key: str  # "name@version": what sequences and prefix hashes refer to
    name: str
    version: int
    loader: Callable[[], LoraWeights]  # reads the adapter again after host eviction
    weights: LoraWeights | None = None
    loading: Future | None = None
    error: str | None = None
    slot: tuple[Pool, int] | None = None
    refs: int = 0  # running sequences using the device slot
    pending: int = 0  # submitted, unfinished sequences
    pinned: bool = False
    retired: bool = False  # unloaded or replaced by a newer version: no new requests
    last_used: float = field(default_factory=time.monotonic)


class _GroupWeights:
    """One pool's tensors for one fused linear of one layer."""

    def __init__(self, cap: int, d_in: int, parts: list[tuple[str, int, int, int]], dtype, device):
        # parts: (module, rank, out_features, column offset in the fused output)
        self.rank_total = sum(r for _, r, _, _ in parts)
        self.A = torch.empty(cap, d_in, self.rank_total, dtype=dtype, device=device)
        self.parts = []
        r0 = 0
        for module, r, out, col in parts:
            self.parts.append(
                (module, r0, r0 + r, col, col + out, torch.empty(cap, r, out, dtype=dtype, device=device))
            )
            r0 += r

    def grow(self, cap: int) -> None:
        def bigger(t):
            n = torch.empty(cap, *t.shape[1:], dtype=t.dtype, device=t.device)
            n[: t.shape[0]] = t
            return n

        self.A = bigger(self.A)
        self.parts = [(m, r0, r1, c0, c1, bigger(B)) for m, r0, r1, c0, c1, B in self.parts]

    def nbytes_per_slot(self) -> int:
        per = self.A[0].numel() * self.A.element_size()
        return per + sum(B[0].numel() * B.element_size() for *_, B in self.parts)


class Pool:
    """Slots for adapters of one shape signature. On CPU the tensors are allocated for max_adapters slots up
    front with torch.empty: untouched pages are never committed, so memory follows the slots in use. On CUDA
    they grow by doubling."""

    def __init__(self, index: int, signature: tuple, cfg: ModelConfig, max_slots: int, dtype, device):
        self.index, self.signature = index, signature
        ranks = {(layer, m): r for layer, m, r in signature}
        shapes = cfg.linear_shapes()
        offsets = {
            "q_proj": 0,
            "k_proj": shapes["q_proj"][1],
            "v_proj": shapes["q_proj"][1] + shapes["k_proj"][1],
            "gate_proj": 0,
            "up_proj": shapes["gate_proj"][1],
            "o_proj": 0,
            "down_proj": 0,
        }
        self.cap = max_slots if device.type == "cpu" else min(8, max_slots)
        self.max_slots = max_slots
        self.groups: dict[tuple[int, str], _GroupWeights] = {}
        for layer in sorted({lay for lay, _ in ranks}):
            for g, modules in GROUPS.items():
                parts = [
                    (m, ranks[(layer, m)], shapes[m][1], offsets[m]) for m in modules if (layer, m) in ranks
                ]
                if parts:
                    self.groups[(layer, g)] = _GroupWeights(
                        self.cap, shapes[modules[0]][0], parts, dtype, device
                    )
        self.free = list(range(self.cap - 1, -1, -1))  # lowest index first keeps the high-water mark tight
        self.used: set[int] = set()

    def high_water(self) -> int:
        return max(self.used) + 1 if self.used else 0

    def nbytes_per_slot(self) -> int:
        return sum(g.nbytes_per_slot() for g in self.groups.values())

    def install(self, lw: LoraWeights) -> int:
        if not self.free:
            new_cap = min(self.max_slots, self.cap * 2)
            for g in self.groups.values():
                g.grow(new_cap)
            self.free = list(range(new_cap - 1, self.cap - 1, -1))
            self.cap = new_cap
        self.free.sort(reverse=True)
        slot = self.free.pop()
        for (layer, _), gw in self.groups.items():
            for module, r0, r1, _, _, B in gw.parts:
                a, b = lw.tensors[(layer, module)]
                gw.A[slot, :, r0:r1].copy_(a.t())
                B[slot].copy_((b * lw.scale).t())
        self.used.add(slot)
        return slot

    def remove(self, slot: int) -> None:
        self.used.discard(slot)
        self.free.append(slot)


def signature(lw: LoraWeights) -> tuple:
    return tuple(sorted((layer, m, a.shape[0]) for (layer, m), (a, _) in lw.tensors.items()))


class LoraBatch:
    """Per-step LoRA plan: for each pool present, its contiguous token range and segments."""

    def __init__(self, plans: list[tuple[Pool, int, int, K.Segments]]):
        self.plans = plans

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        for pool, s, e, seg in self.plans:
            gw = pool.groups.get((layer, group))
            if gw is None:
                continue
            hw = seg.num_slots
            z = K.shrink(x[s:e], gw.A[:hw], seg)
            for _, r0, r1, c0, c1, B in gw.parts:
                K.expand(out[s:e, c0:c1], z[:, r0:r1], B[:hw], seg)


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
    ):
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        self.cfg, self.dtype, self.device = model_cfg, dtype, device
        self.max_adapters = max_adapters
        self.max_cpu_adapters = max_cpu_adapters or max(2 * max_adapters, 64)
        self.entries: dict[str, AdapterEntry] = {}
        self.current: dict[str, str] = {}  # name -> key of its newest live version
        self.pools: dict[tuple, Pool] = {}
        self.host_lru: OrderedDict[str, None] = OrderedDict()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loraland-adapter-load")
        self._lock = threading.Lock()  # guards entries/current against the caller threads
        self._loaded: list[str] = []  # keys whose background load finished (ok or failed)
        self.on_ready = on_ready
        self.loads = 0
        self.evictions = 0

    # ------------------------------------------------------------------ registry (caller threads)
    def register(
        self, name: str, version: int, loader: Callable[[], LoraWeights], weights: LoraWeights | None = None
    ) -> AdapterEntry:
        key = f"{name}@{version}"
        with self._lock:
            old = self.current.get(name)
            entry = AdapterEntry(key, name, version, loader, weights=weights)
            if old is not None and old != key:
                prev = self.entries[old]
                prev.retired = True
                entry.pinned = prev.pinned
            self.entries[key] = entry
            self.current[name] = key
            if weights is not None:
                self._touch_host(key)
        return entry

    def unload(self, name: str) -> None:
        with self._lock:
            key = self.current.pop(name, None)
            if key is None:
                raise KeyError(name)
            self.entries[key].retired = True
            self.entries[key].pinned = False

    def resolve(self, name: str) -> str | None:
        """Key of the newest live version of `name` (None if not loaded)."""
        return self.current.get(name)

    def set_pinned(self, name: str, pinned: bool) -> None:
        with self._lock:
            key = self.current.get(name)
            if key is None:
                raise KeyError(name)
            self.entries[key].pinned = pinned

    def names(self) -> list[str]:
        return sorted(self.current)

    def submitted(self, key: str) -> None:
        with self._lock:
            self.entries[key].pending += 1

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
            if e.slot is not None:
                e.slot[0].remove(e.slot[1])
                e.slot = None
            self.entries.pop(e.key, None)
            self.host_lru.pop(e.key, None)

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
        """seqs_tokens: the batch in sort_key order, with each sequence's token count this step."""
        plans, t, i = [], 0, 0
        while i < len(seqs_tokens):
            seq, n = seqs_tokens[i]
            if seq.adapter is None:
                t += n
                i += 1
                continue
            pool = self.entries[seq.adapter].slot[0]
            start, slots = t, []
            while (
                i < len(seqs_tokens)
                and seqs_tokens[i][0].adapter is not None
                and self.entries[seqs_tokens[i][0].adapter].slot[0] is pool
            ):
                s, n = seqs_tokens[i]
                slots += [self.entries[s.adapter].slot[1]] * n
                t += n
                i += 1
            ids = torch.tensor(slots, dtype=torch.int64, device=self.device)
            plans.append((pool, start, t, K.build_segments(ids, pool.high_water())))
        return LoraBatch(plans) if plans else None

    def poll(self) -> dict[str, str]:
        """Collect finished background loads; returns {key: error} for the loads that failed."""
        with self._lock:
            done, self._loaded = self._loaded, []
        failed = {}
        for key in done:
            e = self.entries.get(key)
            if e is None or e.loading is None:
                continue
            fut, e.loading = e.loading, None
            try:
                e.weights = fut.result()
                e.error = None
                self._touch_host(key)
            except Exception as ex:  # the adapter fails alone; its waiting requests get the message
                e.error = str(ex)
                failed[key] = e.error
        return failed

    def _start_load(self, e: AdapterEntry) -> None:
        if e.loading is not None:
            return
        self.loads += 1

        def done(_):
            with self._lock:
                self._loaded.append(e.key)
            self.on_ready()

        e.loading = self._loader.submit(e.loader)
        e.loading.add_done_callback(done)

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
        sig = signature(e.weights)
        pool = self.pools.get(sig)
        if pool is None:
            pool = self.pools[sig] = Pool(
                len(self.pools), sig, self.cfg, self.max_adapters, self.dtype, self.device
            )
        e.slot = (pool, pool.install(e.weights))
        return True

    def _touch_host(self, key: str) -> None:
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

    # ------------------------------------------------------------------ introspection
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
