"""The ingress's side of app/protocol.py: send a `ReplicaRequest` to some replica and read its reply stream.

A Backend streams a request's reply items from a replica: Ray Serve's handle in production (`ServeBackend`; the
router reads the request's adapters from the ReplicaRequest itself), or a ReplicaCore in the same process for
tests of the HTTP layer (app/replica/deployment.py's LocalBackend). `ReplicaStream` turns the items into
ChoiceDeltas (a DeltaBatch into its deltas, one at a time), raises a replica's in-band Failure as the exception
it names (`Failure.to_exception`; the HTTP edge maps it through the same table as any exception), and sends the
request again, up to MAX_ATTEMPTS times in all, when its replica died before it produced output (counted in
loraland_replica_retries). `call` does the same for a replica's unary methods. With app/replica/deployment.py
this is the Ray edge: nowhere else does a `Failure` appear.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

from app import metrics
from app.errors import LoraLandError
from app.protocol import ChoiceDelta, DeltaBatch, Failure, ReplicaHello, ReplicaRequest, ReplyItem
from app.router.http.errors import replica_failed

log = logging.getLogger("loraland.ingress")

# Attempts per request when replicas die under it before any output (a node loss can take several replicas at
# once); between attempts a short pause lets the router hear of the death and the deployment start a replacement.
MAX_ATTEMPTS = 3
RETRY_PAUSE_S = (0.05, 0.25)

# A deadline for one read without a Task per read (asyncio.wait_for makes one before Python 3.12): a read per
# token makes that measurable in the ingress.
_timeout = getattr(asyncio, "timeout", None)


class Backend(Protocol):
    def stream(self, request: ReplicaRequest) -> AsyncIterator[ReplyItem]: ...

    async def call(self, method: str, *args: Any) -> Any: ...


async def call(backend: Backend, method: str, *args: Any) -> Any:
    """A replica method's result; its in-band Failure raises as the exception it names."""
    result = await backend.call(method, *args)
    if isinstance(result, Failure):
        raise result.to_exception()
    return result


class ServeBackend:
    """Calls the replica deployment; the adapter ref rides as the multiplexed model id for the router."""

    def __init__(self, handle: Any):
        self.handle = handle

    def stream(self, request: ReplicaRequest) -> AsyncIterator[ReplyItem]:
        # The model id rides as the multiplexed id for Serve's metrics and logs; the router reads request.spec.
        return self.handle.options(stream=True, multiplexed_model_id=request.model_id).generate.remote(
            request
        )

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.handle, method).remote(*args)


class ReplicaStream:
    """One request's reply from a replica: `open()` for the first delta, `next()` until None, `cancel()` to
    stop early; or `collect()` for all of it. `choices` accumulates every delta read so far, per choice index
    (their finish reasons are the kernel's: app/router/http/openai_responses.finish_reason shapes them for OpenAI)."""

    def __init__(self, backend: Backend, request: ReplicaRequest, timeout_s: float):
        self.backend, self.request, self.timeout_s = backend, request, timeout_s
        self.replica: str | None = None  # which replica answered (ReplicaHello)
        self.choices: dict[int, ChoiceDelta] = {}
        self.first_delta_at: float | None = None  # time.monotonic() of the first delta read (TTFT)
        self._items: AsyncIterator[ReplyItem] | None = None
        self._ready: deque[ChoiceDelta] = deque()  # read but not yet handed out (the rest of a DeltaBatch)
        self._done = False
        self._deaths = 0  # replicas that died under this request before it produced output

    async def open(self) -> ChoiceDelta:
        """Start the request and read its first delta (or failure), again on another replica if its replica died
        first (MAX_ATTEMPTS in all)."""
        while True:
            self._start()
            try:
                item = await self._read()
                if isinstance(item, ReplicaHello):
                    self.replica = item.replica_id
                    item = await self._read()
                self._take(item)
                return self._ready.popleft()
            except StopAsyncIteration:
                raise LoraLandError(
                    "the replica ended the reply before any output; retry the request"
                ) from None
            except Exception as e:
                self.cancel()
                if await self._again_after(e):
                    continue
                raise

    async def next(self) -> ChoiceDelta | None:
        """The next delta, or None when the reply is complete; a Failure raises the exception it names."""
        if not self._ready:
            try:
                item = await self._read()
            except StopAsyncIteration:
                self._done = True
                return None
            self._take(item)
        return self._ready.popleft()

    async def collect(self) -> dict[int, ChoiceDelta]:
        """Run to completion; a replica death mid-way sends it again (nothing was sent to the client yet), up to
        MAX_ATTEMPTS deaths in all, `open`'s included."""
        while True:
            try:
                await self.open()
                while await self.next() is not None:
                    pass
                return self.choices
            except Exception as e:
                self.cancel()
                if await self._again_after(e):
                    continue
                raise
        raise AssertionError("unreachable")

    def cancel(self) -> None:
        """Stop a stream we no longer read (Serve's generator has cancel(); a local one has aclose())."""
        stream, self._items = self._items, None
        if stream is None or self._done:
            return
        cancel = getattr(stream, "cancel", None)
        if callable(cancel):
            try:
                cancel()
            except Exception:
                pass
        elif hasattr(stream, "aclose"):
            asyncio.ensure_future(stream.aclose())

    # ------------------------------------------------------------------ internals
    async def _again_after(self, exc: BaseException) -> bool:
        """Whether to send the request again after `exc` ended an attempt: only when its replica died, and while
        attempts remain (then after a short pause, for the router to hear of the death). Counts the outcome."""
        if not replica_failed(exc) or self._deaths >= MAX_ATTEMPTS:  # not a death, or given up already
            return False
        self._deaths += 1
        rid = self.request.request_id
        if self._deaths >= MAX_ATTEMPTS:
            metrics.REPLICA_RETRIES.labels("gave_up").inc()
            log.warning("a replica died under %s on each of %d attempts; giving up", rid, MAX_ATTEMPTS)
            return False
        metrics.REPLICA_RETRIES.labels("retried").inc()
        log.warning("replica died before answering %s; sending it again (attempt %d)", rid, self._deaths + 1)
        await asyncio.sleep(RETRY_PAUSE_S[min(self._deaths, len(RETRY_PAUSE_S)) - 1])
        return True

    def _start(self) -> None:
        self.replica, self.choices, self._done, self.first_delta_at = None, {}, False, None
        self._ready.clear()
        self._items = self.backend.stream(self.request)

    async def _read(self) -> ReplyItem:
        if self._items is None:
            raise LoraLandError("the replica stream was cancelled; open the request again")
        if _timeout is None:
            return await asyncio.wait_for(self._items.__anext__(), timeout=self.timeout_s)
        async with _timeout(self.timeout_s):
            return await self._items.__anext__()

    def _take(self, item: ReplyItem) -> None:
        """Record a reply item's deltas in `choices` and queue them for the caller; a Failure raises."""
        if isinstance(item, Failure):
            raise item.to_exception()
        if isinstance(item, DeltaBatch):
            for delta in item.deltas:
                self._take(delta)
            return
        if not isinstance(item, ChoiceDelta):
            raise LoraLandError(f"the replica sent {type(item).__name__} where a ChoiceDelta belongs")
        if self.first_delta_at is None:
            self.first_delta_at = time.monotonic()
        held = self.choices.get(item.index)
        if held is None:  # a copy: the caller may still read `item` after later deltas fold into ours
            logprobs = None if item.logprobs is None else list(item.logprobs)
            self.choices[item.index] = dataclasses.replace(item, logprobs=logprobs)
        else:
            held.merge(item)
        self._ready.append(item)
