"""A hostile tenant's requests fail alone, fast and without leaking (issues 21.2, 21.3, 20.7, 20.8), through
HTTP against the in-process stack of tests/test_ingress_http.py: build_api over LocalBackend(ReplicaCore) (the
tiny LLMKernel), a real Catalog on a real redis-server, moto's S3 server for a cached adapter.

The two timed checks are the bounds issue 21 asks for (413 in under a second, a concurrent request's latency
within 2x of normal); both are measured generously (medians, a small absolute allowance for a shared CPU)."""

from __future__ import annotations

import asyncio
import gc
import re
import statistics
import time
import uuid

import httpx
import psutil
import pytest

from app.catalog.sources import AdapterHub
from app.catalog.store import Catalog
from app.config.app_config import AppConfig
from app.config.settings import Settings
from app.replica.deployment import LocalBackend, ReplicaCore
from app.replica.lora.peft_format import adapter_summary
from app.router.http.auth import Authenticator
from app.router.http.ingress import build_api
from app.router.service import CatalogProxy, IngressService
from tests.fixtures.adapters import write_corrupt_adapter
from tests.fixtures.services import aws_env, make_bucket, redis_server, s3_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_tiny_adapter

ADMIN = "admin-token-for-hardening"
PROMPT = "the quick brown fox"
MB = 1 << 20
BIG = 20 * MB
SHORT = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4}


class Stack:
    def __init__(self, redis_url: str, llama_dir):
        from loraland import LLMKernel

        self.catalog = Catalog(redis_url, namespace=f"h{uuid.uuid4().hex[:8]}")
        self.key = self.catalog.create_tenant("alpha")
        self.cfg = AppConfig(model=str(llama_dir), served_model_name="tiny-llama", redis_url=redis_url)
        # The hub ReplicaCore would give a kernel it built: the S3 settings of this (patched) environment.
        hub = AdapterHub(catalog=self.catalog, settings=Settings.from_env())
        self.kernel = LLMKernel(llama_dir, max_adapters=2, max_batch_size=16, dtype="float32", hub=hub)
        self.core = ReplicaCore(self.cfg, "local-0", kernel=self.kernel, catalog=self.catalog)
        proxy = CatalogProxy(redis_url, self.catalog)
        self.service = IngressService(self.cfg, LocalBackend(self.core), proxy)
        self.auth = Authenticator(proxy, ADMIN)
        self.api = build_api(self.service, self.auth)

    def run(self, fn):
        async def go():
            transport = httpx.ASGITransport(app=self.api)
            async with httpx.AsyncClient(transport=transport, base_url="http://ll", timeout=120) as client:
                return await fn(client)

        return asyncio.run(go())

    def register(self, name: str, uri: str, folder, **extra) -> None:
        """As `loraland adapters register` does: straight into the catalog, no replica validation."""
        info = adapter_summary(folder)
        self.catalog.register(
            name,
            uri,
            files=extra.pop("files", info["files"]),
            size=info["size"],
            rank=info["rank"],
            alpha=info["alpha"],
            target_modules=info["target_modules"],
            base_model=self.kernel.model_config.identity(),
            public=True,
        )


@pytest.fixture(scope="module")
def stack(redis_server, s3_server, llama_dir, tmp_path_factory):  # noqa: F811
    make_bucket(s3_server, "hardening")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in aws_env(s3_server).items():
            mp.setenv(k, v)
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        s = Stack(redis_server, llama_dir)
        s.settings = Settings.from_env()
    # The first error reply imports ray (http_errors unwraps RayTaskError), ~1-2 s once per process: not what
    # the timed checks measure, and a Serve ingress has ray imported from the start.
    s.run(lambda c: c.post("/v1/completions", json={"prompt": "x"}, headers=bearer(s.key)))
    yield s
    s.auth.close()
    s.core.close()
    s.catalog.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


async def timed(coro) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = await coro
    return time.perf_counter() - t0, r


# ---------------------------------------------------------------------------------------------- 21.2 huge bodies


def test_huge_body_is_413_fast_and_others_keep_their_latency(stack):
    body = b'{"model": "tiny-llama", "prompt": "' + b"a" * (BIG - 64) + b'"}'
    limit = stack.cfg.max_request_bytes
    sent = []

    async def chunked():  # no Content-Length: the limit must bite while reading
        for i in range(0, len(body), 64 * 1024):
            sent.append(min(64 * 1024, len(body) - i))
            yield body[i : i + 64 * 1024]

    async def go(client):
        h = bearer(stack.key)
        await client.post("/v1/completions", json=SHORT, headers=h)  # warm
        normal = [(await timed(client.post("/v1/completions", json=SHORT, headers=h)))[0] for _ in range(5)]
        big, concurrent = [], []
        for content in (body, body, chunked()):
            (t_big, r_big), (t_short, r_short) = await asyncio.gather(
                timed(client.post("/v1/completions", content=content, headers=h)),
                timed(client.post("/v1/completions", json=SHORT, headers=h)),
            )
            assert r_short.status_code == 200, r_short.text
            big.append((t_big, r_big))
            concurrent.append(t_short)
        return normal, big, concurrent

    normal, big, concurrent = stack.run(go)
    for t, r in big:
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert str(limit) in err["message"] and "max_request_bytes" in err["message"]
        assert err["code"] == "request_too_large" and err["param"] == "body"
        assert t < 1.0, f"413 took {t:.3f}s"
    # The chunked body was read up to the limit and one chunk more, never to its 20 MB end.
    assert sum(sent) <= limit + 2 * 64 * 1024, sum(sent)
    base = statistics.median(normal)
    ratio = statistics.median(concurrent) / base
    print(
        f"\n413 latency: {[round(t, 4) for t, _ in big]} s; short request alone {base:.4f} s (median of 5), "
        f"beside a 20 MB body {[round(t, 4) for t in concurrent]} s; ratio of medians {ratio:.2f}; "
        f"chunked body read {sum(sent)} of {len(body)} bytes"
    )
    assert statistics.median(concurrent) <= 2 * base + 0.05, (normal, concurrent)


def test_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(stack):
    kernel = stack.kernel
    assert kernel.max_prompt_chars == kernel.max_model_len * max(map(len, kernel.tokenizer.get_vocab()))
    prompt = "word " * (3 * MB // 5)  # 3 MB: under the body limit, far over what max_model_len holds

    async def go(client):
        h = bearer(stack.key)
        out = []
        for route, body in [
            ("/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}),
            (
                "/v1/chat/completions",
                {"model": "tiny-llama", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2},
            ),
        ]:
            (t, r), (t_short, short) = await asyncio.gather(
                timed(client.post(route, json=body, headers=h)),
                timed(client.post("/v1/completions", json=SHORT, headers=h)),
            )
            out.append((t, r, t_short, short))
        return out

    for t, r, t_short, short in stack.run(go):
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "max_model_len" in message and str(kernel.max_model_len) in message
        assert short.status_code == 200
        print(f"\n3 MB prompt -> 400 in {t:.3f} s; concurrent short request {t_short:.3f} s")
        # Tokenizing 3 MB with this tokenizer takes ~10 s: an answer this fast never tokenized it.
        assert t < 5.0


def test_memory_returns_to_baseline_after_huge_requests(stack):
    body = b'{"model": "tiny-llama", "prompt": "' + b"a" * (BIG - 64) + b'"}'
    prompt = "word " * (3 * MB // 5)

    async def burst(client):
        h = bearer(stack.key)
        statuses = []
        for _ in range(3):
            statuses.append((await client.post("/v1/completions", content=body, headers=h)).status_code)
            r = await client.post(
                "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}, headers=h
            )
            statuses.append(r.status_code)
        return statuses

    async def go(client):
        await client.post("/v1/completions", json=SHORT, headers=bearer(stack.key))  # warm every path
        await burst(client)  # allocator pools reach their steady size once
        before = rss()
        statuses = await burst(client)
        await client.post("/v1/completions", json=SHORT, headers=bearer(stack.key))
        return before, rss(), statuses

    before, after, statuses = stack.run(go)
    assert statuses == [413, 400] * 3
    print(
        f"\nprocess RSS before {before / MB:.1f} MB, after three 20 MB + three 3 MB requests {after / MB:.1f} MB"
    )
    assert after <= before * 1.10, (before, after)


def test_big_prompts_that_are_tokenized_leave_memory_and_other_requests_alone(stack, monkeypatch):
    """A real model's bound (max_model_len x its longest token) admits ~1 MB prompts to the tokenizer: with the
    tiny model's bound raised to match, three 512 kB prompts are tokenized (off the event loop) and refused by
    the token count, while a short request runs beside each; the heap is trimmed after each."""
    monkeypatch.setattr(stack.kernel, "max_prompt_chars", 1 << 30)
    prompt = "the quick brown fox " * (MB // 2 // 20)

    async def big_with_short(client):
        h = bearer(stack.key)
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}
        (t_big, big), (t_short, short) = await asyncio.gather(
            timed(client.post("/v1/completions", json=body, headers=h)),
            timed(_after(0.05, client.post("/v1/completions", json=SHORT, headers=h))),
        )
        assert big.status_code == 400 and "max_model_len" in big.json()["error"]["message"], big.text
        assert short.status_code == 200
        return t_big, t_short

    async def go(client):
        h = bearer(stack.key)
        normal = [(await timed(client.post("/v1/completions", json=SHORT, headers=h)))[0] for _ in range(5)]
        await big_with_short(client)  # the tokenizer's and allocator's pools reach their steady size once
        before = rss()
        runs = [await big_with_short(client) for _ in range(3)]
        return statistics.median(normal), runs, before, rss()

    normal, runs, before, after = stack.run(go)
    print(
        f"\n512 kB prompts tokenized: (400 after s, concurrent short s) {[tuple(round(x, 3) for x in r) for r in runs]}"
        f"; short alone {normal:.3f} s; RSS before {before / MB:.1f} MB, after three {after / MB:.1f} MB"
    )
    assert after <= before * 1.10, (before, after)
    # The short request waits at most for its own batch, not for the tokenizer (generous for a shared CPU).
    assert statistics.median(t_short for _, t_short in runs) <= 2 * normal + 0.25, (normal, runs)


async def _after(delay: float, coro):
    await asyncio.sleep(delay)  # the big request is being tokenized by then
    return await coro


# ---------------------------------------------------------------------------------------------- 21.3 leaks


def test_corrupt_catalog_adapter_is_named_not_its_server_path(stack, tmp_path):
    good = write_tiny_adapter(tmp_path / "good", seed=3)
    bad = write_corrupt_adapter(good, tmp_path / "bad", "nan")
    sums = AdapterHub(settings=stack.settings).upload(bad, "s3://hardening/corrupt-s3")
    stack.register("corrupt-s3", "s3://hardening/corrupt-s3", bad, files=sums)
    stack.register("corrupt-local", str(bad), bad)

    async def go(client):
        return [
            await client.post(
                "/v1/completions",
                json={"model": name, "prompt": PROMPT, "max_tokens": 2},
                headers=bearer(stack.key),
            )
            for name in ("corrupt-s3", "corrupt-local")
        ]

    for name, r in zip(("corrupt-s3", "corrupt-local"), stack.run(go)):
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert f"'{name}'" in message and "NaN" in message, message
        for secret in (str(stack.settings.cache_dir), str(tmp_path), "sha-", "s3://", "/adapters/"):
            assert secret not in message, message


def test_oversized_model_strings_are_clipped_in_messages(stack):
    cases = {
        "garbage": "x" * 3000 + "!",  # not a name: the grammar's message quotes it (twice)
        "too_long": "y" * 20000,  # over the field's length cap: refused without echo
        "unknown": "z" * 128,  # a valid name no one registered: 404 quoting it
    }

    async def go(client):
        return {
            k: await client.post(
                "/v1/completions",
                json={"model": m, "prompt": "x", "max_tokens": 2},
                headers=bearer(stack.key),
            )
            for k, m in cases.items()
        }

    got = stack.run(go)
    assert got["garbage"].status_code == 400 and got["too_long"].status_code == 400
    assert got["unknown"].status_code == 404
    for k, r in got.items():
        err = r.json()["error"]
        assert err["param"] == "model", err
        assert not re.search(r"[xyz]{101}", err["message"]), (k, len(err["message"]))
        assert len(r.content) < 1200, (k, len(r.content))
    assert "x" * 100 + "…" in got["garbage"].json()["error"]["message"]
    assert "4096" in got["too_long"].json()["error"]["message"]


def test_openapi_schema_is_served_without_auth_and_holds_no_secrets(stack):
    r = stack.run(lambda c: c.get("/openapi.json"))
    assert r.status_code == 200
    assert "/v1/completions" in r.json()["paths"]
    for secret in (ADMIN, stack.key, stack.cfg.redis_url):
        assert secret not in r.text


# ---------------------------------------------------------------------------------------------- 20.7 fan-out cap


def test_prompts_times_n_is_capped_per_request(stack):
    cap = stack.cfg.max_sequences_per_request

    async def go(client):
        h = bearer(stack.key)
        over_prompts = {"model": "tiny-llama", "prompt": ["hi"] * (cap + 1), "max_tokens": 1}
        over_n = {"model": "tiny-llama", "prompt": ["hi"] * 5, "n": 16, "max_tokens": 1}
        at_cap = {"model": "tiny-llama", "prompt": ["hi"] * (cap // 16), "n": 16, "max_tokens": 1}
        return [
            await client.post("/v1/completions", json=b, headers=h) for b in (over_prompts, over_n, at_cap)
        ]

    over_prompts, over_n, at_cap = stack.run(go)
    for r in (over_prompts, over_n):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and str(cap) in err["message"]
        assert "max_sequences_per_request" in err["message"]
    assert "80 sequences" in over_n.json()["error"]["message"]
    assert at_cap.status_code == 200, at_cap.text
    assert len(at_cap.json()["choices"]) == cap


# ---------------------------------------------------------------------------------------------- 20.8 admin auth


def test_admin_routes_401_for_unknown_tokens_403_for_tenant_keys(stack):
    async def go(client):
        out = {}
        for who, headers in [
            ("none", {}),
            ("unknown", bearer("ll-nobody-has-this-key")),
            ("tenant", bearer(stack.key)),
            ("admin", bearer(ADMIN)),
        ]:
            out[who] = [
                await client.get("/v1/adapters", headers=headers),
                await client.get("/v1/placement", headers=headers),
                await client.delete("/v1/adapters/no-such-adapter", headers=headers),
                await client.post("/v1/adapters", json={"name": "x"}, headers=headers),
            ]
        return out

    got = stack.run(go)
    assert [r.status_code for r in got["none"]] == [401] * 4
    assert [r.status_code for r in got["unknown"]] == [401] * 4
    assert all(r.json()["error"]["code"] == "invalid_api_key" for r in got["unknown"])
    assert [r.status_code for r in got["tenant"]] == [403] * 4
    assert "not a tenant key" in got["tenant"][0].json()["error"]["message"]
    assert [r.status_code for r in got["admin"]] == [200, 200, 404, 400]
