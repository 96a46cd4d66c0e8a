"""A request is checked whole before the replica fetches anything for it, and its cold adapters load together.

In-process stack (tests/fixtures/inproc_stack.py: the real FastAPI ingress over a real ReplicaCore on the tiny
model, a real Catalog on a real redis-server). Every adapter read is counted by wrapping the kernel's
`load_adapter`, which is what a fetch runs (hub fetch + parse) for a version the replica does not hold yet.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.fixtures.inproc_stack import module_stack, openai_error
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.tiny_adapter import write_tiny_adapter

LOAD_S = 0.4  # each load is slowed to this, so loads in series and loads side by side tell apart


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "vbf")


@pytest.fixture
def loads(stack, monkeypatch):
    """(name, start, end) of every adapter load the replica makes during the test, each taking >= LOAD_S."""
    seen: list[tuple[str, float, float]] = []
    lock = threading.Lock()
    real = stack.kernel.load_adapter

    def counted(name, source, **kw):
        t0 = time.monotonic()
        time.sleep(LOAD_S)
        real(name, source, **kw)
        with lock:
            seen.append((name, t0, time.monotonic()))

    monkeypatch.setattr(stack.kernel, "load_adapter", counted)
    return seen


def cold(stack, *names: str) -> None:
    for i, name in enumerate(names):
        stack.register(name, write_tiny_adapter(stack.root / name, seed=900 + i), public=True)


def post(stack, body: dict):
    async def go(client):
        return await client.post("/v1/completions", json=body, headers=stack.headers("alpha"))

    return stack.run(go)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_p": 2}, "top_p"),  # the ingress's own check (SamplingParams, built once there)
        ({"temperature": -1}, "temperature"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),  # needs the model's vocabulary: the replica checks it
        ({"prompt": [999999]}, None),  # a token id outside the vocabulary
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            None,
        ),
    ],
)
def test_a_bad_parameter_for_a_cold_adapter_is_a_400_without_any_fetch(stack, loads, extra, param):
    name = f"cold-{len(stack.catalog.list(None))}"
    cold(stack, name)
    r = post(stack, {"model": name, "prompt": "hello", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert openai_error(r.json()) is None
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text
    assert loads == [], "a request that cannot run must not fetch its adapter"
    # The same request, fixed, fetches it once and runs.
    ok = post(stack, {"model": name, "prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert [n for n, *_ in loads] == [name]


def test_a_merge_of_three_cold_adapters_loads_them_side_by_side(stack, loads):
    cold(stack, "m1", "m2", "m3")
    t0 = time.monotonic()
    r = post(stack, {"model": "m1*0.5+m2*0.3+m3*0.2", "prompt": "hello", "max_tokens": 2})
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert sorted(n for n, *_ in loads) == ["m1", "m2", "m3"]
    # Concurrent: every load started before any ended (in series they would take >= 3 x LOAD_S).
    assert max(start for _, start, _ in loads) < min(end for *_, end in loads), loads
    assert took < 2 * LOAD_S + 5.0  # generous for a loaded machine; in series it is >= 3 x LOAD_S + the rest
