"""Registry half of the catalog: adapter name -> versioned records (source URI, sha256s, shape, owner).

A registration is one REGISTER script (app/catalog/lua.py): the version number, the record and the change event
are written together, and a name's versions are never reused, even after it is removed. A registration may bound
the name's history: it drops all but the newest `keep` versions (and the newest promoted one), each drop announced
as a "removed" event (runtime LoRA loads keep MAX_VERSIONS; other registrations keep every version). A version may
be staged first (stored and announced as "staged", but not yet what the bare name resolves to) and promoted once
the replicas holding the name have loaded it (runtime LoRA loads do this)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import redis

from app.adapter_record import AdapterRecord
from app.catalog.conn import CatalogConnection, guard
from app.catalog.records import record_body
from app.errors import InvalidRequest, UnknownAdapter
from app.names import check_name, parse_ref

UNLOADABLE_REASON_CHARS = 2000  # a reason is one error message; longer ones are cut
MAX_VERSIONS = 16  # versions of a name a runtime LoRA load keeps (the newest promoted one always stays)


@contextlib.contextmanager
def _tenant_errors(tenant: str | None) -> Iterator[None]:
    # REGISTER refuses an owner that is not a tenant (checked inside the script, so it cannot race a delete).
    try:
        yield
    except redis.ResponseError as e:
        if "LL_UNKNOWN_TENANT" not in str(e):
            raise
        who = repr(tenant) if tenant else "named by an entry"
        raise InvalidRequest(
            f"unknown tenant {who}: create it first with `loraland tenants create NAME`"
        ) from None


class AdapterRegistry(CatalogConnection):
    """Mixed into Catalog (app/catalog/store.py)."""

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
        staged: bool = False,
        keep: int = 0,
    ) -> AdapterRecord:
        """Add a new version of `name` (1 for a new name) and make it the newest, atomically; `staged`: store it
        without making it the newest (promote() does). Drops all but the newest `keep` versions (0: keep all)."""
        body = record_body(
            name, uri, files=files, size=size, rank=rank, alpha=alpha, target_modules=target_modules,
            base_model=base_model, tenant=tenant, public=public, use_rslora=use_rslora,
        )  # fmt: skip
        with _tenant_errors(tenant):
            version = self._scripts["REGISTER"](
                keys=self._register_keys(name), args=self._register_args(body, staged, keep)
            )
        return AdapterRecord.from_dict({**body, "version": int(version)})

    @guard
    def promote(self, ref: str) -> bool | None:
        """Make the staged `name@v` what `name` resolves to, announced as "registered". False when a newer
        version already is (it stays), None when the version is gone (removed meanwhile)."""
        name, version = parse_ref(ref)
        if version is None:
            raise InvalidRequest(f"promote needs name@version, got {ref!r}")
        got = int(
            self._scripts["PROMOTE"](keys=[self._k("adapter", name)], args=[name, version, self._channel])
        )
        return None if got < 0 else got == 1

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
                    keys=self._register_keys(body["name"]),
                    args=self._register_args(body, False, 0),
                    client=pipe,
                )
            with _tenant_errors(None):
                versions += [int(v) for v in pipe.execute()]
        return versions

    @guard
    def next_version(self, name: str) -> int:
        """The version register(name) would give now (REGISTER's rule: the counter, never a live version);
        another registration may take it first. `loraland adapters push` names the upload's folder with it."""
        counter = int(self._r.hget(self._k("versions"), check_name(name)) or 0)
        latest = int(self._r.hget(self._k("adapter", name), "latest") or 0)
        return max(counter, latest) + 1

    def _register_keys(self, name: str) -> list[str]:
        return [self._k("adapter", name), self._k("adapters"), self._k("versions"), self._k("tenants")]

    def _register_args(self, body: dict[str, Any], staged: bool, keep: int) -> list[Any]:
        return [
            body["name"],
            json.dumps(body),
            self._channel,
            body["tenant"] or "",
            "1" if staged else "",
            keep,
        ]

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

    def can_use(self, tenant: str | None, record: AdapterRecord) -> bool:
        """A tenant may use its own adapters and public ones; None (admin, or auth off) may use all."""
        return tenant is None or record.public or record.tenant == tenant

    @guard
    def remove(self, ref: str) -> int:
        """Remove `name@v`, or every version of `name`; returns how many versions went."""
        name, version = parse_ref(ref)
        keys = [self._k("adapter", name), self._k("adapters")]
        return int(
            self._scripts["REMOVE"](keys=keys, args=[name, "" if version is None else version, self._channel])
        )

    @guard
    def mark_unloadable(self, ref: str, reason: str) -> bool:
        """Record that `name@v` cannot be loaded on the served base model (a replica found out at its first
        load: shapes, layer count); requests for it then fail at once with `reason`, and `loraland adapters
        list/show` say so. A new version of the name starts clean. Returns False if the version is gone.

        The record's JSON is rewritten under WATCH, so a concurrent REMOVE wins (nothing is re-created)."""
        name, version = parse_ref(ref)
        if version is None:
            raise InvalidRequest(f"mark_unloadable needs name@version, got {ref!r}")
        key, field = self._k("adapter", name), f"v:{version}"
        reason = str(reason)[:UNLOADABLE_REASON_CHARS]
        event = {"type": "unloadable", "name": name, "version": version, "reason": reason}
        with self._r.pipeline() as pipe:
            for _ in range(16):  # retried only when another writer touched the adapter's hash meanwhile
                try:
                    pipe.watch(key)
                    body = pipe.hget(key, field)
                    if body is None:
                        return False
                    record = json.loads(body)
                    if record.get("unloadable") == reason:
                        return True
                    record["unloadable"] = reason
                    pipe.multi()
                    pipe.hset(key, field, json.dumps(record))
                    pipe.publish(self._channel, json.dumps(event))
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
        return False

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
