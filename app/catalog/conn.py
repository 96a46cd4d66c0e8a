"""The Redis connection behind the catalog (shared by its registry, tenants and replicas parts), and the one place
connection failures become CatalogUnavailable."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from app import metrics
from app.catalog import lua
from app.errors import CatalogUnavailable, InvalidRequest


def redact_url(url: str) -> str:
    """The URL with any password replaced, fit for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str) -> redis.Redis:
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise InvalidRequest(f"invalid Redis URL {url!r}: use redis://HOST:PORT/DB")
    # Few, fast retries: a dead Redis should be reported in well under a second, not after long backoff.
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=3,
        socket_timeout=10,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        health_check_interval=30,
    )


def guard(fn: Callable) -> Callable:
    """Turn redis-py's connection failures into CatalogUnavailable naming the URL (`self.url`), and count them
    (loraland_catalog_errors_total{op})."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if metrics.enabled():
                metrics.CATALOG_ERRORS.labels(fn.__name__).inc()
            raise CatalogUnavailable(
                f"Redis at {self.url} is unreachable ({e}): start it, or point LORALAND_REDIS_URL / --redis "
                "at a running one"
            ) from None

    return wrapper


class CatalogConnection:
    """What every part of the catalog shares: one Redis client (thread-safe: redis-py pools connections), the
    key namespace, the change-event channel and the Lua scripts (app/catalog/lua.py), registered once."""

    SCRIPTS = (
        "REGISTER", "PROMOTE", "GET", "REMOVE", "PIN",  # registry.py
        "CREATE_TENANT", "ROTATE_KEY", "SET_TENANT_WEIGHT",  # tenants.py
        "HEARTBEAT", "REPLICAS", "PLACEMENT", "DROP_REPLICA",  # replicas.py
    )  # fmt: skip

    def __init__(self, url: str, namespace: str = "loraland") -> None:
        self._r = connect(url)
        self.url = redact_url(url)
        self.ns = namespace
        self._channel = f"{namespace}:events"
        self._scripts = {name: self._r.register_script(getattr(lua, name)) for name in self.SCRIPTS}

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))
