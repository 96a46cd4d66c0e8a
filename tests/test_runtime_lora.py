"""vLLM's runtime LoRA API (issue 34) over HTTP against the in-process stack (tests/fixtures/inproc_stack.py: the
real FastAPI ingress over ReplicaCore on the tiny LLMKernel, a real Catalog on a real redis-server).

The client side replays what an RL trainer that drives vLLM sends (vLLM's documented runtime-LoRA calls, as
SkyRL's and ART's weight sync do over HTTP: POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace":
true} after each step, then OpenAI completions with `model: lora_name`), with plain httpx; TRL is not installed
here. Every served answer is checked token for token against an in-process LLMKernel holding that version's
folder, and against the version the `x-loraland-adapter-version` header names."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.inproc_stack import InprocStack, module_stack, openai_error
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_tiny_adapter

PROMPT = "the quick brown fox"
HDR = "x-loraland-adapter-version"


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory) -> Iterator[InprocStack]:  # noqa: F811
    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "runtime-lora")


@pytest.fixture(scope="module")
def oracle(llama_dir):
    from loraland import LLMKernel

    k = LLMKernel(llama_dir, max_adapters=8, max_batch_size=4, dtype="float32")
    yield k
    k.close()


def reference(oracle, name: str, folder: Path, version: int, max_tokens: int = 8) -> str:
    ref = f"{name}-ref@{version}"
    if ref not in oracle.adapters():
        oracle.load_adapter(f"{name}-ref", folder, version=version)
    return oracle.complete([PROMPT], [ref], max_tokens=max_tokens)[0].text


def load(stack, client, name, path, who="admin", inplace=None):
    body = {"lora_name": name, "lora_path": str(path)}
    if inplace is not None:
        body["load_inplace"] = inplace
    return client.post("/v1/load_lora_adapter", json=body, headers=stack.headers(who))


def complete(stack, client, model, who="admin", stream=False):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream}
    return client.post("/v1/completions", json=body, headers=stack.headers(who))


def text_of(r) -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        parts = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return "".join(p["choices"][0]["text"] for p in parts if p.get("choices"))
    return r.json()["choices"][0]["text"]


def vllm_error(r, status: int, type_: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_ and err["code"] == status and err["message"], err
    assert "param" in err


def test_load_serve_load_inplace_unload(stack, oracle):
    root = stack.root
    v1 = write_tiny_adapter(root / "rl" / "step-1", seed=11)
    v2 = write_tiny_adapter(root / "rl" / "step-2", seed=12)
    ref1, ref2 = reference(oracle, "rl", v1, 1), reference(oracle, "rl", v2, 2)
    assert ref1 != ref2  # the two versions answer differently, so a wrong one is seen

    async def go(c):
        r = await load(stack, c, "rl", v1)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rl' added successfully.", r.text
        assert r.headers["content-type"].startswith("text/plain") and r.headers[HDR] == "rl@1"
        r = await complete(stack, c, "rl")
        assert r.status_code == 200 and r.headers[HDR] == "rl@1" and text_of(r) == ref1

        r = await load(stack, c, "rl", v2)  # no load_inplace: vLLM's 400, nothing changes
        vllm_error(r, 400, "InvalidUserInput")
        assert "load_inplace" in r.json()["error"]["message"]
        assert [x.version for x in stack.catalog.versions("rl")] == [1]

        r = await load(stack, c, "rl", v2, inplace=True)
        assert r.status_code == 200 and r.headers[HDR] == "rl@2", r.text
        for stream in (False, True):  # the very next request, plain or streamed, is served by v2
            r = await complete(stack, c, "rl", stream=stream)
            assert r.status_code == 200 and r.headers[HDR] == "rl@2" and text_of(r) == ref2, r.text
        stack.core.sync.heartbeat_once()  # the replica's next heartbeat, now
        r = await c.get("/v1/residency", headers=stack.headers("admin"))
        assert r.status_code == 200, r.text
        (rep,) = [x for x in r.json()["replicas"] if x["replica_id"] == "local-0"]
        held = {a["ref"]: a for a in rep["adapters"]}
        assert held["rl@2"]["adapter"] == "rl" and held["rl@2"]["version"] == 2
        assert held["rl@2"]["tier"] in ("device", "host") and rep["free_slots"] >= 0
        assert (await c.get("/v1/residency", headers=stack.headers("alpha"))).status_code == 403

        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "rl"}, headers=stack.headers("admin"))
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rl' removed successfully.", r.text
        assert stack.catalog.get("rl") is None
        r = await complete(stack, c, "rl")
        assert r.status_code == 404 and openai_error(r.json()) is None, r.text
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "rl"}, headers=stack.headers("admin"))
        vllm_error(r, 404, "NotFoundError")

    stack.run(go)


def test_rl_trainer_weight_sync_replay(stack, oracle):
    """An RL loop's HTTP calls as a vLLM client makes them: each step writes a new folder (previous weights plus
    noise) and loads it in place under one name; the rollouts that follow use it."""
    folders = [write_tiny_adapter(stack.root / "policy" / f"step-{i}", seed=40 + i) for i in range(3)]

    async def go(c):
        for step, folder in enumerate(folders, start=1):
            r = await load(stack, c, "policy", folder, inplace=step > 1)
            assert r.status_code == 200, r.text
            r = await complete(stack, c, "policy")
            assert r.headers[HDR] == f"policy@{step}"
            assert text_of(r) == reference(oracle, "policy", folder, step)
        await c.post("/v1/unload_lora_adapter", json={"lora_name": "policy"}, headers=stack.headers("admin"))

    stack.run(go)


def test_bad_input_is_4xx_and_changes_nothing(stack, tmp_path):
    from app.config.kernel_config import KernelConfig

    root = stack.root
    outside = write_tiny_adapter(tmp_path / "outside", seed=1)
    not_adapter = root / "junk"
    not_adapter.mkdir()
    (not_adapter / "weights.txt").write_text("not an adapter")
    big = write_tiny_adapter(root / "big-rank", rank=KernelConfig.max_lora_rank + 8, seed=2)
    other_base = write_tiny_adapter(root / "other-base", kind="llama-mqa-rope3", seed=3)
    cases = {
        "outside-roots": (outside, 400),
        "not-adapter": (not_adapter, 400),
        "rank-over-max": (big, 400),
        "base-mismatch": (other_base, 400),
        "no-such-folder": (root / "nope", 404),
    }

    async def go(c):
        for name, (path, status) in cases.items():
            r = await load(stack, c, f"bad-{name}", path)
            vllm_error(r, status, "BadRequestError" if status == 400 else "NotFoundError")
            assert stack.catalog.get(f"bad-{name}") is None, name
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=stack.headers("admin"))
        vllm_error(r, 400, "InvalidUserInput")
        r = await c.post("/v1/load_lora_adapter", content=b"{nope", headers=stack.headers("admin"))
        assert r.status_code == 400 and stack.catalog.get("x") is None
        # A bad version of an existing name leaves its newest version as it was.
        good = write_tiny_adapter(root / "keep" / "v1", seed=5)
        assert (await load(stack, c, "keep", good)).status_code == 200
        vllm_error(await load(stack, c, "keep", big, inplace=True), 400, "BadRequestError")
        assert [x.version for x in stack.catalog.versions("keep")] == [1]

    stack.run(go)


def test_owner_keys(stack):
    folder = write_tiny_adapter(stack.root / "alpha-rl", seed=21)

    async def go(c):
        r = await load(stack, c, "alpha-rl", folder, who=None)
        vllm_error(r, 401, "AuthenticationError")
        r = await load(stack, c, "alpha-rl", folder, who="alpha")
        assert r.status_code == 200, r.text
        rec = stack.catalog.get("alpha-rl")
        assert rec.tenant == "alpha" and not rec.public
        assert (await complete(stack, c, "alpha-rl", who="alpha")).status_code == 200
        assert (await complete(stack, c, "alpha-rl", who="beta")).status_code == 404
        vllm_error(
            await load(stack, c, "alpha-rl", folder, who="beta", inplace=True), 403, "PermissionDeniedError"
        )
        r = await c.post(
            "/v1/unload_lora_adapter", json={"lora_name": "alpha-rl"}, headers=stack.headers("beta")
        )
        vllm_error(r, 404, "NotFoundError")
        assert (await load(stack, c, "alpha-rl", folder, who="alpha", inplace=True)).headers[
            HDR
        ] == "alpha-rl@2"
        r = await c.post(
            "/v1/unload_lora_adapter", json={"lora_name": "alpha-rl"}, headers=stack.headers("alpha")
        )
        assert r.status_code == 200 and stack.catalog.get("alpha-rl") is None

    stack.run(go)


def test_residency_events_stream(stack):
    folder = write_tiny_adapter(stack.root / "ev", seed=31)

    async def go(c):
        url = "/v1/residency/events?duration_s=1.5&poll_s=0.1"
        assert (await c.get(url, headers=stack.headers("alpha"))).status_code == 403
        r = await c.get("/v1/residency/events?poll_s=-1", headers=stack.headers("admin"))
        assert r.status_code == 400 and openai_error(r.json()) is None, r.text

        async def later():
            await asyncio.sleep(0.4)
            assert (await load(stack, c, "ev", folder)).status_code == 200
            await complete(stack, c, "ev")
            stack.core.sync.heartbeat_once()

        task = asyncio.create_task(later())
        r = await c.get(url, headers=stack.headers("admin"))
        await task
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[0]["type"] == "snapshot" and "replicas" in events[0]
        kinds = {(e["type"], e.get("ref") or e.get("adapter")) for e in events[1:]}
        assert ("registered", "ev") in kinds, events
        assert ("loaded", "ev@1") in kinds, events

    stack.run(go)


def test_pinned_older_version_after_newer(llama_dir, tmp_path):
    from loraland import LLMKernel

    k = LLMKernel(llama_dir, max_adapters=4, max_batch_size=4, dtype="float32")
    folders = [write_tiny_adapter(tmp_path / f"a{i}", seed=i) for i in range(4)]
    """A request pinned to name@1 once name@2 is held re-registers v1: the entry comes back with its device slot
    (it used to be replaced, leaking the slot, until installs failed on every step)."""
    try:
        outs = []
        for version, folder in ((1, folders[0]), (2, folders[1]), (1, folders[0])):
            k.load_adapter("rl", folder, version=version)
            outs.append(k.complete([PROMPT], [f"rl@{version}"], max_tokens=4, ignore_eos=True)[0].token_ids)
        for i in (2, 3):
            k.load_adapter(f"p{i}", folders[i], version=1)
            k.complete([PROMPT], [f"p{i}@1"], max_tokens=2)
        assert outs[2] == outs[0] != outs[1]  # v1 again is v1's weights
        assert k.adapter_manager.free_slots() >= 0
    finally:
        k.close()
