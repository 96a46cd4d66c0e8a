"""The Redis catalog: adapter registry (versioned), tenants and API keys (hashed), replica placement
(heartbeats with a TTL), and change events on pub/sub. Redis is the source of truth; writes that must agree
run as Lua scripts (app/catalog/lua.py), so they are atomic."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis

from app.catalog import lua
from app.catalog.conn import connect, guard, redact_url
from app.catalog.records import AdapterRecord, ReplicaInfo, record_body
from app.catalog.replicas import ReplicaDirectory
from app.errors import InvalidRequest, UnknownAdapter
from app.names import check_name, check_tenant, parse_ref

__all__ = ["AdapterRecord", "Catalog", "ReplicaInfo", "hash_api_key", "redact_url"]

log = logging.getLogger(__name__)


def hash_api_key(api_key: str) -> str:
    # Keys are 256 random bits, so one unsalted SHA-256 suffices: there is nothing to brute-force.
    return hashlib.sha256(api_key.encode()).hexdigest()


@contextlib.contextmanager
def _tenant_errors(tenant: str | None) -> Iterator[None]:
    try:
        yield
    except redis.ResponseError as e:
        if "LL_UNKNOWN_TENANT" not in str(e):
            raise
        who = repr(tenant) if tenant else "named by an entry"
        raise InvalidRequest(
            f"unknown tenant {who}: create it first with `loraland tenants create NAME`"
        ) from None


class Catalog(ReplicaDirectory):
    """One client of the catalog; thread-safe (redis-py pools connections). Placement methods (heartbeat,
    replicas, placement, drop_replica) live in app/catalog/replicas.py."""

    def __init__(self, url: str, namespace: str = "loraland") -> None:
        self._r = connect(url)
        self.url = redact_url(url)
        self.ns = namespace
        self._channel = f"{namespace}:events"
        self._scripts = {
            name: self._r.register_script(getattr(lua, name))
            for name in ("REGISTER", "GET", "REMOVE", "PIN", "CREATE_TENANT", "ROTATE_KEY")
            + ("HEARTBEAT", "REPLICAS", "PLACEMENT", "DROP_REPLICA")
        }
        self._subs: list[Callable[[], None]] = []
        self._ping()

    @classmethod
    def from_settings(cls, settings: Any) -> Catalog | None:
        return cls(settings.redis_url) if settings.redis_url else None

    @guard
    def _ping(self) -> None:
        self._r.ping()

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # ----------------------------------------------------------------- registry

    @guard
    def register(
        self,
        name: str,
        uri: str,
        *,
        files: dict[str, str],
        size: int,
        rank: int,
        alpha: float,
        target_modules: list[str],
        base_model: dict,
        tenant: str | None = None,
        public: bool = False,
        use_rslora: bool = False,
    ) -> AdapterRecord:
        """Add a new version of `name` (1 for a new name) and make it the newest, atomically."""
        body = record_body(
            name, uri, files=files, size=size, rank=rank, alpha=alpha, target_modules=target_modules,
            base_model=base_model, tenant=tenant, public=public, use_rslora=use_rslora,
        )  # fmt: skip
        with _tenant_errors(tenant):
            version = self._scripts["REGISTER"](
                keys=self._register_keys(name), args=self._register_args(body)
            )
        return AdapterRecord.from_dict({**body, "version": int(version)})

    @guard
    def register_many(self, entries: Iterable[dict[str, Any]], batch: int = 1000) -> list[int]:
        """register(**entry) for each entry, pipelined `batch` at a time (bulk imports); returns versions.
        Each registration is atomic on its own; the whole is not."""
        versions: list[int] = []
        bodies = [record_body(**e) for e in entries]
        for start in range(0, len(bodies), batch):
            pipe = self._r.pipeline(transaction=False)
            for body in bodies[start : start + batch]:
                self._scripts["REGISTER"](
                    keys=self._register_keys(body["name"]), args=self._register_args(body), client=pipe
                )
            with _tenant_errors(None):
                versions += [int(v) for v in pipe.execute()]
        return versions

    def _register_keys(self, name: str) -> list[str]:
        return [self._k("adapter", name), self._k("adapters"), self._k("versions"), self._k("tenants")]

    def _register_args(self, body: dict[str, Any]) -> list[str]:
        return [body["name"], json.dumps(body), self._channel, body["tenant"] or ""]

    @staticmethod
    def _record(body: str, pinned: str) -> AdapterRecord:
        return AdapterRecord.from_dict({**json.loads(body), "pinned": pinned == "1"})

    @guard
    def get(self, ref: str) -> AdapterRecord | None:
        """The record of `name` (its newest version) or `name@v`; None if there is none."""
        name, version = parse_ref(ref)
        got = self._scripts["GET"](keys=[self._k("adapter", name)], args=["" if version is None else version])
        return None if got is None else self._record(*got)

    def require(self, ref: str) -> AdapterRecord:
        """Like get(), but raises UnknownAdapter instead of returning None."""
        record = self.get(ref)
        if record is None:
            raise UnknownAdapter(
                f"no adapter {ref!r} in the catalog at {self.url}: see `loraland adapters list`"
            )
        return record

    @guard
    def versions(self, name: str) -> list[AdapterRecord]:
        """Every stored version of `name`, oldest first."""
        h = self._r.hgetall(self._k("adapter", check_name(name)))
        pinned = h.get("pinned", "0")
        recs = [self._record(body, pinned) for f, body in h.items() if f.startswith("v:")]
        return sorted(recs, key=lambda r: r.version)

    @guard
    def list(self, tenant: str | None = None) -> list[AdapterRecord]:
        """The newest version of every adapter, by name; with `tenant`, only the ones it may use."""
        names = sorted(self._r.smembers(self._k("adapters")))
        out: list[AdapterRecord] = []
        for start in range(0, len(names), 1000):  # one atomic GET script per name, pipelined
            pipe = self._r.pipeline(transaction=False)
            for name in names[start : start + 1000]:
                self._scripts["GET"](keys=[self._k("adapter", name)], args=[""], client=pipe)
            out += [self._record(*got) for got in pipe.execute() if got is not None]
        return [r for r in out if tenant is None or self.can_use(tenant, r)]

    @guard
    def remove(self, ref: str) -> int:
        """Remove `name@v`, or every version of `name`; returns how many versions went."""
        name, version = parse_ref(ref)
        keys = [self._k("adapter", name), self._k("adapters")]
        return int(
            self._scripts["REMOVE"](keys=keys, args=[name, "" if version is None else version, self._channel])
        )

    @guard
    def set_pinned(self, name: str, pinned: bool) -> None:
        """Pinned adapters are never evicted from a replica's slots once loaded."""
        check_name(name)
        got = self._scripts["PIN"](
            keys=[self._k("adapter", name)], args=[name, "1" if pinned else "0", self._channel]
        )
        if int(got) < 0:
            raise UnknownAdapter(
                f"no adapter {name!r} in the catalog at {self.url}: see `loraland adapters list`"
            )

    # ----------------------------------------------------------------- tenants

    @staticmethod
    def _new_key() -> tuple[str, str, str]:
        key = "ll-" + secrets.token_urlsafe(32)
        return key, hash_api_key(key), key[:7]

    @guard
    def create_tenant(self, name: str) -> str:
        """Create a tenant; returns its API key, which is shown this once and stored only hashed."""
        check_tenant(name)
        key, key_hash, hint = self._new_key()
        body = json.dumps({"name": name, "created": time.time(), "key_hash": key_hash, "key_hint": hint})
        ok = self._scripts["CREATE_TENANT"](
            keys=[self._k("tenants"), self._k("apikeys")], args=[name, body, key_hash]
        )
        if not int(ok):
            raise InvalidRequest(
                f"tenant {name!r} already exists: use `loraland tenants rotate-key {name}` for a new key"
            )
        return key

    @guard
    def rotate_key(self, name: str) -> str:
        """Replace the tenant's API key; the old one stops working at once."""
        check_tenant(name)
        key, key_hash, hint = self._new_key()
        args = [name, key_hash, hint, time.time(), self._channel]
        if not int(self._scripts["ROTATE_KEY"](keys=[self._k("tenants"), self._k("apikeys")], args=args)):
            raise InvalidRequest(f"unknown tenant {name!r}: create it with `loraland tenants create {name}`")
        return key

    @guard
    def tenant_for_key(self, api_key: str) -> str | None:
        if not isinstance(api_key, str) or not api_key:
            return None
        return self._r.hget(self._k("apikeys"), hash_api_key(api_key))

    @guard
    def list_tenants(self) -> list[dict]:
        """[{name, created, key_hint, rotated}] sorted by name; key hashes are not returned."""
        rows = [json.loads(v) for v in self._r.hgetall(self._k("tenants")).values()]
        return sorted(
            ({k: v for k, v in t.items() if k != "key_hash"} for t in rows), key=lambda t: t["name"]
        )

    def can_use(self, tenant: str | None, record: AdapterRecord) -> bool:
        """A tenant may use its own adapters and public ones; None (admin, or auth off) may use all."""
        return tenant is None or record.public or record.tenant == tenant

    # ----------------------------------------------------------------- events

    @guard
    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call `callback(event)` from a background thread for each change event; returns stop().

        Events: {"type": "registered"|"removed"|"pinned"|"key_rotated", "name", "version", ...}. Redis
        pub/sub is fire-and-forget: events published while a subscriber is disconnected are lost, so a
        subscriber that must be exact re-reads the catalog after a reconnect."""

        def on_message(msg: dict) -> None:
            try:
                event = json.loads(msg["data"])
                event.setdefault("version", None)
                callback(event)
            except Exception:  # a faulty callback must not kill the listener thread
                log.exception("catalog event callback failed on %r", msg.get("data"))

        def on_error(exc: BaseException, pubsub: Any, thread: Any) -> None:
            log.warning("catalog event listener lost Redis at %s (%s); retrying", self.url, exc)
            time.sleep(0.5)

        pubsub = self._r.pubsub()
        pubsub.subscribe(**{self._channel: on_message})
        # Return only once Redis confirmed the subscription: an event published right after must arrive.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            msg = pubsub.get_message(timeout=0.5)
            if msg is not None and msg["type"] == "subscribe":
                break
        else:
            pubsub.close()
            raise redis.TimeoutError(f"no confirmation of SUBSCRIBE {self._channel}")
        thread = pubsub.run_in_thread(sleep_time=0.2, daemon=True, exception_handler=on_error)
        lock = threading.Lock()
        stopped = False

        def stop() -> None:
            nonlocal stopped
            with lock:
                if stopped:
                    return
                stopped = True
            thread.stop()
            thread.join(timeout=2)
            try:
                pubsub.close()
            except Exception:  # already closed by the thread, or Redis gone: nothing to release
                pass

        self._subs.append(stop)
        return stop

    def close(self) -> None:
        for stop in self._subs:
            stop()
        self._subs.clear()
        self._r.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
