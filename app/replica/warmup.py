"""A replica's agreement with the catalog beyond pub/sub: warm the hot adapters before taking traffic, and
drop adapters whose record is gone even when the "removed" event never arrived.

Hot means held by the most live replicas (the placement the heartbeats report; pinned adapters are never
evicted, so they count everywhere they were loaded). A replica started by autoscaling or replacing a dead one
loads the newest version of each before Serve routes to it, so a scale-up meets no storm of cold loads.

Redis pub/sub is fire-and-forget: a replica that was reconnecting, or busy starting, misses events. The
reconciliation pass (every heartbeat TTL) is the fallback that bounds how long a removed adapter can linger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from app.adapter_record import AdapterRecord
from app.replica.adapter_fetch import AdapterFetcher

log = logging.getLogger("loraland.replica")

WARM_TIMEOUT_S = 120.0  # a replica that cannot warm in this long starts anyway: cold loads beat no replica
WARM_CONCURRENCY = 4


def hot_records(catalog: Any, limit: int) -> list[AdapterRecord]:
    """The newest loadable version of the `limit` adapter names the most live replicas hold."""
    if limit <= 0 or catalog is None:
        return []
    counts: Counter[str] = Counter()
    for info in catalog.replicas().values():
        counts.update({ref.partition("@")[0] for ref in info.resident if "|" not in ref and "*" not in ref})
    out = []
    for name, _ in counts.most_common():
        record = catalog.get(name)
        if record is not None and not record.unloadable:
            out.append(record)
            if len(out) == limit:
                break
    return out


async def warm_up(
    catalog: Any, fetcher: AdapterFetcher, limit: int, timeout_s: float = WARM_TIMEOUT_S
) -> list[str]:
    """Load the hot adapters through `fetcher`; returns the refs loaded. Failures are logged, not raised: a
    replica that cannot warm still serves, loading on demand."""
    t0 = time.monotonic()
    try:
        records = await asyncio.to_thread(hot_records, catalog, limit)
    except Exception as e:
        log.warning("warm-up skipped: cannot read the placement (%s)", e)
        return []
    gate = asyncio.Semaphore(WARM_CONCURRENCY)

    async def one(record: AdapterRecord) -> str | None:
        async with gate:
            try:
                await fetcher.ensure(record)
                return record.ref
            except Exception as e:
                log.warning("warm-up: %s not loaded (%s); it loads on first use", record.ref, e)
                return None

    try:
        done = await asyncio.wait_for(asyncio.gather(*(one(r) for r in records)), timeout_s)
    except asyncio.TimeoutError:
        log.warning("warm-up stopped after %.0fs; the rest load on first use", timeout_s)
        done = []
    warmed = [ref for ref in done if ref]
    log.info("warmed %d/%d hot adapters in %.2fs", len(warmed), len(records), time.monotonic() - t0)
    return warmed


def stale_refs(catalog: Any, held: dict[str, str]) -> list[str]:
    """Refs this replica holds whose catalog record is gone (removed while its event was missed)."""
    return [ref for ref in list(held) if catalog.get(ref) is None]
