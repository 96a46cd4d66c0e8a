"""Quotas half of the catalog: per-tenant and per-adapter limits, and the shared token buckets enforcing them.

A quota limits concurrent requests, requests per minute and tokens per minute; a missing quota (or limit) is
unlimited. The buckets live in Redis and each admission is one Lua script (quota_lua.QUOTA_ADMIT) over every
bucket the request touches, on the Redis clock, so any number of ingress replicas share one limit exactly: all
buckets pass and are charged, or none is. Per-minute buckets refill continuously (limit/60 per second) up to one
minute's worth. Concurrency is a set of leases with an expiry (renewed by the ingress holding them), so a
crashed ingress's slots free themselves. The ingress side, incl. what happens while Redis is down, is
app/router/http/quotas.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import redis

from app.catalog import quota_lua
from app.catalog.conn import CatalogConnection, guard
from app.errors import InvalidRequest, UnknownAdapter
from app.names import check_name, check_tenant

SCOPES = ("tenant", "adapter")
# How each limit reads in messages: "tenant 'acme' is over its 60 requests/minute quota".
UNITS = {"concurrent": "concurrent requests", "requests_per_minute": "requests/minute",
         "tokens_per_minute": "tokens/minute"}  # fmt: skip


@dataclass(frozen=True)
class Quota:
    """Limits of one tenant or adapter; None is unlimited."""

    concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidRequest(f"{f.name}: must be a positive integer or null (unlimited), got {v!r}")

    @classmethod
    def from_dict(cls, d: object) -> Quota:
        if not isinstance(d, dict):
            raise InvalidRequest(f"a quota is a JSON object of {sorted(UNITS)}, got {type(d).__name__}")
        unknown = sorted(set(d) - set(UNITS))
        if unknown:
            raise InvalidRequest(f"{unknown[0]}: unknown quota limit; the limits are {sorted(UNITS)}")
        return cls(**d)

    def to_dict(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def unlimited(self) -> bool:
        return all(v is None for v in self.to_dict().values())

    def describe(self) -> str:
        parts = [f"{v} {UNITS[k]}" for k, v in self.to_dict().items() if v is not None]
        return ", ".join(parts) or "unlimited"


def scope_id(kind: str, name: str) -> str:
    if kind not in SCOPES:
        raise InvalidRequest(f"quota scope must be one of {SCOPES}, got {kind!r}")
    (check_tenant if kind == "tenant" else check_name)(name)
    return f"{kind}:{name}"


def describe_scope(sid: str) -> str:
    """'tenant:acme' -> "tenant 'acme'"."""
    kind, _, name = sid.partition(":")
    return f"{kind} {name!r}"


def _parse(raw: str | None) -> Quota | None:
    return Quota.from_dict(json.loads(raw)) if raw else None


@dataclass(frozen=True)
class Admission:
    """What QUOTA_ADMIT decided. `quotas`: each scope's quota as read in the same step (None: none set)."""

    admitted: bool
    quotas: dict[str, Quota | None]
    wait_s: float = 0.0  # refused: seconds until the named limit would admit the request
    scope: str | None = None  # refused: the scope id and limit that bind
    limit: str | None = None
    value: int | None = None
    impossible: bool = False  # the reservation exceeds a whole minute's tokens: waiting cannot help


class QuotaStore(CatalogConnection):
    """Mixed into Catalog (app/catalog/store.py)."""

    def _script(self, name: str):
        # Registered on first use (register_script only hashes the text; redis-py loads it on NOSCRIPT).
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self._r.register_script(getattr(quota_lua, name))
        return script

    def _bucket_keys(self, sids: list[str]) -> list[str]:
        keys = [self._k("quotas")]
        for sid in sids:
            keys += [self._k("qb", sid, "rpm"), self._k("qb", sid, "tpm"), self._k("qc", sid)]
        return keys

    # ------------------------------------------------------------------ records
    @guard
    def get_quota(self, kind: str, name: str) -> Quota | None:
        """`name`'s quota, None when it has none; an unknown tenant or adapter is an error."""
        sid = scope_id(kind, name)
        if kind == "tenant" and not self._r.hexists(self._k("tenants"), name):
            raise InvalidRequest(f"unknown tenant {name!r}: `loraland tenants list` shows the tenants")
        if kind == "adapter" and not self._r.sismember(self._k("adapters"), name):
            raise UnknownAdapter(f"no adapter {name!r} in the catalog: `loraland adapters list` shows them")
        return _parse(self._r.hget(self._k("quotas"), sid))

    @guard
    def quotas(self) -> dict[str, Quota]:
        """Every quota set, by scope id ('tenant:acme', 'adapter:acme/sql')."""
        return {sid: q for sid, raw in self._r.hgetall(self._k("quotas")).items() if (q := _parse(raw))}

    @guard
    def set_quota(
        self, kind: str, name: str, limits: Quota | dict[str, int | None], *, merge: bool = False
    ) -> Quota | None:
        """Store `name`'s quota. merge=False replaces it whole (an absent limit is unlimited); merge=True
        changes only the limits named in `limits` (a dict; None removes that limit). Returns the quota now in
        force, None when no limit is left. The tenant or adapter must exist."""
        sid = scope_id(kind, name)
        if isinstance(limits, Quota):
            limits = limits.to_dict()
        Quota.from_dict(limits)  # validates names and values
        if not merge:
            limits = {**Quota().to_dict(), **limits}
        args = [sid, name, "hash" if kind == "tenant" else "set", "merge" if merge else "replace"]
        for key, value in limits.items():
            args += [key, "" if value is None else str(value)]
        owner = self._k("tenants") if kind == "tenant" else self._k("adapters")
        try:
            body = self._script("QUOTA_SET")(keys=[self._k("quotas"), owner], args=args)
        except redis.ResponseError as e:
            if "LL_UNKNOWN_OWNER" not in str(e):
                raise
            if kind == "tenant":
                raise InvalidRequest(
                    f"unknown tenant {name!r}: create it with `loraland tenants create {name}`"
                ) from None
            raise UnknownAdapter(f"no adapter {name!r} in the catalog: register it first") from None
        return _parse(body)

    # ------------------------------------------------------------------ enforcement
    @guard
    def admit_quota(self, sids: list[str], tokens: int, lease: str, lease_ttl_s: float) -> Admission:
        """Charge one request and `tokens` to every scope in `sids` at once, taking a concurrency lease
        `lease` (held for lease_ttl_s unless renewed) where a scope limits concurrency; or charge nothing."""
        if not sids:
            return Admission(True, {})
        args = [lease, int(lease_ttl_s * 1000), int(tokens), *sids]
        out = self._script("QUOTA_ADMIT")(keys=self._bucket_keys(sids), args=args)
        status, wait_ms, idx, limit, value = (int(out[0]), int(out[1]), int(out[2]), out[3], int(out[4]))
        quotas = {sid: _parse(raw) for sid, raw in zip(sids, out[5:], strict=True)}
        if status == 1:
            return Admission(True, quotas)
        return Admission(False, quotas, wait_ms / 1000, sids[idx - 1], limit, value, impossible=status == -1)

    @guard
    def settle_quota(self, sids: list[str], lease: str, tokens_back: int) -> None:
        """End a request admitted by admit_quota: free its lease and give back the tokens it reserved but did
        not use (negative: charge what it used beyond its reservation)."""
        if sids:
            args = [lease, int(tokens_back), *sids]
            self._script("QUOTA_SETTLE")(keys=self._bucket_keys(sids), args=args)

    @guard
    def renew_leases(self, held: list[tuple[str, str]], lease_ttl_s: float) -> int:
        """Extend the leases [(scope id, lease id)] still held for another lease_ttl_s; returns how many."""
        if not held:
            return 0
        keys = [self._k("qc", sid) for sid, _ in held]
        args = [int(lease_ttl_s * 1000), *(lease for _, lease in held)]
        return int(self._script("QUOTA_RENEW")(keys=keys, args=args))
