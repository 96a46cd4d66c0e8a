"""Who is calling: `Authorization: Bearer <key>` → tenant (through the catalog), or the admin token."""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from app.router.http_errors import HTTPFailure

log = logging.getLogger("loraland.auth")


class KeyLookup(Protocol):
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


class Authenticator:
    """Resolves callers; remembers recent key lookups so a Redis blip does not log every tenant out."""

    def __init__(
        self,
        keys: KeyLookup | None,
        admin_token: str | None,
        *,
        no_auth: bool = False,
        cache_ttl_s: float = 30.0,
        cache_size: int = 4096,
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
        if no_auth:
            log.warning(
                "AUTHENTICATION IS OFF (--no-auth): every caller can use every adapter and the admin routes. "
                "Use this only for a local demo."
            )

    def _is_admin_token(self, token: str) -> bool:
        return bool(self._admin_token) and hmac.compare_digest(token.encode(), self._admin_token.encode())

    def _tenant(self, token: str) -> str | None:
        hit = self._cache.get(token)
        now = time.monotonic()
        if hit is not None and now - hit[1] < self._ttl:
            self._cache.move_to_end(token)
            return hit[0]
        if self._keys is None:
            return None
        try:
            tenant = self._keys.tenant_for_key(token)
        except Exception:
            if hit is not None:  # the catalog is down: a key that was valid a moment ago stays valid
                return hit[0]
            raise
        if tenant is not None:
            self._cache[token] = (tenant, now)
            self._cache.move_to_end(token)
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        else:
            self._cache.pop(token, None)
        return tenant

    def caller(self, authorization: str | None) -> Caller:
        """The caller behind an Authorization header; 401 when it is missing or unknown."""
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
        tenant = self._tenant(token)
        if tenant is None:
            raise HTTPFailure(
                401,
                "invalid API key: check the key or ask the operator for a new one",
                code="invalid_api_key",
            )
        return Caller(tenant=tenant)

    def admin(self, authorization: str | None) -> Caller:
        """The admin caller; 401 without credentials, 403 for a tenant key or when admin routes are off."""
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
        raise HTTPFailure(
            403,
            "this route needs the admin token, not a tenant key",
            type="permission_error",
            code="forbidden",
        )
