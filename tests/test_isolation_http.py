"""Issue 21 item 1 / issue 20 items 2-3 through HTTP on a real local stack: the FastAPI ingress served by
uvicorn on loopback (so B's stream is a real stream), a ReplicaCore over LLMKernel on the tiny Llama, a real
Catalog on a real redis-server. While tenant beta streams a long completion, tenant alpha sends every poison
request; each gets its documented status and a message naming the cause, and beta's stream carries exactly
the text it carries alone. Run it in a loopback-only namespace (it opens a port)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import pytest
import torch

from app.catalog.redis_server import free_port
from app.catalog.store import Catalog
from app.config.app_config import AppConfig
from app.replica.deployment import LocalBackend, ReplicaCore
from app.replica.lora.peft_format import adapter_summary
from app.router.http.auth import Authenticator
from app.router.http.ingress import build_api
from app.router.service import CatalogProxy, IngressService
from tests.fixtures.services import redis_server  # noqa: F401
from tests.test_isolation import scaled_adapter

B_BODY = {
    "model": "tiny-llama",
    "prompt": "the quick brown fox",
    "max_tokens": 200,
    "ignore_eos": True,
    "stream": True,
}
FAULT_PROMPT = "ray serve routes requests"
CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    import uvicorn

    from loraland import LLMKernel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: intra-op threads only spin on a busy CPU
    root = tmp_path_factory.mktemp("adapters")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORALAND_LOCAL_ROOTS", str(root))
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        catalog = Catalog(redis_server, namespace=f"t{uuid.uuid4().hex[:8]}")
        keys = {"alpha": catalog.create_tenant("alpha"), "beta": catalog.create_tenant("beta")}
        cfg = AppConfig(model=str(llama_dir), served_model_name="tiny-llama", redis_url=redis_server)
        kernel = LLMKernel(llama_dir, dtype="float32", max_batch_size=16)
        folder = scaled_adapter(root / "huge", 1e30)  # its forward overflows: inf/NaN logits
        info = adapter_summary(folder)
        catalog.register(
            "huge",
            str(folder),
            files=info["files"],
            size=info["size"],
            rank=info["rank"],
            alpha=info["alpha"],
            target_modules=info["target_modules"],
            base_model=kernel.model_config.identity(),
            tenant="alpha",
        )
        core = ReplicaCore(cfg, "local-0", kernel=kernel, catalog=catalog)
        core.start()
        service = IngressService(cfg, LocalBackend(core), CatalogProxy(redis_server, catalog))
        api = build_api(service, Authenticator(service.catalog, "admin-token-for-tests"))
        port = free_port()
        srv = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", keys, kernel
        srv.should_exit = True
        thread.join(timeout=10)
        core.close()
        catalog.close()
    torch.set_num_threads(threads)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def read_stream(response: httpx.Response, on_event=None) -> tuple[str, list[dict]]:
    """The text of a completion/chat stream and its events (`on_event(count)` is awaited after each)."""
    events, text = [], ""
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        events.append(ev)
        for c in ev.get("choices", []):
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
        if on_event is not None:
            await on_event(len(events))
    return text, events


def test_poison_requests_fail_alone_and_beta_streams_on(server):
    url, keys, kernel = server
    a, b = bearer(keys["alpha"]), bearer(keys["beta"])
    fault_ids = kernel.tokenizer.encode(FAULT_PROMPT, add_special_tokens=False)

    def fault(seq) -> None:  # the injected fault: raises inside the step's sampling, for that row only
        if seq.prompt_ids == fault_ids:
            raise RuntimeError("injected")

    kernel.engine.fault_hook = fault
    poisons = {
        "temperature 1e-300": {
            "model": "tiny-llama",
            "prompt": "hello",
            "max_tokens": 8,
            "temperature": 1e-300,
        },
        "seed 2**70": {
            "model": "tiny-llama",
            "prompt": "hello",
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 2**70,
        },
        "huge adapter": {"model": "huge", "prompt": "hello", "max_tokens": 8, "temperature": 1.0},
        "huge adapter, streamed": {"model": "huge", "prompt": "hello", "max_tokens": 8, "stream": True},
        "injected fault": {"model": "tiny-llama", "prompt": FAULT_PROMPT, "max_tokens": 8},
    }
    chat_tiny = {
        "model": "tiny-llama",
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 1e-300,
        "stream": True,
    }

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=B_BODY, headers=b) as r:
                assert r.status_code == 200
                alone, _ = await read_stream(r)
            replies: dict[str, object] = {}

            async def send_poisons(count: int) -> None:
                if count != 5:
                    return
                for name, body in poisons.items():
                    replies[name] = await client.post("/v1/completions", json=body, headers=a)
                async with client.stream("POST", "/v1/chat/completions", json=chat_tiny, headers=a) as cr:
                    replies["chat 1e-300"] = (cr.status_code, await read_stream(cr))
                # beta is still decoding in the same batch the poisons went through
                replies["beta running"] = any(
                    s.params.max_tokens == 200 for s in kernel.engine.scheduler.running
                )

            async with client.stream("POST", "/v1/completions", json=B_BODY, headers=b) as r:
                assert r.status_code == 200
                with_poisons, events = await read_stream(r, send_poisons)
            greedy = await client.post(
                "/v1/completions", json={**poisons["temperature 1e-300"], "temperature": 0}, headers=a
            )
            chat_greedy = await client.post(
                "/v1/chat/completions", json={**chat_tiny, "stream": False, "temperature": 0}, headers=a
            )
            return alone, with_poisons, events, replies, greedy.json(), chat_greedy.json()

    try:
        alone, with_poisons, events, replies, greedy, chat_greedy = asyncio.run(go())
    finally:
        kernel.engine.fault_hook = None
    assert replies.pop("beta running") is True
    assert with_poisons == alone and len(alone) > 0
    assert not any("error" in ev for ev in events) and events[-1]["choices"][0]["finish_reason"] == "length"

    def error(name):
        r = replies[name]
        return r.status_code, r.json()["error"]

    tiny = replies["temperature 1e-300"]
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    status, err = error("seed 2**70")
    assert (status, err["param"], err["code"]) == (400, "seed", "invalid_value")
    assert err["message"] == (
        "seed: must be an integer in [-9223372036854775808, 9223372036854775807] (signed 64-bit), "
        "got 1180591620717411303424"
    )
    for name in ("huge adapter", "huge adapter, streamed"):
        status, err = error(name)
        assert (status, err["code"]) == (400, "invalid_adapter"), err
        assert err["message"].startswith("adapter 'huge@1' produced non-finite logits (inf/NaN)")
    status, err = error("injected fault")
    assert (status, err["code"]) == (500, "internal_error")
    assert err["message"] == "internal error while sampling this request (RuntimeError); see the server log"
    chat_status, (chat_text, chat_events) = replies["chat 1e-300"]
    assert chat_status == 200 and not any("error" in ev for ev in chat_events)
    assert chat_text == chat_greedy["choices"][0]["message"]["content"]
