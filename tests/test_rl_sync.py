"""RL weight sync against the real ingress (issue 34): the HTTP calls an RL trainer makes to a vLLM server for
LoRA sync, fast swaps (a new version pushed to the replicas that hold the name before it becomes the newest), and
old versions pruned so memory stays flat however many versions a name gets.

The stack is tests/fixtures/inproc_stack.py: the FastAPI ingress over ReplicaCore on the tiny LLMKernel, a real
Catalog on a real redis-server, and the replica's catalog listener (pushes arrive by pub/sub, as on Ray). The
trainer side is a replay of what TRL's / verl's / SkyRL's vLLM weight sync sends over HTTP (TRL is not installed
here): POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true} after each step, then OpenAI
completions with `model: lora_name` through the `openai` SDK, and an unload at the end. Each version's greedy
answers are compared with HF transformers + PEFT holding that version's folder."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.fixtures.inproc_stack import ADMIN, InprocStack, module_stack
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_tiny_adapter
from tests.hf_oracle import hf_greedy

PROMPTS = ["the quick brown fox", "once upon a time"]
MAX_TOKENS = 8
HDR, WARM = "x-loraland-adapter-version", "x-loraland-warm-replicas"


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory) -> Iterator[InprocStack]:  # noqa: F811
    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "rl-sync")


def hf_peft_texts(model_dir: Path, folder: Path, max_tokens: int = MAX_TOKENS) -> dict[str, str]:
    """HF transformers + PEFT greedy text of each prompt under the adapter in `folder` (EOS ignored)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    out = {}
    for p in PROMPTS:
        ids = hf_greedy(model, tok.encode(p, add_special_tokens=False), max_tokens)
        out[p] = tok.decode(ids, skip_special_tokens=True)
    return out


def load_body(name: str, folder: Path) -> dict:
    return {"lora_name": name, "lora_path": str(folder), "load_inplace": True}  # what the trainers send


def test_trainer_weight_sync_replay_matches_hf_peft(stack, llama_dir):
    name, admin = "policy-sync", {"Authorization": f"Bearer {ADMIN}"}
    folders = [write_tiny_adapter(stack.root / name / f"step-{i}", seed=70 + i) for i in range(1, 4)]
    expected = [hf_peft_texts(llama_dir, f) for f in folders]
    assert expected[0] != expected[1] != expected[2]  # a wrong version would be seen

    async def go(c):
        import openai

        oai = openai.AsyncOpenAI(base_url="http://ll/v1", api_key=ADMIN, http_client=c, max_retries=0)
        for step, (folder, texts) in enumerate(zip(folders, expected), start=1):
            r = await c.post("/v1/load_lora_adapter", json=load_body(name, folder), headers=admin)
            assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' added successfully."
            ref = f"{name}@{step}"
            assert r.headers[HDR] == ref
            if step > 1:  # pushed to the replica holding the name before the call returned: no cold path
                assert r.headers[WARM] == "1/1", r.headers
                assert ref in stack.core.stats().resident and not stack.core.fetcher.loading
            for prompt in PROMPTS:
                raw = await oai.completions.with_raw_response.create(
                    model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                assert raw.headers[HDR] == ref
                assert raw.parse().choices[0].text == texts[prompt], (step, prompt)
            stack.core.sync.heartbeat_once()  # the catalog now lists this replica as holding the name
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin)
        assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' removed successfully."
        with pytest.raises(openai.NotFoundError):
            await oai.completions.create(model=name, prompt=PROMPTS[0], max_tokens=2)

    stack.run(go)


def test_requests_on_the_old_version_finish_on_it(stack):
    """A stream running on v1 when v2 is pushed finishes on v1 (held mid-generation until the load returned); a
    request pinned to v1 after the swap is served by v1 (held beside v2, not fetched again); unpinned requests
    get v2."""
    name, admin = "swap", stack.headers("admin")
    v1, v2 = (write_tiny_adapter(stack.root / name / f"v{i}", seed=90 + i) for i in (1, 2))
    body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    gate, held = threading.Event(), threading.Event()

    def hold(seq) -> None:  # the engine thread: v1's stream waits after 4 tokens until v2 is loaded
        if seq.adapter == f"{name}@1" and len(seq.output_ids) == 4 and not gate.is_set():
            held.set()
            gate.wait(timeout=60)

    async def go(c):
        assert (
            await c.post("/v1/load_lora_adapter", json=load_body(name, v1), headers=admin)
        ).status_code == 200
        want_v1 = (await c.post("/v1/completions", json=body, headers=admin)).json()["choices"][0]["text"]
        stack.core.sync.heartbeat_once()
        v1_entry = stack.kernel.adapter_manager.entries[f"{name}@1"]
        stack.kernel.set_fault_hook(hold)
        try:
            stream = asyncio.create_task(
                c.post("/v1/completions", json={**body, "stream": True}, headers=admin)
            )
            assert await asyncio.to_thread(held.wait, 60)  # running on v1, 4 tokens out
            r = await c.post("/v1/load_lora_adapter", json=load_body(name, v2), headers=admin)
            assert r.status_code == 200 and r.headers[HDR] == f"{name}@2" and r.headers[WARM] == "1/1"
            assert v1_entry.pending == 1  # the stream is still running on v1
            gate.set()
            s = await stream
        finally:
            gate.set()
            stack.kernel.set_fault_hook(None)
        assert s.headers[HDR] == f"{name}@1"
        chunks = s.text.splitlines()
        events = [json.loads(x[6:]) for x in chunks if x.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == want_v1
        pinned = await c.post("/v1/completions", json={**body, "model": f"{name}@1"}, headers=admin)
        assert pinned.headers[HDR] == f"{name}@1" and pinned.json()["choices"][0]["text"] == want_v1
        assert stack.kernel.adapter_manager.entries.get(f"{name}@1") is v1_entry  # served as held, no reload
        new = await c.post("/v1/completions", json=body, headers=admin)
        assert new.headers[HDR] == f"{name}@2" and new.json()["choices"][0]["text"] != want_v1
        await c.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin)

    stack.run(go)


def test_old_versions_are_pruned_memory_stays_flat(stack):
    """20 versions of one name, each loaded in place and used once: the replica drops the old ones (device
    slots, host copies, registry entries flat), and the catalog keeps the newest MAX_VERSIONS."""
    from app.catalog.registry import MAX_VERSIONS

    name, admin, n = "churny", stack.headers("admin"), MAX_VERSIONS + 4
    m, core = stack.kernel.adapter_manager, stack.core
    m.superseded_grace_s = 0.0  # no request of this test is pinned to an old version
    seen: list[tuple[int, int, int, int]] = []

    async def go(c):
        for i in range(1, n + 1):
            folder = write_tiny_adapter(stack.root / name / f"step-{i}", seed=500 + i)
            r = await c.post("/v1/load_lora_adapter", json=load_body(name, folder), headers=admin)
            assert r.status_code == 200 and r.headers[HDR] == f"{name}@{i}", r.text
            body = {"model": name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
            assert (await c.post("/v1/completions", json=body, headers=admin)).status_code == 200
            await asyncio.sleep(0.3)  # past PRUNE_EVERY_S: the next request's steps prune
            core.sync.heartbeat_once()
            used = m.max_adapters - m.free_slots()
            seen.append((used, m.host_count(), len(m.entries), len(core.fetcher.refs_of(name, None))))

    try:
        stack.run(go)
    finally:
        m.superseded_grace_s = 2.0
    half = len(seen) // 2
    for k, what in enumerate(("device slots", "host copies", "registry entries", "held versions")):
        first, second = [s[k] for s in seen[2:half]], [s[k] for s in seen[half:]]
        assert max(second) <= max(first), (what, seen)  # flat: the second half holds no more than the first
    assert max(s[3] for s in seen) <= 2, seen  # the newest version, and at most the one before it
    versions = [r.version for r in stack.catalog.versions(name)]
    assert versions == list(range(n - MAX_VERSIONS + 1, n + 1))


def test_catalog_staged_versions_and_warm_answers(stack):
    """Staged versions are pinnable but not the newest until promoted; replicas' answers to a push."""
    from app.protocol import ReplicaStats
    from app.replica.lora.peft_format import adapter_summary

    cat, folder = stack.catalog, write_tiny_adapter(stack.root / "staged" / "v", seed=7)
    stack.register("staged", folder)  # v1, the newest at once
    info = adapter_summary(folder)
    fields = {k: info[k] for k in ("files", "size", "rank", "alpha", "target_modules")}
    v2 = cat.register("staged", str(folder), base_model={}, staged=True, **fields)
    v3 = cat.register("staged", str(folder), base_model={}, staged=True, **fields)
    assert (v2.version, v3.version, cat.get("staged").version) == (2, 3, 1)  # staged: not yet the newest
    assert cat.get("staged@2").version == 2  # but pinnable
    assert cat.promote("staged@3") is True and cat.get("staged").version == 3
    assert cat.promote("staged@2") is False and cat.get("staged").version == 3  # a newer one stays
    cat.remove("staged@2")
    assert cat.promote("staged@2") is None

    cat.heartbeat(ReplicaStats(replica_id="r-a", resident=("staged@3",)), load=0.0)
    cat.heartbeat(ReplicaStats(replica_id="r-b", resident=("other@1",)), load=0.0)
    assert "r-a" in cat.holders("staged") and "r-b" not in cat.holders("staged")
    cat.note_warm("staged@3", "r-a", "warm")
    cat.note_warm("staged@3", "r-c", "failed: no space")
    assert cat.warm_acks("staged@3") == {"r-a": "warm", "r-c": "failed: no space"}
    for rid in ("r-a", "r-b"):
        cat.drop_replica(rid)
    cat.remove("staged")


def test_a_holder_the_heartbeats_missed_is_waited_for(stack):
    """A replica that picked the name up after its last heartbeat (not among the listed holders) answers
    "loading" as its push begins, and the load waits for it: warm there before the call returns."""
    name, admin = "late-holder", stack.headers("admin")
    v1, v2 = (write_tiny_adapter(stack.root / name / f"v{i}", seed=150 + i) for i in (1, 2))
    body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}

    async def go(c):
        r = await c.post("/v1/load_lora_adapter", json=load_body(name, v1), headers=admin)
        assert r.status_code == 200 and r.headers[WARM] == "0/0"  # a new name: nobody holds it
        assert (await c.post("/v1/completions", json=body, headers=admin)).status_code == 200
        stack.catalog.drop_replica(stack.core.replica_id)  # as if it picked the name up after its last beat
        load = stack.kernel.load_adapter

        def slow_load(*a, **kw):  # the push takes longer than the ingress's look for unlisted holders
            time.sleep(0.3)
            return load(*a, **kw)

        stack.kernel.load_adapter = slow_load
        try:
            r = await c.post("/v1/load_lora_adapter", json=load_body(name, v2), headers=admin)
        finally:
            del stack.kernel.load_adapter
        assert r.status_code == 200 and r.headers[WARM] == "1/1", r.headers
        assert f"{name}@2" in stack.core.stats().resident and not stack.core.fetcher.loading
        await c.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin)

    stack.run(go)


def _s3_version(stack, name: str, folder: Path) -> str:
    """Register `folder` as the next version of `name` at an s3:// URI, its files already in the replica's disk
    cache (so no S3 is needed); returns the disk cache key."""
    import shutil

    from app.replica.lora.peft_format import adapter_summary

    info, cache = adapter_summary(folder), stack.core.fetcher.hub.cache
    uri = f"s3://rl-bucket/{name}/{folder.name}"
    key = stack.core.fetcher.hub.cache_key(uri, info["files"])
    with cache.staging() as tmp:
        for rel in info["files"]:
            shutil.copy(folder / rel, tmp / rel)
        cache.commit(key, tmp, {"uri": uri, "files": info["files"], "size": info["size"]}, replace=False)
    fields = {k: info[k] for k in ("files", "size", "rank", "alpha", "target_modules")}
    stack.catalog.register(name, uri, base_model=stack.kernel.model_config.identity(), **fields)
    return key


def test_removed_versions_leave_the_disk_cache(stack):
    """The disk cache's folder of a version the catalog removed goes once no request uses it; one a running
    request uses stays until it ends; one whose files a kept version shares stays."""
    name, admin = "s3-churn", stack.headers("admin")
    m, fetcher, cache = stack.kernel.adapter_manager, stack.core.fetcher, stack.core.fetcher.hub.cache
    folders = [write_tiny_adapter(stack.root / name / f"v{i}", seed=170 + i) for i in (1, 2, 3)]
    keys = [_s3_version(stack, name, f) for f in folders]
    assert _s3_version(stack, name, folders[2]) == keys[2]  # v4: v3's files again
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    gate, held = threading.Event(), threading.Event()

    def hold(seq) -> None:  # the engine thread: v2's request waits after 2 tokens
        if seq.adapter == f"{name}@2" and len(seq.output_ids) == 2 and not gate.is_set():
            held.set()
            gate.wait(timeout=60)

    def cached() -> list[bool]:
        return [cache.lookup(k) is not None for k in keys]

    async def settle(want: list[bool], c, step: bool = True) -> None:
        """Until the cache holds `want`: a base request steps the engine (which drops unused versions), then a
        heartbeat prunes the files (no request while one is held: the engine thread is the one held)."""
        for _ in range(50):
            if step:
                await c.post(
                    "/v1/completions", json={**body, "model": "tiny-llama", "max_tokens": 1}, headers=admin
                )
            stack.core.sync.heartbeat_once()
            if cached() == want:
                return
            await asyncio.sleep(0.1)
        assert cached() == want, (fetcher.doomed, fetcher.cache_keys)

    async def go(c):
        for v in (1, 2, 3, 4):
            r = await c.post("/v1/completions", json={**body, "model": f"{name}@{v}"}, headers=admin)
            assert r.status_code == 200 and r.headers[HDR] == f"{name}@{v}", r.text
        await asyncio.sleep(0.3)  # past PRUNE_EVERY_S: the next steps drop v1-v3, unused
        await settle([True, True, True], c)
        stack.kernel.set_fault_hook(hold)
        try:
            running = asyncio.create_task(
                c.post("/v1/completions", json={**body, "model": f"{name}@2"}, headers=admin)
            )
            assert await asyncio.to_thread(held.wait, 60)
            for v in (1, 2, 3):
                assert stack.catalog.remove(f"{name}@{v}") == 1
            await settle([False, True, True], c, step=False)  # v2 is in use; v3's files are v4's
            gate.set()
            assert (await running).status_code == 200
        finally:
            gate.set()
            stack.kernel.set_fault_hook(None)
        await settle([False, False, True], c)
        stack.catalog.remove(name)
        await settle([False, False, False], c)

    m.superseded_grace_s = 0.0  # versions not in use are dropped at the next step
    try:
        stack.run(go)
    finally:
        m.superseded_grace_s = 2.0
