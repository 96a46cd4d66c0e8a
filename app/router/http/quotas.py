"""Cluster-wide quotas at the ingress: each request is checked against its tenant's and its adapters' quotas
(app/catalog/quotas.py) before it goes to a replica, and given back when its reply ends.

Admission is one Redis script call over every bucket the request touches, so all ingress replicas share one
limit. Tokens: at admission the request reserves its prompt (counted exactly for token-id prompts, estimated
as UTF-8 bytes / 4 for text, since the ingress has no tokenizer) plus max_tokens x n per prompt; when the reply
ends the reservation is settled against the usage the replica reported, so a minute's tokens are exact after
the fact and an estimate only delays admission, never adds to the count. Over a limit: QuotaExceeded (429) with
Retry-After from the bucket; a reservation larger than a whole minute's tokens is a 400 (waiting cannot help).
The reply gives its concurrency lease back as it ends (before the response completes, so a client running one
request at a time never trips its own concurrency limit); the lease is renewed while the reply runs, and a
crashed ingress's leases run out after LEASE_TTL_S.

When Redis is unreachable each ingress falls back to local buckets with the last quotas it read (refreshed in
full every SNAPSHOT_REFRESH_S, and per scope on every admission), each limit divided by the number of ingress
replicas (AppConfig.ingress_replicas), local buckets starting full at every outage; so the cluster as a whole
keeps to about the quota, and never to none. An ingress that never read the quotas refuses requests that have a
tenant or adapter with 503 rather than guess. Redis is tried again every REDIS_RETRY_S.

The admin routes that read and set quotas are app/router/http/quota_routes.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from app.catalog.quotas import Admission, Quota, describe_scope
from app.errors import CatalogUnavailable, InvalidRequest, QuotaExceeded
from app.protocol import ReplicaRequest
from app.router.http.quota_fallback import LocalBuckets

log = logging.getLogger("loraland.quotas")

LEASE_TTL_S = 30.0  # a crashed ingress's concurrency slots free themselves after this long
REDIS_RETRY_S = 2.0  # after Redis failed, enforce locally this long before trying it again
SNAPSHOT_REFRESH_S = 30.0  # how often every quota is re-read, for the fallback to know tenants not yet seen


def reserve_tokens(request: ReplicaRequest) -> int:
    """Tokens a request reserves at admission: its prompt(s) plus max_tokens for each of its n samples."""
    max_tokens = request.sampling.max_tokens

    def text(s: str) -> int:  # about 4 bytes a token for BPE vocabularies, plus BOS
        return -(-len(s.encode()) // 4) + 1

    if request.messages is not None:  # one prompt; ~4 template tokens around each message
        prompts = [sum(text(m.get("content") or "") + 4 for m in request.messages)]
    else:
        prompts = [len(p) if isinstance(p, tuple) else text(p) for p in request.prompts]
    return sum(prompts) + len(prompts) * request.n * max_tokens


def scopes_of(request: ReplicaRequest) -> list[str]:
    """The quota scopes a request counts against: its tenant, and each adapter it uses (by name)."""
    sids = [f"tenant:{request.tenant}"] if request.tenant else []
    for record in request.records:
        sid = f"adapter:{record.name}"
        if sid not in sids:
            sids.append(sid)
    return sids


@dataclass
class Ticket:
    lease: str
    scopes: list[str]
    reserved: int
    n: int
    via_redis: bool = True
    leased: list[str] = field(default_factory=list)  # scopes whose Redis concurrency lease it holds


class QuotaLimiter:
    """Quota checks of one ingress. `catalog` is the ingress's CatalogProxy; without a configured catalog
    nothing can set a quota, so every request passes."""

    def __init__(self, catalog: Any, *, ingress_replicas: int = 1, lease_ttl_s: float = LEASE_TTL_S,
                 redis_retry_s: float = REDIS_RETRY_S):  # fmt: skip
        self.catalog, self.lease_ttl_s, self.redis_retry_s = catalog, lease_ttl_s, redis_retry_s
        self.enabled = bool(getattr(catalog, "url", None))
        self.local = LocalBuckets(ingress_replicas)
        self._known: dict[str, Quota | None] = {}  # last quota read per scope, for the fallback
        self._snapshot_at: float | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._inflight: Counter[str] = Counter()  # requests in progress on this ingress, per scope
        self._held: dict[str, Ticket] = {}  # tickets holding Redis leases, renewed by the thread below
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loraland-quota")

    @classmethod
    def for_service(cls, service: Any) -> QuotaLimiter:
        return cls(service.catalog, ingress_replicas=service.cfg.ingress_replicas)

    @property
    def redis_down(self) -> bool:
        return time.monotonic() < self._down_until

    async def admit(self, stream: Any) -> Any:
        """Admit the request of `stream` (a ReplicaStream not yet started) or raise QuotaExceeded; returns the
        stream to use, which gives the quota back when the reply ends."""
        request: ReplicaRequest = stream.request
        sids = scopes_of(request)
        if not self.enabled or not sids:
            return stream
        ticket = Ticket(uuid.uuid4().hex, sids, reserve_tokens(request), request.n)
        adm = await asyncio.to_thread(self._admit_redis, ticket)
        if adm is None:
            ticket.via_redis = False
            adm = self._admit_local(ticket)
        if not adm.admitted:
            raise self._refusal(adm, ticket)
        with self._lock:
            self._inflight.update(sids)
            if ticket.via_redis:
                ticket.leased = [s for s in sids if (q := adm.quotas.get(s)) and q.concurrent]
                if ticket.leased:
                    self._held[ticket.lease] = ticket
                    self._start_renewer()
        return QuotaStream(stream, self, ticket)

    def _admit_redis(self, ticket: Ticket) -> Admission | None:
        if self.redis_down:
            return None
        try:
            cat = self.catalog.get()
            if self._snapshot_at is None or time.monotonic() - self._snapshot_at > SNAPSHOT_REFRESH_S:
                snapshot = cat.quotas()
                with self._lock:
                    self._known, self._snapshot_at = dict(snapshot), time.monotonic()
            adm = cat.admit_quota(ticket.scopes, ticket.reserved, ticket.lease, self.lease_ttl_s)
        except CatalogUnavailable as e:
            if not self.redis_down:
                log.warning("quotas: %s; enforcing local per-ingress shares of the last known quotas", e)
                with self._lock:
                    self.local = LocalBuckets(self.local.replicas)  # each outage starts with full shares
            self._down_until = time.monotonic() + self.redis_retry_s
            return None
        with self._lock:
            self._known.update(adm.quotas)
        return adm

    def _admit_local(self, ticket: Ticket) -> Admission:
        with self._lock:
            if self._snapshot_at is None and any(s not in self._known for s in ticket.scopes):
                raise CatalogUnavailable(
                    "quotas cannot be checked: the catalog (Redis) is unreachable and this ingress has not "
                    "read the quotas yet; retry once Redis is back"
                )
            quotas = {s: self._known.get(s) for s in ticket.scopes}
            return self.local.admit(ticket.scopes, quotas, ticket.reserved, self._inflight)

    def _refusal(self, adm: Admission, ticket: Ticket) -> Exception:
        who = describe_scope(adm.scope or "")
        if adm.impossible:
            return InvalidRequest(
                f"max_tokens: the request reserves {ticket.reserved} tokens (prompt + max_tokens x n), more than "
                f"{who}'s whole quota of {adm.value} tokens/minute; lower max_tokens or n"
            )
        retry = max(1, math.ceil(adm.wait_s - 1e-9))
        if adm.limit == "concurrent":
            msg = f"{who} is at its quota of {adm.value} concurrent requests; retry after {retry} s"
        else:
            unit = "requests/minute" if adm.limit == "requests_per_minute" else "tokens/minute"
            msg = f"{who} is over its {adm.value} {unit} quota; retry after {retry} s"
        if not ticket.via_redis:
            msg += (f" (the catalog is unreachable: each of the {self.local.replicas} ingress replicas "
                    "enforces its share of the quota)")  # fmt: skip
        return QuotaExceeded(msg, retry_after_s=float(retry))

    # ------------------------------------------------------------------ the end of a request
    def finish(self, ticket: Ticket, stream: Any) -> None:
        """Give the ticket back: free its slots, settle its tokens against the usage `stream` saw."""
        prompt = sum(c.prompt_tokens for i, c in stream.choices.items() if i % ticket.n == 0)
        used = prompt + sum(c.completion_tokens for c in stream.choices.values())
        with self._lock:
            self._inflight.subtract(ticket.scopes)
            self._held.pop(ticket.lease, None)
            if not ticket.via_redis:
                self.local.settle(ticket.scopes, self._known, ticket.reserved - used)
                return
        if self.redis_down:
            return  # its leases run out by themselves; its reservation stays charged
        try:
            self.catalog.get().settle_quota(ticket.scopes, ticket.lease, ticket.reserved - used)
        except CatalogUnavailable as e:
            log.info(
                "quotas: could not settle request %s (%s); its leases run out by themselves", ticket.lease, e
            )

    def finish_soon(self, ticket: Ticket, stream: Any) -> None:
        try:
            self._pool.submit(self.finish, ticket, stream)
        except RuntimeError:  # the pool is shut down (interpreter exit): nothing left to give back to
            pass

    def _start_renewer(self) -> None:
        if self._renewer is None or not self._renewer.is_alive():
            self._renewer = threading.Thread(target=self._renew, name="loraland-quota-leases", daemon=True)
            self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_ttl_s / 3):
            with self._lock:
                held = [(s, t.lease) for t in self._held.values() for s in t.leased]
            if held and not self.redis_down:
                try:
                    self.catalog.get().renew_leases(held, self.lease_ttl_s)
                except CatalogUnavailable as e:
                    log.info("quotas: could not renew %d leases (%s)", len(held), e)

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False)


class QuotaStream:
    """A ReplicaStream that gives its quota ticket back once: when the reply ends, fails or is cancelled, or as
    a last resort when it is garbage collected unread (a client gone before the body started)."""

    def __init__(self, stream: Any, limiter: QuotaLimiter, ticket: Ticket):
        self._stream, self._limiter, self._ticket = stream, limiter, ticket
        self._pending = weakref.finalize(self, limiter.finish_soon, ticket, stream)
        self._pending.atexit = False

    def __getattr__(self, name: str) -> Any:  # request, choices, replica
        return getattr(self._stream, name)

    async def _finish(self) -> None:
        if self._pending.detach():
            await asyncio.to_thread(self._limiter.finish, self._ticket, self._stream)

    def _finish_soon(self) -> None:
        if self._pending.detach():
            self._limiter.finish_soon(self._ticket, self._stream)

    async def open(self) -> Any:
        try:
            return await self._stream.open()
        except Exception:
            await self._finish()
            raise
        except BaseException:  # cancelled: do not await anything more
            self._finish_soon()
            raise

    async def next(self) -> Any:
        try:
            item = await self._stream.next()
        except Exception:
            await self._finish()
            raise
        except BaseException:
            self._finish_soon()
            raise
        if item is None:
            await self._finish()
        return item

    async def collect(self) -> Any:
        try:
            choices = await self._stream.collect()
        except Exception:
            await self._finish()
            raise
        except BaseException:
            self._finish_soon()
            raise
        await self._finish()
        return choices

    def cancel(self) -> None:
        self._stream.cancel()
        self._finish_soon()
