"""Fast swaps: a new version of an adapter reaches the replicas that hold the adapter before it becomes the
version its name resolves to.

The version is staged in the catalog (stored, not yet the newest; the "staged" event tells every replica); each
replica whose heartbeat lists some version of the name loads the new one beside the old (app/replica/
catalog_sync.py) and answers "warm" or "failed: why" (Catalog.note_warm). Once every such holder answered, or
PUSH_TIMEOUT_S passed, the version is promoted: requests resolved from then on carry it, and on the holders
their first one finds it loaded. Requests resolved before carry the old version and finish on it. A holder that
did not answer in time loads the new version on its first request, as before pushes existed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("loraland.ingress")

PUSH_TIMEOUT_S = 5.0  # the longest a runtime load waits for the holders before promoting the version anyway
POLL_S = 0.02


@dataclass(frozen=True)
class PushResult:
    ref: str  # name@version pushed
    holders: tuple[str, ...]  # replicas holding some version of the name when the push began
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
    """The holders' answers to the push of `ref` (replica id -> outcome) once all answered or `timeout_s`
    passed, and the seconds waited."""
    t0 = time.monotonic()
    answers: dict[str, str] = {}
    while holders:
        answers = await asyncio.to_thread(catalog.warm_acks, ref)
        if all(h in answers for h in holders) or time.monotonic() - t0 >= timeout_s:
            break
        await asyncio.sleep(POLL_S)
    return {h: answers[h] for h in holders if h in answers}, time.monotonic() - t0


async def push_and_promote(
    catalog: Any, record: Any, holders: list[str], timeout_s: float = PUSH_TIMEOUT_S
) -> PushResult:
    """Wait for the `holders` (Catalog.holders, read before staging `record`) to load the staged `record`, then
    promote it. Logs how long the holders took."""
    answers, seconds = await wait_for_holders(catalog, record.ref, holders, timeout_s)
    promoted = await asyncio.to_thread(catalog.promote, record.ref)
    warm = tuple(h for h, a in answers.items() if a == "warm")
    failed = tuple(h for h, a in answers.items() if a != "warm")
    result = PushResult(record.ref, tuple(holders), warm, failed, seconds, promoted)
    if holders:
        log.info("pushed %s: warm on %s holding replicas after %.3fs%s", record.ref, result.summary, seconds,
                 f" (failed: {', '.join(failed)})" if failed else "")  # fmt: skip
    return result
