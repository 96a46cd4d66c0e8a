"""Tenants half of the catalog: tenant names and their API keys, stored only as hashes.

A key is shown once, when it is made (create_tenant, rotate_key); the catalog keeps sha256(key) -> tenant, so a
dump of Redis holds nothing a caller could present. Creating, rotating and deleting are Lua scripts: the old key
stops working in the same step the new one starts, and the same step publishes `key_rotated` / `tenant_deleted`
({"type", "tenant"}) so every ingress drops the tenant's cached keys at once (app/router/http/auth.py)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time

from app.catalog.conn import CatalogConnection, guard
from app.errors import InvalidRequest
from app.names import check_tenant

# KEYS: tenants hash, apikeys hash; ARGV: name, channel. 0 if the tenant is unknown. (Beside the only code that
# runs it rather than in lua.py: the connection's script table is shared by every part of the catalog.)
DELETE_TENANT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local t = cjson.decode(raw)
if t.key_hash then redis.call('HDEL', KEYS[2], t.key_hash) end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], cjson.encode({type = 'tenant_deleted', tenant = ARGV[1]}))
return 1
"""


def hash_api_key(api_key: str) -> str:
    # Keys are 256 random bits, so one unsalted SHA-256 suffices: there is nothing to brute-force.
    return hashlib.sha256(api_key.encode()).hexdigest()


def _new_key() -> tuple[str, str, str]:
    """(key, its hash, the hint shown in listings)."""
    key = "ll-" + secrets.token_urlsafe(32)
    return key, hash_api_key(key), key[:7]


# A weight's bounds: wide enough for any real ratio of shares, narrow enough that counters stay well-scaled.
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0


class TenantDirectory(CatalogConnection):
    """Mixed into Catalog (app/catalog/store.py)."""

    @guard
    def create_tenant(self, name: str) -> str:
        """Create a tenant; returns its API key, which is shown this once and stored only hashed."""
        check_tenant(name)
        key, key_hash, hint = _new_key()
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
        key, key_hash, hint = _new_key()
        args = [name, key_hash, hint, time.time(), self._channel]
        if not int(self._scripts["ROTATE_KEY"](keys=[self._k("tenants"), self._k("apikeys")], args=args)):
            raise InvalidRequest(f"unknown tenant {name!r}: create it with `loraland tenants create {name}`")
        return key

    @guard
    def set_tenant_weight(self, name: str, weight: float | None) -> None:
        """The tenant's fair share in the replicas' VTC scheduler (app/replica/fairness.py): a tenant of weight 2
        is served twice the tokens of one of weight 1 while both are backlogged. None: the default, 1. Replicas
        read it with their heartbeat (every heartbeat_s)."""
        check_tenant(name)
        if weight is not None and (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not MIN_WEIGHT <= weight <= MAX_WEIGHT
        ):
            raise InvalidRequest(
                f"weight: must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], got {weight!r}"
            )
        arg = "none" if weight is None else repr(float(weight))
        if not int(self._scripts["SET_TENANT_WEIGHT"](keys=[self._k("tenants")], args=[name, arg])):
            raise InvalidRequest(f"unknown tenant {name!r}: create it with `loraland tenants create {name}`")

    @guard
    def delete_tenant(self, name: str) -> None:
        """Delete a tenant and its API key (refused at once on every ingress). Adapters it registered stay in
        the catalog, usable by nobody but the admin until removed (`loraland adapters rm`)."""
        check_tenant(name)
        script = self._r.register_script(DELETE_TENANT)
        if not int(script(keys=[self._k("tenants"), self._k("apikeys")], args=[name, self._channel])):
            raise InvalidRequest(f"unknown tenant {name!r}: `loraland tenants list` shows them")

    @guard
    def tenant_for_key(self, api_key: str) -> str | None:
        if not isinstance(api_key, str) or not api_key:
            return None
        return self._r.hget(self._k("apikeys"), hash_api_key(api_key))

    @guard
    def list_tenants(self) -> list[dict]:
        """[{name, created, key_hint, rotated, weight}] sorted by name (rotated, weight only when set); key hashes
        are not returned."""
        rows = [json.loads(v) for v in self._r.hgetall(self._k("tenants")).values()]
        return sorted(
            ({k: v for k, v in t.items() if k != "key_hash"} for t in rows), key=lambda t: t["name"]
        )
