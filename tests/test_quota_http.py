"""Cluster-wide quotas over HTTP: TWO ingress apps (build_api, as the Serve deployment builds them) sharing one
real redis-server, in front of one real ReplicaCore on the tiny model; clients are httpx over ASGI.

Shows: the shared limit holds to within one request; a client that waits Retry-After gets through; the
concurrency limit, released as replies end (also when cancelled or dropped); per-adapter limits; tokens
settled to actual usage; the admin API; and the local fallback while Redis is stopped, then recovery."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid

import httpx
import pytest

from app.catalog.quotas import Quota
from app.catalog.redis_server import start_redis
from app.catalog.store import Catalog
from app.config.app_config import AppConfig
from app.protocol import ReplicaRequest
from app.replica.deployment import LocalBackend, ReplicaCore
from app.replica.lora.peft_format import adapter_summary
from app.router.http.auth import Authenticator
from app.router.http.ingress import build_api
from app.router.http.quotas import QuotaLimiter
from app.router.service import CatalogProxy, IngressService
from app.sampling_params import SamplingParams
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_tiny_adapter

ADMIN = {"Authorization": "Bearer quota-admin"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class GatedBackend:
    """The real LocalBackend, with a gate a test can close to hold requests in flight (after admission)."""

    def __init__(self, inner: LocalBackend):
        self.inner, self.gate, self.waiting = inner, None, 0

    async def stream(self, request):
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        async for item in self.inner.stream(request):
            yield item

    async def call(self, method, *args):
        return await self.inner.call(method, *args)


class Cluster:
    """Two ingress apps over one Redis (each with its own Catalog client, as separate processes would have)."""

    def __init__(self, redis_url: str, backend, model: str, ns: str, **limiter_kw):
        self.cfg = AppConfig(
            model=model, served_model_name="tiny-llama", redis_url=redis_url, ingress_replicas=2
        )
        self.catalog = Catalog(redis_url, namespace=ns)
        self.apps, self.services = [], []
        for _ in range(2):
            proxy = CatalogProxy(redis_url, Catalog(redis_url, namespace=ns))
            service = IngressService(self.cfg, backend, proxy)
            limiter = QuotaLimiter(proxy, ingress_replicas=2, **limiter_kw)
            self.apps.append(build_api(service, Authenticator(proxy, "quota-admin"), limiter))
            self.services.append(service)

    def tenant(self, name: str, **quota) -> str:
        key = self.catalog.create_tenant(name)
        if quota:
            self.catalog.set_quota("tenant", name, Quota(**quota))
        return key

    def run(self, fn):
        async def go():
            clients = [
                httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://ll", timeout=60)
                for a in self.apps
            ]
            try:
                return await fn(*clients)
            finally:
                for c in clients:
                    await c.aclose()

        return asyncio.run(go())

    def close(self):
        for a in self.apps:
            a.state.quotas.close()
        for s in self.services:
            s.catalog.get().close()
        self.catalog.close()


@pytest.fixture(scope="module")
def core(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    from loraland import LLMKernel

    ns = f"qh{uuid.uuid4().hex[:8]}"
    catalog = Catalog(redis_server, namespace=ns)
    folder = write_tiny_adapter(tmp_path_factory.mktemp("adapters") / "pub", seed=7)
    kernel = LLMKernel(llama_dir, max_adapters=2, max_batch_size=32, dtype="float32")
    info = adapter_summary(folder)
    catalog.register(
        "pub", str(folder), files=info["files"], size=info["size"], rank=info["rank"], alpha=info["alpha"],
        target_modules=info["target_modules"], base_model=kernel.model_config.identity(), public=True,
    )  # fmt: skip
    cfg = AppConfig(model=str(llama_dir), served_model_name="tiny-llama", redis_url=redis_server)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        replica = ReplicaCore(cfg, "local-0", kernel=kernel, catalog=catalog)
    replica.start()
    replica.ns = ns
    yield replica
    replica.close()
    catalog.close()


@pytest.fixture(scope="module")
def cluster(core, redis_server, llama_dir):  # noqa: F811
    c = Cluster(redis_server, GatedBackend(LocalBackend(core)), str(llama_dir), core.ns)
    yield c
    c.close()


def complete(client, key, model="tiny-llama", **kw):
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 2, **kw}
    return client.post("/v1/completions", json=body, headers=bearer(key))


def test_shared_limit_holds_across_two_ingresses_to_within_one_request(cluster):
    key = cluster.tenant("shared", requests_per_minute=6)  # refills 0.1 request/s: under 1 during the test

    async def go(c0, c1):
        return await asyncio.gather(*(complete((c0, c1)[i % 2], key) for i in range(24)))

    replies = cluster.run(go)
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code != 200]
    assert 6 <= len(ok) <= 7, [r.status_code for r in replies]
    assert {r.status_code for r in refused} == {429}
    err = refused[0].json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "quota_exceeded"
    assert err["message"].startswith("tenant 'shared' is over its 6 requests/minute quota; retry after ")
    assert 1 <= int(refused[0].headers["Retry-After"]) <= 10  # one request refills in 10 s
    assert f"retry after {refused[0].headers['Retry-After']} s" in err["message"]


def test_a_client_that_waits_retry_after_gets_through(cluster):
    key = cluster.tenant("patient", requests_per_minute=60)  # a request a second

    async def go(c0, c1):
        first = None
        while first is None:  # use up the burst (a minute's worth) from both ingresses
            batch = await asyncio.gather(*(complete((c0, c1)[i % 2], key) for i in range(20)))
            first = next((r for r in batch if r.status_code == 429), None)
        probe = await complete(c0, key)  # one client alone from here on
        assert probe.status_code == 429, probe.text
        wait = int(probe.headers["Retry-After"])
        await asyncio.sleep(wait)
        after = await complete(c1, key)  # through the other ingress: the bucket is shared
        again = await complete(c0, key)
        return wait, after, again

    wait, after, again = cluster.run(go)
    assert wait == 1
    assert after.status_code == 200, after.text
    assert again.status_code == 429  # the refill was one request, and it was used


def test_concurrency_limit_across_ingresses(cluster):
    key = cluster.tenant("busy", concurrent=2)
    backend = cluster.services[0].backend

    async def go(c0, c1):
        backend.gate, backend.waiting = asyncio.Event(), 0
        held = [asyncio.create_task(complete(c, key)) for c in (c0, c1)]
        while backend.waiting < 2:  # both admitted and held at the replica's door
            await asyncio.sleep(0.01)
        third = await complete(c0, key)
        backend.gate.set()
        backend.gate = None
        done = await asyncio.gather(*held)
        # Slots are given back before a reply completes: one client in sequence never trips its own limit.
        sequential = [await complete((c0, c1)[i % 2], key) for i in range(5)]
        streamed = [await complete(c1, key, stream=True) for _ in range(3)]
        return third, done, sequential, streamed

    third, done, sequential, streamed = cluster.run(go)
    assert third.status_code == 429 and third.headers["Retry-After"] == "1"
    assert third.json()["error"]["message"] == (
        "tenant 'busy' is at its quota of 2 concurrent requests; retry after 1 s"
    )
    assert [r.status_code for r in done + sequential + streamed] == [200] * 10
    assert all("[DONE]" in r.text for r in streamed)


def test_a_cancelled_or_dropped_stream_gives_its_slot_back(cluster, core):
    cluster.tenant("canceller", concurrent=1)
    service, limiter = cluster.services[0], cluster.apps[0].state.quotas
    slots = cluster.catalog._k("qc", "tenant:canceller")

    def request():
        req = ReplicaRequest(request_id=uuid.uuid4().hex, prompts=("hello",), sampling=SamplingParams(max_tokens=4),
                             tenant="canceller")  # fmt: skip
        return service.stream(req)

    async def until_free():
        for _ in range(200):
            if cluster.catalog._r.zcard(slots) == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    async def go(*_):
        s = await limiter.admit(request())
        await s.open()
        s.cancel()  # the client went away mid-reply
        cancelled = await until_free()
        s = await limiter.admit(request())
        del s  # admitted, never read (the client left before the body started)
        gc.collect()
        dropped = await until_free()
        return cancelled, dropped

    assert cluster.run(go) == (True, True)


def test_per_adapter_limit_counts_every_tenant(cluster):
    key_a, key_b = cluster.tenant("ada"), cluster.tenant("bob")

    async def go(c0, c1):
        put = await c1.put("/v1/adapters/pub/quota", json={"requests_per_minute": 3}, headers=ADMIN)
        replies = [
            await complete(c, k, model="pub") for c, k in ((c0, key_a), (c1, key_b), (c0, key_b), (c1, key_a))
        ]
        base = await complete(c0, key_a)  # the base model is not the adapter
        return put, replies, base

    put, replies, base = cluster.run(go)
    assert put.status_code == 200 and put.json()["requests_per_minute"] == 3
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    assert (
        replies[3].json()["error"]["message"].startswith("adapter 'pub' is over its 3 requests/minute quota")
    )
    assert base.status_code == 200


def test_tokens_are_settled_to_actual_usage(cluster):
    key = cluster.tenant("tok", tokens_per_minute=1000)  # 1000/60 tokens a second refill

    async def go(c0, c1):
        ok = await complete(c0, key, max_tokens=8, prompt="a prompt of several words for the estimate")
        # max_tokens 1000 reserves more than the whole minute: waiting cannot help, so it is a 400.
        too_big = await complete(c1, key, max_tokens=1000)
        return ok, too_big

    ok, too_big = cluster.run(go)
    assert ok.status_code == 200, ok.text
    used = ok.json()["usage"]["total_tokens"]
    level = float(cluster.catalog._r.hget(cluster.catalog._k("qb", "tenant:tok", "tpm"), "tokens"))
    assert 1000 - used <= level <= 1000 - used + 17  # charged what it used, plus at most ~1 s of refill
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"
    assert "1000 tokens/minute" in too_big.json()["error"]["message"]


def test_admin_api_sets_and_reads_quotas(cluster):
    key = cluster.tenant("admined")

    async def go(c0, c1):
        put = await c0.put("/v1/tenants/admined/quota", json={"concurrent": 3, "tokens_per_minute": 9000},
                           headers=ADMIN)  # fmt: skip
        got = await c1.get("/v1/tenants/admined/quota", headers=ADMIN)
        as_tenant = await c1.get("/v1/tenants/admined/quota", headers=bearer(key))
        bad = await c0.put("/v1/tenants/admined/quota", json={"rpm": 5}, headers=ADMIN)
        ghost = await c0.put("/v1/tenants/ghost/quota", json={"concurrent": 1}, headers=ADMIN)
        cleared = await c0.put("/v1/tenants/admined/quota", json={}, headers=ADMIN)
        adapter = await c1.get("/v1/adapters/pub", headers=ADMIN)  # the adapter route still answers
        return put, got, as_tenant, bad, ghost, cleared, adapter

    put, got, as_tenant, bad, ghost, cleared, adapter = cluster.run(go)
    want = {"object": "quota", "scope": "tenant", "name": "admined", "concurrent": 3,
            "requests_per_minute": None, "tokens_per_minute": 9000}  # fmt: skip
    assert put.json() == want and got.json() == want
    assert as_tenant.status_code == 403
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rpm"
    assert ghost.status_code == 400 and "unknown tenant 'ghost'" in ghost.json()["error"]["message"]
    assert cleared.json()["concurrent"] is None and cluster.catalog.get_quota("tenant", "admined") is None
    assert adapter.status_code == 200 and adapter.json()["name"] == "pub"


def test_fallback_to_local_shares_while_redis_is_down(core, llama_dir):
    url, stop = start_redis()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    cluster = Cluster(url, LocalBackend(core), str(llama_dir), "fb", redis_retry_s=0.5)
    try:
        key = cluster.tenant("fb", requests_per_minute=4, concurrent=8)

        async def before(c0, c1):  # both ingresses read the quota (and learn the key) while Redis is up
            return [(await complete(c, key)).status_code for c in (c0, c1)]

        assert cluster.run(before) == [200, 200]
        stop()  # Redis is gone

        async def during(c0, c1):
            replies = {i: [await complete(c, key) for _ in range(3)] for i, c in enumerate((c0, c1))}
            admin = await c0.post("/v1/completions", headers=ADMIN,
                                  json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2})  # fmt: skip
            return replies, admin

        replies, admin = cluster.run(during)
        # Each of the 2 ingresses enforces half of 4/minute: 2 pass on each, the 3rd is refused; nothing fails.
        for i in (0, 1):
            assert [r.status_code for r in replies[i]] == [200, 200, 429], [r.text for r in replies[i]]
            msg = replies[i][2].json()["error"]["message"]
            assert msg.startswith("tenant 'fb' is over its 4 requests/minute quota; retry after ")
            assert "the catalog is unreachable" in msg
        assert admin.status_code == 200  # no tenant, no adapter: no quota to check

        # Redis returns (empty: nothing persisted); the ingresses go back to the shared buckets.
        url, stop = start_redis(port)
        key = cluster.catalog.create_tenant("fb")
        cluster.catalog.set_quota("tenant", "fb", Quota(requests_per_minute=1))
        time.sleep(0.6)  # past redis_retry_s

        async def after(c0, c1):
            return [(await complete(c, key)).status_code for c in (c0, c1, c0)]

        assert cluster.run(after) == [200, 429, 429]
    finally:
        cluster.close()
        stop()
