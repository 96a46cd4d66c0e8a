"""The adapter versions a replica has registered with its kernel, and fetching the ones a request lacks.

Each version is fetched (verified against the catalog's sha256s by the hub) and registered once, on a worker
thread: whoever needs a version being loaded (requests on the event loop, a catalog push on the listener
thread) waits for that same load, and a request's cold adapters load concurrently (a merge of three cold adapters
costs about one load, not three). Several versions of a name may be held at once: the newest is the kernel's
current one, an older one serves the requests pinned to it until the kernel drops it unused
(app/replica/lora/manager.py). A version that failed to load for good (a bad adapter stays bad) is remembered
here and, through `on_unloadable`, in the catalog, so no replica tries it again.

The disk cache (S3 downloads, one folder per version's content) is pruned like versions are: once the catalog
removed a version (a runtime load keeps a name's newest versions) and no request here uses it any more, its
folder goes, unless a version the catalog still keeps has the same files.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from app.adapter_record import AdapterRecord
from app.errors import AdapterUnavailable, InvalidAdapter, LoraLandError
from app.replica import metrics as replica_metrics
from app.replica.kernel import LLMKernel

log = logging.getLogger("loraland.replica")

MAX_UNLOADABLE = 4096  # refs remembered as unloadable here (oldest forgotten first: one more failed load)
# One pool per process (a process serves one replica): concurrent adapter loads, mostly I/O and parsing.
_LOADS = ThreadPoolExecutor(8, thread_name_prefix="loraland-fetch")


class AdapterFetcher:
    """Registers catalog adapter versions with one kernel, on demand or pushed, off the event loop."""

    def __init__(
        self,
        kernel: LLMKernel,
        hub: Any,
        on_unloadable: Callable[[str, str], None] | None = None,
    ):
        self.kernel, self.hub, self.on_unloadable = kernel, hub, on_unloadable
        self.held: dict[str, str] = {}  # ref -> name, the versions registered with the kernel
        self.loading: dict[str, Future] = {}
        self.unloadable: dict[str, str] = {}  # ref -> why its load failed here (never retried)
        self.cache_keys: dict[str, str] = {}  # ref -> its disk cache entry, for the versions fetched here
        self.doomed: set[str] = set()  # refs the catalog removed whose disk cache entry goes once unused
        self._lock = threading.Lock()  # held/loading: the event loop, the catalog listener and load threads

    async def ensure_all(self, records: Iterable[AdapterRecord]) -> None:
        """Every version servable, loading the missing ones concurrently; the first failure raises once all
        have settled (a load that succeeded stays registered for the next request)."""
        results = await asyncio.gather(*(self.ensure(r) for r in records), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def ensure(self, record: AdapterRecord) -> None:
        """One version servable: registered already, or fetched and registered now (once, however many ask)."""
        reason = self.unloadable.get(record.ref) or record.unloadable
        if reason:  # a load already failed for good (here, or on a replica that marked the catalog record)
            err = InvalidAdapter(
                f"model: the adapter {record.ref!r} failed to load on this server and is marked unloadable: "
                f"{reason}. Fix it and register a new version"
            )
            err.param = "model"
            raise err
        # shield: a request that goes away does not cancel the load the others wait for
        await asyncio.shield(asyncio.wrap_future(self.start(record)))

    def start(self, record: AdapterRecord) -> Future:
        """The load of `record` (any thread): a finished future when it is held, else the one load under way."""
        ref = record.ref
        with self._lock:
            if ref in self.held and self.kernel.adapter_manager.is_live(ref):
                done: Future = Future()
                done.set_result(None)
                return done
            pending = self.loading.get(ref)
            if pending is not None:
                return pending
            timer = replica_metrics.LoadTimer(self.hub, record)  # before the load: the source is its origin
            pending = self.loading[ref] = _LOADS.submit(self._load, record)
        # outside the lock: a load that already finished runs its callbacks here, and _done takes the lock
        pending.add_done_callback(timer.finished)
        pending.add_done_callback(lambda _f: self._done(ref))
        return pending

    def _done(self, ref: str) -> None:
        with self._lock:
            self.loading.pop(ref, None)

    def _load(self, record: AdapterRecord) -> None:
        t0 = time.monotonic()
        try:
            # The kernel fetches through the hub with the catalog's checksums, now and whenever it re-reads
            # the adapter after evicting it from host memory (the disk cache may have dropped it by then).
            self.kernel.load_adapter(
                record.name, record.uri, version=record.version, files=record.files or None
            )
        except InvalidAdapter as e:  # a bad adapter stays bad: remember it here and in the catalog
            self._mark_unloadable(record.ref, str(e))
            raise
        except LoraLandError:
            raise
        except Exception as e:
            # The details (URI, local paths) go to the server log only: the tenant gets the adapter's name.
            log.warning("adapter %s: fetching %s failed: %r", record.ref, record.uri, e)
            raise AdapterUnavailable(
                f"adapter {record.ref}: its files could not be fetched ({type(e).__name__}); retry later"
            ) from e
        key = self.hub.cache_key(record.uri, record.files) if self.hub is not None else None
        with self._lock:
            self.held[record.ref] = record.name
            if key is not None:
                self.cache_keys[record.ref] = key
        if record.pinned:
            self.kernel.pin(record.name)
        log.info("loaded adapter %s from %s in %.3fs", record.ref, record.uri, time.monotonic() - t0)

    def _mark_unloadable(self, ref: str, reason: str) -> None:
        while len(self.unloadable) >= MAX_UNLOADABLE:
            self.unloadable.pop(next(iter(self.unloadable)))
        self.unloadable[ref] = reason
        if self.on_unloadable is not None:
            self.on_unloadable(ref, reason)

    # ------------------------------------------------------------------ what is held, catalog changes
    def resident(self) -> tuple[list[str], list[str]]:
        """(refs servable without a fetch: in host memory or a device slot, refs of those in a device slot),
        from the kernel's adapter manager, which knows versions. Held versions the kernel dropped (unused older
        versions) are forgotten here; those the host LRU dropped are left out: serving one means reading it
        again, and the router must not count this replica as holding it."""
        tiers = self.kernel.adapter_manager.tiers()
        manager = self.kernel.adapter_manager
        with self._lock:
            self.held = {ref: n for ref, n in self.held.items() if manager.is_live(ref)}
            held = sorted(ref for ref in self.held if ref in tiers)
        return held, [ref for ref in held if tiers[ref] == "device"]

    def refs_of(self, name: str, versions: Iterable[int] | None) -> list[str]:
        """Held refs of `name`, only those `versions` when given."""
        wanted = None if versions is None else {f"{name}@{v}" for v in versions}
        with self._lock:
            return [ref for ref, n in self.held.items() if n == name and (wanted is None or ref in wanted)]

    def versions_of(self, name: str) -> list[int]:
        """The versions of `name` held here, oldest first."""
        return sorted(int(ref.rpartition("@")[2]) for ref in self.refs_of(name, None))

    def removed(self, ref: str) -> None:
        """The catalog removed this version: retire it (requests already running finish)."""
        with self._lock:
            name = self.held.pop(ref, None)
        if name is None:
            return
        if self.kernel.adapter_manager.resolve(name) == ref:
            self.kernel.unload_adapter(name)  # the current version: the name goes (chains forget it too)
        else:
            self.kernel.adapter_manager.retire(ref)

    def pinned(self, ref: str, pinned: bool) -> None:
        name = self.held.get(ref)
        if name is not None:
            (self.kernel.pin if pinned else self.kernel.unpin)(name)

    # ------------------------------------------------------------------ the disk cache, pruned
    def removed_from_catalog(self, name: str, versions: Iterable[int] | None) -> None:
        """The catalog removed these versions of `name` (all of them: None): their disk cache entries are to go
        once no request here uses them (prune_files)."""
        prefix, wanted = f"{name}@", None if versions is None else {f"{name}@{v}" for v in versions}
        with self._lock:
            self.doomed |= {
                r for r in self.cache_keys if r.startswith(prefix) and (wanted is None or r in wanted)
            }

    def prune_files(self, catalog: Any = None) -> list[str]:
        """Delete the disk cache entries of removed versions no longer in use here (not registered with the
        kernel, nor loading), unless a version held here or (with `catalog`) kept by the catalog has the same
        files. Returns the keys deleted. Another replica sharing the cache that still needs one fetches it again."""
        manager, deleted = self.kernel.adapter_manager, []
        with self._lock:
            idle = [r for r in self.doomed if r not in manager.entries and r not in self.loading]
        for ref in idle:
            with self._lock:
                self.doomed.discard(ref)
                key = self.cache_keys.pop(ref, None)
                shared = key in self.cache_keys.values()
            if key is None or shared or (catalog is not None and self._kept(catalog, ref, key)):
                continue
            self.hub.cache.remove(key)
            deleted.append(key)
            log.info("disk cache: removed %s (%s: removed from the catalog, unused here)", key, ref)
        return deleted

    def _kept(self, catalog: Any, ref: str, key: str) -> bool:
        """Whether a version of ref's name that the catalog keeps uses the disk cache entry `key` (unknown: yes)."""
        try:
            records = catalog.versions(ref.rpartition("@")[0])
        except Exception:
            return True
        return any(self.hub.cache_key(r.uri, r.files) == key for r in records)
