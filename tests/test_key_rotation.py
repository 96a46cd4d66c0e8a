"""A rotated or deleted API key stops working at once on every ingress (issue 20.1): two in-process ingresses
(build_api twice, each with its own Catalog client and Authenticator, as two Serve ingress replicas have) over
one real redis-server and one replica (LocalBackend(ReplicaCore) on the tiny kernel).

The measured number is the seconds from `rotate_key` returning until each ingress refuses the old key; the
pub/sub path is shown with a key cache that would otherwise trust the key for a minute, and the bound without
pub/sub (KEY_CACHE_TTL_S) with the subscription switched off."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from app.catalog.store import Catalog
from app.config.app_config import AppConfig
from app.replica.deployment import LocalBackend, ReplicaCore
from app.router.http.auth import KEY_CACHE_TTL_S, Authenticator
from app.router.http.ingress import build_api
from app.router.service import CatalogProxy, IngressService
from tests.fixtures.services import redis_server  # noqa: F401

ADMIN = "admin-token-for-rotation"
BODY = {"model": "tiny-llama", "prompt": "the quick brown fox", "max_tokens": 2}


class Ingress:
    """One ingress replica: its own catalog connection, key cache and event subscription."""

    def __init__(self, redis_url: str, ns: str, cfg: AppConfig, backend, **auth_options):
        self.catalog = Catalog(redis_url, namespace=ns)
        proxy = CatalogProxy(redis_url, self.catalog)
        self.auth = Authenticator(proxy, ADMIN, **auth_options)
        self.api = build_api(IngressService(cfg, backend, proxy), self.auth)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.api), base_url="http://ll")

    def wait_watching(self) -> None:
        deadline = time.monotonic() + 10
        while self.auth._unwatch is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.auth.close()
        self.catalog.close()


@pytest.fixture(scope="module")
def replica(redis_server, llama_dir):  # noqa: F811
    from loraland import LLMKernel

    ns = f"k{uuid.uuid4().hex[:8]}"
    cfg = AppConfig(model=str(llama_dir), served_model_name="tiny-llama", redis_url=redis_server)
    catalog = Catalog(redis_server, namespace=ns)
    kernel = LLMKernel(llama_dir, max_adapters=1, max_batch_size=4, dtype="float32")
    core = ReplicaCore(cfg, "local-0", kernel=kernel, catalog=catalog)
    # The first error reply imports ray (http_errors unwraps RayTaskError), ~1 s once per process: a Serve
    # ingress has it imported already, and it is not what the rotation timings measure.
    from app.router.http.errors import error_reply

    error_reply(RuntimeError("warm"))
    yield redis_server, ns, cfg, LocalBackend(core), catalog
    core.close()
    catalog.close()


def two_ingresses(replica, **auth_options) -> list[Ingress]:
    url, ns, cfg, backend, _ = replica
    ingresses = [Ingress(url, ns, cfg, backend, **auth_options) for _ in range(2)]
    if auth_options.get("watch", True):
        for ing in ingresses:
            ing.wait_watching()
    return ingresses


async def seconds_until_refused(ing: Ingress, key: str, t0: float, limit_s: float) -> float:
    """Poll GET /v1/models (auth only, no generation) every 5 ms until the key gets 401."""
    while time.perf_counter() - t0 < limit_s:
        r = await ing.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        if r.status_code == 401:
            return time.perf_counter() - t0
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.005)
    return float("inf")


def rotate_and_measure(replica, ingresses, tenant: str, old: str, change, limit_s: float):
    """Warm both caches with `old`, run `change()` (rotate or delete, as the CLI would from its own client),
    return (seconds until each ingress refused `old`, replies to a completion with `old` afterwards)."""
    admin_catalog = replica[4]

    async def go():
        for ing in ingresses:  # the old key works and sits in each ingress's key cache
            r = await ing.client.post(
                "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {old}"}
            )
            assert r.status_code == 200, r.text
        t0 = time.perf_counter()
        new = await asyncio.to_thread(change, admin_catalog)
        waits = await asyncio.gather(*(seconds_until_refused(ing, old, t0, limit_s) for ing in ingresses))
        after = [
            await ing.client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {old}"})
            for ing in ingresses
        ]
        fresh = (
            [
                await ing.client.post(
                    "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {new}"}
                )
                for ing in ingresses
            ]
            if new
            else []
        )
        return waits, after, fresh

    return asyncio.run(go())


def test_rotated_key_is_refused_at_once_on_two_ingresses(replica):
    tenant = f"beta-{uuid.uuid4().hex[:6]}"
    old = replica[4].create_tenant(tenant)
    # A minute-long cache: only the key-change event can make the old key fail within a second.
    ingresses = two_ingresses(replica, cache_ttl_s=60.0)
    try:
        waits, after, fresh = rotate_and_measure(
            replica, ingresses, tenant, old, lambda cat: cat.rotate_key(tenant), limit_s=5.0
        )
    finally:
        for ing in ingresses:
            ing.close()
    print(f"\nrotate-key -> old key refused after {[round(w, 4) for w in waits]} s on 2 ingresses (pub/sub)")
    assert all(w < 1.0 for w in waits), waits
    assert [r.status_code for r in after] == [401, 401]
    assert [r.status_code for r in fresh] == [200, 200]


def test_deleted_tenant_key_is_refused_at_once_on_two_ingresses(replica):
    tenant = f"gone-{uuid.uuid4().hex[:6]}"
    old = replica[4].create_tenant(tenant)
    ingresses = two_ingresses(replica, cache_ttl_s=60.0)
    try:
        waits, after, _ = rotate_and_measure(
            replica, ingresses, tenant, old, lambda cat: cat.delete_tenant(tenant), limit_s=5.0
        )
    finally:
        for ing in ingresses:
            ing.close()
    print(f"\ndelete tenant -> key refused after {[round(w, 4) for w in waits]} s on 2 ingresses (pub/sub)")
    assert all(w < 1.0 for w in waits), waits
    assert [r.status_code for r in after] == [401, 401]
    assert tenant not in {t["name"] for t in replica[4].list_tenants()}


def test_without_pub_sub_the_key_cache_ttl_bounds_how_long_an_old_key_works(replica):
    tenant = f"nopubsub-{uuid.uuid4().hex[:6]}"
    old = replica[4].create_tenant(tenant)
    ingresses = two_ingresses(replica, watch=False)  # as if every key-change event were lost
    try:
        waits, after, fresh = rotate_and_measure(
            replica, ingresses, tenant, old, lambda cat: cat.rotate_key(tenant), limit_s=KEY_CACHE_TTL_S + 3
        )
    finally:
        for ing in ingresses:
            ing.close()
    print(
        f"\nrotate-key without pub/sub -> refused after {[round(w, 3) for w in waits]} s (TTL {KEY_CACHE_TTL_S})"
    )
    assert all(w <= KEY_CACHE_TTL_S + 0.5 for w in waits), waits
    assert [r.status_code for r in after] == [401, 401]
    assert [r.status_code for r in fresh] == [200, 200]


def test_a_lookup_racing_a_key_event_is_not_cached():
    """A lookup that began before a rotation and answered after its event must not re-cache the old key."""

    class SlowKeys:
        def __init__(self):
            self.auth: Authenticator | None = None

        def tenant_for_key(self, key: str) -> str | None:
            self.auth._on_event({"type": "key_rotated", "tenant": "t"})  # the event lands mid-lookup
            return "t"

    keys = SlowKeys()
    auth = keys.auth = Authenticator(keys, ADMIN, cache_ttl_s=60.0)
    assert auth.caller("Bearer k").tenant == "t"
    assert "k" not in auth._cache
    auth._on_event({"type": "registered", "name": "x"})  # other events leave the cache alone
