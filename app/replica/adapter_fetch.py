"""The adapter versions a replica has registered with its kernel, and fetching the ones a request lacks.

Each version is fetched (verified against the catalog's sha256s by the hub) and registered once: requests that
need a version being loaded wait for that same load, and a request's cold adapters load concurrently (a merge
of three cold adapters costs about one load, not three). A version that failed to load for good (a bad adapter
stays bad) is remembered here and, through `on_unloadable`, in the catalog, so no replica tries it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from app.adapter_record import AdapterRecord
from app.errors import AdapterUnavailable, InvalidAdapter, LoraLandError
from app.replica import metrics as replica_metrics
from app.replica.kernel import LLMKernel
from app.replica.results import KernelStats

log = logging.getLogger("loraland.replica")

MAX_UNLOADABLE = 4096  # refs remembered as unloadable here (oldest forgotten first: one more failed load)


class AdapterFetcher:
    """Registers catalog adapter versions with one kernel, on demand, off the event loop."""

    def __init__(
        self,
        kernel: LLMKernel,
        hub: Any,
        on_unloadable: Callable[[str, str], Awaitable[None]] | None = None,
    ):
        self.kernel, self.hub, self.on_unloadable = kernel, hub, on_unloadable
        self.held: dict[str, str] = {}  # ref -> name, the versions registered with the kernel
        self.loading: dict[str, asyncio.Future] = {}
        self.unloadable: dict[str, str] = {}  # ref -> why its load failed here (never retried)

    async def ensure_all(self, records: Iterable[AdapterRecord]) -> None:
        """Every version servable, loading the missing ones concurrently; the first failure raises once all
        have settled (a load that succeeded stays registered for the next request)."""
        results = await asyncio.gather(*(self.ensure(r) for r in records), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def ensure(self, record: AdapterRecord) -> None:
        """One version servable: registered already, or fetched and registered now (once, however many ask)."""
        ref = record.ref
        if ref in self.held:
            return
        reason = self.unloadable.get(ref) or record.unloadable
        if reason:  # a load already failed for good (here, or on a replica that marked the catalog record)
            err = InvalidAdapter(
                f"model: the adapter {ref!r} failed to load on this server and is marked unloadable: "
                f"{reason}. Fix it and register a new version"
            )
            err.param = "model"
            raise err
        pending = self.loading.get(ref)
        if pending is None:
            timer = replica_metrics.LoadTimer(self.hub, record)  # before the load: the source is its origin
            pending = asyncio.ensure_future(self._load(record))
            pending.add_done_callback(timer.finished)
            self.loading[ref] = pending
            pending.add_done_callback(lambda _f: self.loading.pop(ref, None))
        await asyncio.shield(pending)

    async def _load(self, record: AdapterRecord) -> None:
        t0 = time.monotonic()
        try:
            # The kernel fetches through the hub with the catalog's checksums, now and whenever it re-reads
            # the adapter after evicting it from host memory (the disk cache may have dropped it by then).
            await asyncio.to_thread(
                self.kernel.load_adapter,
                record.name,
                record.uri,
                version=record.version,
                files=record.files or None,
            )
        except InvalidAdapter as e:  # a bad adapter stays bad: remember it here and in the catalog
            await self._mark_unloadable(record.ref, str(e))
            raise
        except LoraLandError:
            raise
        except Exception as e:
            # The details (URI, local paths) go to the server log only: the tenant gets the adapter's name.
            log.warning("adapter %s: fetching %s failed: %r", record.ref, record.uri, e)
            raise AdapterUnavailable(
                f"adapter {record.ref}: its files could not be fetched ({type(e).__name__}); retry later"
            ) from e
        # The kernel keeps one live version per name: registering v2 retired v1 for new requests.
        for old in [r for r, n in self.held.items() if n == record.name and r != record.ref]:
            self.held.pop(old, None)
        self.held[record.ref] = record.name
        if record.pinned:
            self.kernel.pin(record.name)
        log.info("loaded adapter %s from %s in %.3fs", record.ref, record.uri, time.monotonic() - t0)

    async def _mark_unloadable(self, ref: str, reason: str) -> None:
        while len(self.unloadable) >= MAX_UNLOADABLE:
            self.unloadable.pop(next(iter(self.unloadable)))
        self.unloadable[ref] = reason
        if self.on_unloadable is not None:
            await self.on_unloadable(ref, reason)

    # ------------------------------------------------------------------ what is held, catalog changes
    def resident(self, stats: KernelStats) -> tuple[list[str], list[str]]:
        """(refs servable without a fetch: in host memory or a device slot, refs of those in a device slot).
        The kernel reports bare names. Registered versions the host LRU dropped are left out: serving one
        means reading it again, and the router must not count this replica as holding it."""
        in_memory, on_device = set(stats.in_memory), set(stats.resident)
        held = sorted(ref for ref, name in self.held.items() if name in in_memory)
        return held, [ref for ref in held if self.held[ref] in on_device]

    def refs_of(self, name: str, versions: Iterable[int] | None) -> list[str]:
        """Held refs of `name`, only those `versions` when given."""
        wanted = None if versions is None else {f"{name}@{v}" for v in versions}
        return [ref for ref, n in self.held.items() if n == name and (wanted is None or ref in wanted)]

    def removed(self, ref: str) -> None:
        """The catalog removed this version: unload it (requests already running finish)."""
        name = self.held.pop(ref, None)
        if name is not None:
            self.kernel.unload_adapter(name)

    def pinned(self, ref: str, pinned: bool) -> None:
        name = self.held.get(ref)
        if name is not None:
            (self.kernel.pin if pinned else self.kernel.unpin)(name)
