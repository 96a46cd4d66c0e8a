"""The HTTP layer without Ray: the real FastAPI app over a real ReplicaCore (LLMKernel on the tiny model), a
real Catalog on a real redis-server, and real clients (httpx and the official openai package) over ASGI.

The Serve deployment wraps exactly these objects; tests/test_serve_e2e.py runs them on a Ray cluster."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest

from app.catalog.store import Catalog
from app.config.app_config import AppConfig
from app.replica.chat import render_chat
from app.replica.deployment import LocalBackend, ReplicaCore
from app.router.http.auth import Authenticator
from app.router.http.ingress import REPLICA_HEADER, build_api
from app.router.service import CatalogProxy, IngressService
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_tiny_adapter

ADMIN = "admin-token-for-tests"
PROMPT = "the quick brown fox"


class Stack:
    """Everything one module of tests talks to."""

    def __init__(self, redis_url: str, llama_dir, adapters_root):
        from loraland import LLMKernel

        ns = f"t{uuid.uuid4().hex[:8]}"
        self.catalog = Catalog(redis_url, namespace=ns)
        self.key_a = self.catalog.create_tenant("alpha")
        self.key_b = self.catalog.create_tenant("beta")
        self.folders = {}
        for i, name in enumerate(["pub", "a-private", "b-private", "mix1", "mix2"]):
            self.folders[name] = write_tiny_adapter(adapters_root / name, seed=100 + i)
        self.cfg = AppConfig(model=str(llama_dir), served_model_name="tiny-llama", redis_url=redis_url)
        self.kernel = LLMKernel(llama_dir, max_adapters=4, max_batch_size=16, dtype="float32")
        self.core = ReplicaCore(self.cfg, "local-0", kernel=self.kernel, catalog=self.catalog)
        self.core.start()  # heartbeats and catalog events, as in a Serve replica
        self.service = IngressService(
            self.cfg, LocalBackend(self.core), CatalogProxy(redis_url, self.catalog)
        )
        self.auth = Authenticator(self.service.catalog, ADMIN)
        self.api = build_api(self.service, self.auth)

    def run(self, fn):
        async def go():
            transport = httpx.ASGITransport(app=self.api)
            async with httpx.AsyncClient(transport=transport, base_url="http://ll", timeout=60) as client:
                return await fn(client)

        return asyncio.run(go())

    def openai(self, fn, key: str):
        async def go():
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.api), timeout=60)
            async with openai.AsyncOpenAI(api_key=key, base_url="http://ll/v1", http_client=http) as client:
                return await fn(client)

        return asyncio.run(go())


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("adapters")
    with pytest.MonkeyPatch.context() as mp:
        # HTTP callers may only name folders under the allowed local roots; the disk cache stays in tmp.
        mp.setenv("LORALAND_LOCAL_ROOTS", str(root))
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        s = Stack(redis_server, llama_dir, root)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def register(client):
        out = {}
        for name, tenant, public in [
            ("pub", None, True),
            ("a-private", "alpha", False),
            ("b-private", "beta", False),
        ]:
            r = await client.post(
                "/v1/adapters",
                json={"name": name, "source": str(s.folders[name]), "tenant": tenant, "public": public},
                headers=admin,
            )
            assert r.status_code == 201, r.text
            out[name] = r.json()
        return out

    s.registered = s.run(register)
    for name in ("mix1", "mix2"):  # registered directly, as `loraland adapters register` does
        from app.replica.lora.peft_format import adapter_summary

        info = adapter_summary(s.folders[name])
        s.catalog.register(
            name,
            str(s.folders[name]),
            files=info["files"],
            size=info["size"],
            rank=info["rank"],
            alpha=info["alpha"],
            target_modules=info["target_modules"],
            base_model=s.kernel.model_config.identity(),
            public=True,
        )
    yield s
    s.core.close()
    s.catalog.close()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def expected(stack, prompt, adapter=None, **kw):
    kw.setdefault("max_tokens", 8)
    return stack.kernel.complete([prompt], [adapter], **kw)[0].text


def test_registration_went_through_a_replica_validation(stack):
    rec = stack.registered["pub"]
    assert rec["ref"] == "pub@1" and rec["public"] is True
    assert rec["base_model"] == stack.kernel.model_config.identity()
    assert set(rec["files"]) == {"adapter_config.json", "adapter_model.safetensors"}


def test_completion_base_and_adapter_match_the_kernel(stack):
    async def go(client):
        base = await client.post(
            "/v1/completions",
            json={"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8},
            headers=bearer(stack.key_a),
        )
        tuned = await client.post(
            "/v1/completions",
            json={"model": "pub", "prompt": PROMPT, "max_tokens": 8},
            headers=bearer(stack.key_a),
        )
        return base, tuned

    base, tuned = stack.run(go)
    assert base.status_code == 200 and tuned.status_code == 200, (base.text, tuned.text)
    assert base.headers[REPLICA_HEADER] == "local-0"
    b, t = base.json(), tuned.json()
    assert b["object"] == "text_completion" and b["model"] == "tiny-llama"
    assert b["choices"][0]["text"] == expected(stack, PROMPT)
    assert t["choices"][0]["text"] == expected(stack, PROMPT, "pub@1")
    assert t["choices"][0]["text"] != b["choices"][0]["text"]  # the adapter does change the output
    assert t["usage"]["completion_tokens"] == 8 and t["choices"][0]["finish_reason"] == "length"
    assert t["usage"]["total_tokens"] == t["usage"]["prompt_tokens"] + 8


def test_openai_client_chat_stream_and_n(stack):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]

    async def go(client):
        chat = await client.chat.completions.create(model="pub", messages=messages, max_tokens=6)
        stream = await client.chat.completions.create(
            model="pub", messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        pieces, usage, roles = [], None, []
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                roles.append(c.delta.role)
        multi = await client.completions.create(
            model="tiny-llama", prompt=["hello world", PROMPT], max_tokens=5, n=2
        )
        # Streamed, the four choices' deltas of one step reach the ingress as one DeltaBatch: each still
        # arrives as its own chunk, and every choice's chunks add up to its text.
        texts: dict[int, str] = {}
        async for chunk in await client.completions.create(
            model="tiny-llama", prompt=["hello world", PROMPT], max_tokens=5, n=2, stream=True
        ):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        assert [texts[i] for i in range(4)] == [c.text for c in multi.choices]
        return chat, "".join(pieces), usage, roles, multi

    chat, streamed, usage, roles, multi = stack.openai(go, stack.key_a)
    want = expected(stack, render_chat(messages, stack.kernel.tokenizer), "pub@1", max_tokens=6)
    assert chat.choices[0].message.content == want
    assert chat.choices[0].message.role == "assistant"
    assert streamed == want
    assert roles[0] == "assistant"
    assert usage is not None and usage.completion_tokens == 6
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert [c.text for c in multi.choices] == [expected(stack, "hello world", max_tokens=5)] * 2 + [
        expected(stack, PROMPT, max_tokens=5)
    ] * 2
    assert multi.usage.completion_tokens == 20


def test_chain_and_merge_match_the_kernel(stack):
    async def go(client):
        out = {}
        for model in ("mix1|mix2", "mix1*0.7+mix2*0.3"):
            r = await client.post(
                "/v1/completions",
                json={"model": model, "prompt": PROMPT, "max_tokens": 6},
                headers=bearer(stack.key_b),
            )
            assert r.status_code == 200, r.text
            out[model] = r.json()["choices"][0]["text"]
        return out

    got = stack.run(go)
    assert got["mix1|mix2"] == expected(stack, PROMPT, "mix1@1|mix2@1", max_tokens=6)
    assert got["mix1*0.7+mix2*0.3"] == expected(stack, PROMPT, "mix1@1*0.7+mix2@1*0.3", max_tokens=6)


def test_tenants_are_isolated(stack):
    async def go(client):
        models_a = (await client.get("/v1/models", headers=bearer(stack.key_a))).json()
        use_b = await client.post(
            "/v1/completions",
            json={"model": "b-private", "prompt": "x", "max_tokens": 2},
            headers=bearer(stack.key_a),
        )
        missing = await client.post(
            "/v1/completions",
            json={"model": "no-such", "prompt": "x", "max_tokens": 2},
            headers=bearer(stack.key_a),
        )
        own = await client.post(
            "/v1/completions",
            json={"model": "a-private", "prompt": "x", "max_tokens": 2},
            headers=bearer(stack.key_a),
        )
        return models_a, use_b, missing, own

    models_a, use_b, missing, own = stack.run(go)
    ids = {m["id"]: m for m in models_a["data"]}
    assert "a-private" in ids and "pub" in ids and "b-private" not in ids
    assert ids["pub"]["parent"] == "tiny-llama" and ids["tiny-llama"]["parent"] is None
    assert use_b.status_code == 404 and missing.status_code == 404
    # another tenant's adapter is indistinguishable from a missing one
    assert use_b.json()["error"]["message"].replace("b-private", "X") == missing.json()["error"][
        "message"
    ].replace("no-such", "X")
    assert use_b.json()["error"]["code"] == "model_not_found" and use_b.json()["error"]["param"] == "model"
    assert own.status_code == 200


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, "body"),
        (b"[1, 2]", 400, "body"),
        ({"prompt": "x"}, 400, "model"),
        ({"model": "tiny-llama", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny-llama", "prompt": "x", "temperature": 7}, 400, "temperature"),
        ({"model": "tiny-llama", "prompt": 12}, 400, "prompt"),
        ({"model": "tiny-llama", "prompt": "x", "n": 99}, 400, "n"),
        ({"model": "tiny-llama", "prompt": "x", "logprobs": 21}, 400, "logprobs"),  # over max_logprobs
        ({"model": "tiny-llama", "prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
        ({"model": "tiny-llama", "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ({"model": "tiny-llama", "prompt": "x", "logprobs": 3, "presence_penalty": 0.5}, 200, None),
        ({"model": "a|", "prompt": "x"}, 400, "model"),
        ({"model": "tiny-llama", "prompt": "x", "sampling_typo": 1}, 200, None),  # extras are ignored
        ({"model": "tiny-llama", "prompt": "word " * 600, "max_tokens": 2}, 400, None),  # beyond the context
    ],
)
def test_bad_requests_name_the_field(stack, body, status, param):
    async def go(client):
        kw = (
            {"content": body}
            if isinstance(body, bytes)
            else {"json": {**body, "max_tokens": body.get("max_tokens", 2)}}
        )
        return await client.post("/v1/completions", headers=bearer(stack.key_a), **kw)

    r = stack.run(go)
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param
        if param is None:
            assert "max_model_len" in err["message"] or "tokens" in err["message"]


def test_auth_errors(stack):
    async def go(client):
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
        return {
            "none": await client.post("/v1/completions", json=body),
            "bad": await client.post("/v1/completions", json=body, headers=bearer("ll-not-a-key")),
            "admin_none": await client.get("/v1/placement"),
            "admin_tenant": await client.get("/v1/adapters", headers=bearer(stack.key_a)),
            "admin_delete_tenant": await client.delete("/v1/adapters/pub", headers=bearer(stack.key_a)),
            "admin_ok": await client.get("/v1/adapters", headers=bearer(ADMIN)),
        }

    r = stack.run(go)
    assert r["none"].status_code == 401 and r["bad"].status_code == 401
    assert r["none"].json()["error"]["code"] == "invalid_api_key"
    assert r["admin_none"].status_code == 401
    assert r["admin_tenant"].status_code == 403 and r["admin_delete_tenant"].status_code == 403
    assert r["admin_ok"].status_code == 200
    assert {a["name"] for a in r["admin_ok"].json()["data"]} >= {"pub", "a-private", "b-private"}


def test_unreachable_source_is_503_and_delete_unloads(stack, tmp_path):
    folder = write_tiny_adapter(tmp_path / "gone", seed=7)
    from app.replica.lora.peft_format import adapter_summary

    info = adapter_summary(folder)
    stack.catalog.register(
        "gone",
        str(tmp_path / "moved-away"),
        files=info["files"],
        size=info["size"],
        rank=info["rank"],
        alpha=info["alpha"],
        target_modules=info["target_modules"],
        base_model={},
        public=True,
    )

    async def go(client):
        body = {"model": "gone", "prompt": "x", "max_tokens": 2}
        unavailable = await client.post("/v1/completions", json=body, headers=bearer(stack.key_a))
        used = await client.post(
            "/v1/completions",
            json={"model": "mix2", "prompt": "x", "max_tokens": 2},
            headers=bearer(stack.key_a),
        )
        stack.core.sync.heartbeat_once()
        placement = (await client.get("/v1/placement", headers=bearer(ADMIN))).json()
        deleted = await client.delete("/v1/adapters/mix2", headers=bearer(ADMIN))
        for _ in range(50):  # the replica hears the removal over pub/sub
            if "mix2" not in stack.kernel.adapters():
                break
            await asyncio.sleep(0.1)
        after = await client.post(
            "/v1/completions",
            json={"model": "mix2", "prompt": "x", "max_tokens": 2},
            headers=bearer(stack.key_a),
        )
        health = (await client.get("/healthz")).json()
        return unavailable, used, placement, deleted, after, health

    unavailable, used, placement, deleted, after, health = stack.run(go)
    assert unavailable.status_code == 503, unavailable.text
    assert (
        unavailable.json()["error"]["code"] == "adapter_unavailable" and "Retry-After" in unavailable.headers
    )
    assert used.status_code == 200
    assert placement["placement"]["mix2@1"] == ["local-0"]
    assert placement["replicas"]["local-0"]["free_slots"] >= 0
    assert deleted.status_code == 200 and deleted.json()["versions"] == 1
    assert "mix2" not in stack.kernel.adapters()
    assert after.status_code == 404
    assert health["status"] == "ok" and health["catalog"] == "ok"


def test_stream_errors_before_output_keep_their_status(stack):
    async def go(client):
        body = {"model": "no-such", "prompt": "x", "max_tokens": 2, "stream": True}
        missing = await client.post("/v1/completions", json=body, headers=bearer(stack.key_a))
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=bearer(stack.key_a)) as ok:
            lines = [line async for line in ok.aiter_lines() if line.startswith("data: ")]
        return missing, ok, lines

    missing, ok, lines = stack.run(go)
    assert missing.status_code == 404
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected(stack, "x", max_tokens=3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_full_replica_queue_is_429_with_retry_after(stack, llama_dir):
    from loraland import LLMKernel

    # One running sequence and one waiting at most: a burst must overflow.
    kernel = LLMKernel(llama_dir, max_adapters=1, max_batch_size=1, max_waiting=1, dtype="float32")
    core = ReplicaCore(stack.cfg, "tiny-queue", kernel=kernel, catalog=stack.catalog)
    service = IngressService(stack.cfg, LocalBackend(core), stack.service.catalog)
    api = build_api(service, stack.auth)

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://ll", timeout=60
        ) as c:
            body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16}
            return await asyncio.gather(
                *(c.post("/v1/completions", json=body, headers=bearer(stack.key_a)) for _ in range(8))
            )

    try:
        replies = asyncio.run(go())
    finally:
        core.close()
    statuses = sorted(r.status_code for r in replies)
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}, statuses
    full = next(r for r in replies if r.status_code == 429)
    assert int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["type"] == "rate_limit_error" and full.json()["error"]["code"] == "queue_full"
