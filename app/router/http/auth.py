"""Who is calling: `Authorization: Bearer <key>` → tenant (through the catalog), or the admin token.

A rotated or deleted key stops working at once on every ingress: the catalog publishes `key_rotated` /
`tenant_deleted` on its pub/sub channel and each Authenticator drops that tenant's cached keys when it hears it.
Pub/sub is fire-and-forget (an event sent while the listener is reconnecting is lost), so a cached key is also
trusted for at most KEY_CACHE_TTL_S: that is the bound on how long an old key can keep working anywhere.

Guessing is throttled (BadKeyThrottle): each source address may fail BAD_KEY_BURST times, then once per
1 / BAD_KEY_PER_S seconds; past that, a key this ingress has not seen valid gets 429 with Retry-After and no
catalog lookup, while keys it has seen valid still pass (a client behind the same NAT as a guesser keeps working).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.router.http.errors import HTTPFailure

log = logging.getLogger("loraland.auth")

# The longest a cached key is believed without asking the catalog again; only matters when a key-change event
# was lost (pub/sub down or reconnecting). A lookup is one HGET, so even a hot key costs one per 2 s.
KEY_CACHE_TTL_S = 2.0
WATCH_RETRY_S = 5.0  # how often to retry subscribing to key-change events while the catalog is away
KEY_EVENTS = frozenset({"key_rotated", "tenant_deleted"})
BAD_KEY_BURST = 20  # failed authentications a source address may make at once ...
BAD_KEY_PER_S = 1.0  # ... and then this many a second


class KeyLookup(Protocol):
    """The catalog as auth sees it; `subscribe(callback) -> stop` is optional (key-change events)."""

    def tenant_for_key(self, api_key: str) -> str | None: ...


@dataclass(frozen=True)
class Caller:
    """`tenant` None means unrestricted (the admin, or anyone when auth is off)."""

    tenant: str | None
    admin: bool = False


_ANONYMOUS = Caller(tenant=None, admin=True)


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class BadKeyThrottle:
    """A token bucket of failed authentications per source address (at most `max_sources` remembered, the
    least recently failing forgotten first)."""

    def __init__(self, burst: int = BAD_KEY_BURST, per_s: float = BAD_KEY_PER_S, max_sources: int = 10_000):
        self.burst, self.per_s, self.max_sources = burst, per_s, max_sources
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (tokens, at)
        self._lock = threading.Lock()

    def _tokens(self, source: str, now: float) -> float:
        tokens, at = self._buckets.get(source, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) * self.per_s)

    def wait_s(self, source: str | None) -> float:
        """Seconds until `source` may try another unknown key; 0: now."""
        if source is None:
            return 0.0
        with self._lock:
            tokens = self._tokens(source, time.monotonic())
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.per_s

    def failed(self, source: str | None) -> None:
        if source is None:
            return
        now = time.monotonic()
        with self._lock:
            self._buckets[source] = (max(0.0, self._tokens(source, now) - 1.0), now)
            self._buckets.move_to_end(source)
            while len(self._buckets) > self.max_sources:
                self._buckets.popitem(last=False)


def source_of(request: Any) -> str | None:
    """The peer address of a Starlette request (Serve's proxy passes the client's through)."""
    client = getattr(request, "client", None)
    return client.host if client is not None else None


class Authenticator:
    """Resolves callers; remembers recent key lookups (KEY_CACHE_TTL_S) so a Redis blip does not log every
    tenant out, and forgets a tenant's keys the moment the catalog says they changed."""

    def __init__(
        self,
        keys: KeyLookup | None,
        admin_token: str | None,
        *,
        no_auth: bool = False,
        cache_ttl_s: float = KEY_CACHE_TTL_S,
        cache_size: int = 4096,
        watch: bool = True,
    ):
        if not no_auth and keys is None and not admin_token:
            raise ValueError(
                "auth is on but there is neither a catalog nor an admin token: pass --no-auth or both"
            )
        self.no_auth = no_auth
        self._keys = keys
        self._admin_token = admin_token
        self._ttl = cache_ttl_s
        self._size = cache_size
        self._cache: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()  # events arrive on the pub/sub thread, lookups on the event loop
        self._generation = 0  # bumped by every key event: a lookup that raced one is not cached
        self._closed = threading.Event()
        self._unwatch: Callable[[], None] | None = None
        self.throttle = BadKeyThrottle()
        if no_auth:
            log.warning(
                "AUTHENTICATION IS OFF (--no-auth): every caller can use every adapter and the admin routes. "
                "Use this only for a local demo."
            )
        elif watch and keys is not None and callable(getattr(keys, "subscribe", None)):
            # In the background: the catalog may be down at start, and the ingress must start anyway.
            threading.Thread(target=self._watch, name="loraland-auth-events", daemon=True).start()

    # ------------------------------------------------------------------ key-change events
    def _watch(self) -> None:
        failed = False
        while not self._closed.is_set():
            try:
                stop = self._keys.subscribe(self._on_event)  # type: ignore[union-attr]
            except Exception as e:
                if not failed:  # once per outage, not at every retry
                    log.warning(
                        "cannot subscribe to API-key changes (%s); until then a rotated key may keep working "
                        "for up to %.0f s; retrying every %.0f s",
                        e,
                        self._ttl,
                        WATCH_RETRY_S,
                    )
                failed = True
                self._closed.wait(WATCH_RETRY_S)
                continue
            if failed:
                log.info("subscribed to API-key changes")
            # Keys cached before the subscription was confirmed may have changed unheard: KEY_CACHE_TTL_S bounds
            # them, and dropping them here would log tenants out if Redis went away right after.
            if self._closed.is_set():
                stop()
            else:
                self._unwatch = stop
            return

    def _on_event(self, event: dict) -> None:
        if event.get("type") in KEY_EVENTS:
            self.forget(event.get("tenant"))

    def forget(self, tenant: str | None = None) -> None:
        """Drop cached keys of `tenant` (every tenant when None); the next request asks the catalog."""
        with self._lock:
            self._generation += 1
            for token in [t for t, (who, _) in self._cache.items() if tenant is None or who == tenant]:
                del self._cache[token]

    def close(self) -> None:
        self._closed.set()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    # ------------------------------------------------------------------ lookups
    def _is_admin_token(self, token: str) -> bool:
        return bool(self._admin_token) and hmac.compare_digest(token.encode(), self._admin_token.encode())

    def _tenant(self, token: str) -> str | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(token)
            if hit is not None and now - hit[1] < self._ttl:
                self._cache.move_to_end(token)
                return hit[0]
            generation = self._generation
        if self._keys is None:
            return None
        try:
            tenant = self._keys.tenant_for_key(token)
        except Exception:
            if hit is not None:  # the catalog is down: a key that was valid a moment ago stays valid
                return hit[0]
            raise
        with self._lock:
            if tenant is None:
                self._cache.pop(token, None)
            elif generation == self._generation:  # no key event since the lookup began
                self._cache[token] = (tenant, now)
                self._cache.move_to_end(token)
                while len(self._cache) > self._size:
                    self._cache.popitem(last=False)
        return tenant

    def caller_for(self, request: Any) -> Caller:
        """caller() for a Starlette request: its Authorization header, throttled by its source address."""
        return self.caller(request.headers.get("authorization"), source=source_of(request))

    def admin_for(self, request: Any) -> Caller:
        """admin() for a Starlette request."""
        return self.admin(request.headers.get("authorization"), source=source_of(request))

    def _check_throttle(self, token: str, source: str | None) -> None:
        """429 for a key this ingress has not seen valid, from a source that has failed too often."""
        with self._lock:
            known = token in self._cache  # valid when last looked up (maybe longer ago than the TTL)
        wait = 0.0 if known else self.throttle.wait_s(source)
        if wait > 0:
            raise HTTPFailure(
                429,
                f"too many invalid API keys from this address: retry in {max(1, round(wait))} s with a valid key",
                type="rate_limit_error",
                code="too_many_invalid_keys",
                retry_after_s=wait,
            )

    def caller(self, authorization: str | None, source: str | None = None) -> Caller:
        """The caller behind an Authorization header; 401 when it is missing or unknown, 429 when `source` (the
        peer address) has sent too many unknown keys (BadKeyThrottle)."""
        if self.no_auth:
            return _ANONYMOUS
        token = _bearer(authorization)
        if token is None:
            raise HTTPFailure(
                401,
                "missing API key: send 'Authorization: Bearer <key>' (ask the operator for a tenant key)",
                code="invalid_api_key",
            )
        if self._is_admin_token(token):
            return _ANONYMOUS
        self._check_throttle(token, source)
        tenant = self._tenant(token)
        if tenant is None:
            self.throttle.failed(source)
            raise HTTPFailure(
                401,
                "invalid API key: check the key or ask the operator for a new one",
                code="invalid_api_key",
            )
        return Caller(tenant=tenant)

    def admin(self, authorization: str | None, source: str | None = None) -> Caller:
        """The admin caller; 401 without credentials or with a token that is nobody's, 403 for a tenant key
        or when admin routes are off."""
        if self.no_auth:
            return _ANONYMOUS
        token = _bearer(authorization)
        if token is None:
            raise HTTPFailure(
                401,
                "this is an admin route: send 'Authorization: Bearer <LORALAND_ADMIN_TOKEN>'",
                code="invalid_api_key",
            )
        if self._is_admin_token(token):
            return _ANONYMOUS
        if not self._admin_token:
            raise HTTPFailure(
                403,
                "admin routes are disabled: start the server with LORALAND_ADMIN_TOKEN set",
                type="permission_error",
                code="admin_disabled",
            )
        self._check_throttle(token, source)
        try:
            tenant = self._tenant(token)
        except Exception:  # the catalog is away; the token is not the admin token either way
            tenant = None
        if tenant is None:
            self.throttle.failed(source)
            raise HTTPFailure(
                401,
                "invalid admin token: this route needs 'Authorization: Bearer <LORALAND_ADMIN_TOKEN>'",
                code="invalid_api_key",
            )
        raise HTTPFailure(
            403,
            "this route needs the admin token, not a tenant key",
            type="permission_error",
            code="forbidden",
        )
