"""Activated LoRA's base-KV reuse as metrics: after the base model served a conversation, an aLoRA request on the
same prefix counts its block-aligned prefix as reused base KV and the rest as prefilled; in the kernel's stats,
the replica's counter families, and on GET /metrics and /status/data over real HTTP."""

from __future__ import annotations

import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app import metrics
from app import metrics_core as mc
from app.replica.lora.peft_format import adapter_summary
from app.replica.metrics import ReplicaGauges
from loraland import LLMKernel
from tests.fixtures.served_stack import ADMIN, REPLICA, ServedStack
from tests.fixtures.services import redis_server  # noqa: F401
from tests.test_alora import INV_A, make_alora

pytestmark = pytest.mark.timeout(300)
REUSED, PREFILLED = "loraland_alora_base_kv_reused_tokens", "loraland_alora_prefilled_tokens"


def _conversation(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(40, 300) for _ in range(n)]


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """(replica, adapter) -> value of counter `name` in a Prometheus text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"{name}_total":
                out[(s.labels.get("replica"), s.labels["adapter"])] = s.value
    return out


def test_reuse_counted_after_a_base_conversation(llama_dir, tmp_path):
    name = f"chk-{random.randrange(1 << 30):x}"
    folder = make_alora(llama_dir, tmp_path / name, INV_A, seed=21)
    bs, conv = 8, _conversation(100, seed=3)  # 12 full blocks, then 4 tokens of a 13th
    question = conv + INV_A + [50, 60, 70]
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=128, block_size=bs) as k:
        k.load_adapter(name, folder)
        k.complete([conv], [None], max_tokens=4, ignore_eos=True)
        assert k.stats().alora_kv == {}  # the base model's requests are not counted
        assert k.complete([question], [name], max_tokens=4, ignore_eos=True)[0].alora_activated
        assert k.stats().alora_kv == {f"{name}@1": (96, len(question) - 96)}
        # without the invocation the request is the base model's: its whole cached prefix is base KV
        k.complete([conv[:50] + [61]], [name], max_tokens=2, ignore_eos=True)
        assert k.stats().alora_kv == {f"{name}@1": (96 + 48, len(question) - 96 + 3)}

        metrics.adapters(name)  # traffic, as a replica counts its requests: the label is the name if top K
        label = metrics.adapter_seen(name)
        families = ReplicaGauges("r-test", k.stats, tmp_path)()
    text = mc.text([({}, families)])
    assert _samples(text, REUSED) == {("r-test", label): 144}
    assert _samples(text, PREFILLED) == {("r-test", label): len(question) - 96 + 3}


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("alora-metrics")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("alora-metrics-cache")))
        s = ServedStack(redis_server, llama_dir, root)
    name = f"chk-{s.adapters['a']}"
    folder = make_alora(llama_dir, root / name, INV_A, seed=22)
    info = adapter_summary(folder)
    s.catalog.register(
        name, str(folder), files=info["files"], size=info["size"], rank=info["rank"], alpha=info["alpha"],
        target_modules=info["target_modules"], base_model=s.kernel.model_config.identity(), public=True,
    )  # fmt: skip
    s.adapters["alora"] = name
    yield s
    s.close()


def test_reuse_on_metrics_and_status_over_http(stack):
    """The served stack (block size 16): a base conversation of 70 tokens, then the aLoRA checker on it over
    HTTP: 64 tokens (4 blocks) come from the base model's KV; /metrics and /status/data say so."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    conv = _conversation(70, seed=4)
    question = conv + INV_A + [50, 60]
    stack.complete("alpha", "a", "warm up the ingress")  # any request: the tenant key works

    def post(model: str | None, prompt: list[int]) -> dict:
        body = {"model": model or "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
        r = httpx.post(f"{stack.base}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    post(None, conv)
    assert post(stack.adapters["alora"], question)["alora_activated"] is True
    text = httpx.get(f"{stack.base}/metrics", headers=admin, timeout=10).text
    label = metrics.adapter_seen(stack.adapters["alora"])
    assert _samples(text, REUSED)[(REPLICA, label)] == 64
    assert _samples(text, PREFILLED)[(REPLICA, label)] == len(question) - 64
    data = httpx.get(f"{stack.base}/status/data", headers=admin, timeout=10).json()
    [row] = [a for a in data["adapters"] if a["name"] == stack.adapters["alora"]]
    assert row["base_kv"] == [64, len(question) - 64]
