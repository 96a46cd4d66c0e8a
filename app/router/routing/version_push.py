"""Fast swaps: a new version of an adapter reaches the replicas that hold the adapter before it becomes the
version its name resolves to.

The version is staged in the catalog (stored, not yet the newest; the "staged" event tells every replica); each
replica whose heartbeat lists some version of the name loads the new one beside the old (app/replica/
catalog_sync.py) and answers "warm" or "failed: why" (Catalog.note_warm). Once every such holder answered, or
PUSH_TIMEOUT_S passed, the version is promoted: requests resolved from then on carry it, and on the holders
their first one finds it loaded. Requests resolved before carry the old version and finish on it. A holder that
did not answer in time loads the new version on its first request, as before pushes existed. A replica that
picked the name up after its last heartbeat is not among the listed holders, but it answers LOADING as soon as
its push begins (before any holder can have loaded the version): the wait covers it too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from app.catalog.replicas import LOADING

log = logging.getLogger("loraland.ingress")

PUSH_TIMEOUT_S = 5.0  # the longest a runtime load waits for the holders before promoting the version anyway
# the first wait between reads of the answers, growing by half each read up to the second
POLL_S = (0.01, 0.1)
LATE_GRACE_S = 0.05  # with no holder listed, how long to look for one the heartbeats missed (its LOADING)


@dataclass(frozen=True)
class PushResult:
    ref: str  # name@version pushed
    # replicas holding some version of the name (listed when the push began, or late)
    holders: tuple[str, ...]
    warm: tuple[str, ...]  # holders that answered "warm"
    failed: tuple[str, ...]  # holders that answered "failed: ..." (they load it on demand)
    seconds: float  # from staging to the last answer (or the timeout)
    promoted: bool | None  # Catalog.promote's answer: True newest, False a newer one is, None gone

    @property
    def summary(self) -> str:
        """`warm/holders` as the response header gives it."""
        return f"{len(self.warm)}/{len(self.holders)}"


async def wait_for_holders(
    catalog: Any, ref: str, holders: list[str], timeout_s: float = PUSH_TIMEOUT_S
) -> tuple[dict[str, str], float]:
    """The answers to the push of `ref` (replica id -> outcome, LOADING for one still loading) once the `holders`
    and any replica that answered LOADING (one the heartbeats did not list yet) gave a final answer or
    `timeout_s` passed, and the seconds waited. With no holder listed, looks for such a replica for
    LATE_GRACE_S. Reads the answers at growing intervals (POLL_S): a push takes ~0.1 s."""
    t0, pause = time.monotonic(), POLL_S[0]
    while True:
        answers = await asyncio.to_thread(catalog.warm_acks, ref)
        waited, elapsed = set(holders) | set(answers), time.monotonic() - t0
        final = all(answers.get(h, LOADING) != LOADING for h in waited)
        if (final and (waited or elapsed >= LATE_GRACE_S)) or elapsed >= timeout_s:
            break
        await asyncio.sleep(pause)
        pause = min(POLL_S[1], pause * 1.5)
    return answers, time.monotonic() - t0


async def push_and_promote(
    catalog: Any, record: Any, holders: list[str] | None, timeout_s: float = PUSH_TIMEOUT_S
) -> PushResult:
    """Wait for the `holders` (Catalog.holders, read before staging `record`; None: a new name, nobody holds
    it) to load the staged `record`, then promote it. Logs how long the holders took."""
    answers, seconds = (
        ({}, 0.0) if holders is None else await wait_for_holders(catalog, record.ref, holders, timeout_s)
    )
    holders = holders or []
    promoted = await asyncio.to_thread(catalog.promote, record.ref)
    warm = tuple(h for h, a in answers.items() if a == "warm")
    failed = tuple(h for h, a in answers.items() if a not in ("warm", LOADING))
    late = sorted(set(answers) - set(holders))  # holders the heartbeats had not listed yet
    result = PushResult(record.ref, (*holders, *late), warm, failed, seconds, promoted)
    if result.holders:
        log.info("pushed %s: warm on %s holding replicas after %.3fs%s", record.ref, result.summary, seconds,
                 f" (failed: {', '.join(failed)})" if failed else "")  # fmt: skip
    return result
