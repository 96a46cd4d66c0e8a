"""The replica's output stream: deltas that pile up while the consumer is busy leave as one delta per choice, all
choices in one item (a DeltaBatch), and the reply speaks app/protocol.py (a ReplicaHello, ChoiceDeltas or
DeltaBatches, or one Failure); the ingress's ReplicaStream hands a batch's deltas out one at a time."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from app.config.app_config import AppConfig
from app.errors import AdapterUnavailable
from app.protocol import ChoiceDelta, DeltaBatch, Failure, ReplicaHello, ReplicaRequest
from app.replica.core import ReplicaCore
from app.replica.deployment import reply_items
from app.replica.fan_in import PreparedPrompt, fan_in
from app.replica.output_state import Delta
from tests.fixtures.fake_kernel import FakeKernel


class BurstKernel(FakeKernel):
    """generate() yields its deltas without awaiting in between, as an engine step that finished several
    tokens before the event loop ran would; a failed sequence raises its error, as LLMKernel.generate does."""

    def __init__(self, words: list[str], fail_after: int | None = None):
        self.words, self.fail_after = words, fail_after

    async def generate(self, prompt, adapter, **kw):
        for i, w in enumerate(self.words):
            if self.fail_after is not None and i == self.fail_after:
                raise AdapterUnavailable("adapter x could not be loaded")
            last = i == len(self.words) - 1
            yield Delta(w, [i], "length" if last else None, 3, i + 1)


def core(kernel) -> ReplicaCore:
    return ReplicaCore(AppConfig(model="m", redis_url=None), "r1", kernel=kernel, catalog=None)


async def collect(c: ReplicaCore, n: int = 1) -> list[ChoiceDelta | DeltaBatch]:
    request = ReplicaRequest("r", prompts=("p",), n=n)
    prompts = [PreparedPrompt([1], "p")]
    return [item async for item in fan_in(c.kernel, request, prompts, c._logprob_text)]


def test_piled_up_deltas_leave_as_one_item_with_one_delta_per_choice(monkeypatch):
    monkeypatch.delenv("LORALAND_REDIS_URL", raising=False)
    [batch] = asyncio.run(collect(core(BurstKernel([" a", " b", " c"])), n=2))
    # Both choices ran to the end before the consumer first ran: one message, one delta per choice, each whole.
    assert isinstance(batch, DeltaBatch)
    items = batch.deltas
    assert sorted(i.index for i in items) == [0, 1]
    for it in items:
        assert (it.text, it.finish_reason, it.completion_tokens, it.prompt_tokens) == (
            " a b c",
            "length",
            3,
            3,
        )


def test_an_abort_in_a_burst_is_still_raised(monkeypatch):
    monkeypatch.delenv("LORALAND_REDIS_URL", raising=False)
    with pytest.raises(AdapterUnavailable, match="could not be loaded"):
        asyncio.run(collect(core(BurstKernel([" a", " b"], fail_after=1))))


def test_generate_replies_with_a_hello_then_deltas_or_one_failure(monkeypatch):
    monkeypatch.delenv("LORALAND_REDIS_URL", raising=False)

    async def reply(kernel) -> list:
        request = ReplicaRequest("cmpl-1", prompts=("p",), n=2)
        return [item async for item in reply_items(core(kernel), request)]

    ok = asyncio.run(reply(BurstKernel([" a", " b"])))
    assert ok[0] == ReplicaHello("r1") and all(isinstance(i, DeltaBatch) for i in ok[1:])
    assert sorted(d.index for i in ok[1:] for d in i.deltas) == [0, 1]
    assert pickle.loads(pickle.dumps(ok)) == ok
    failed = asyncio.run(reply(BurstKernel([" a", " b"], fail_after=1)))
    assert failed[0] == ReplicaHello("r1") and isinstance(failed[-1], Failure)
    assert failed[-1] == Failure("AdapterUnavailable", "adapter x could not be loaded", retryable=True)
    assert pickle.loads(pickle.dumps(failed)) == failed  # what crosses Ray is plain picklable data


class ListBackend:
    """A Backend whose replica replies with the given items."""

    def __init__(self, items: list):
        self.items = items

    def stream(self, request):
        async def items():
            for it in self.items:
                yield it

        return items()


def test_replica_stream_hands_a_batch_out_one_delta_at_a_time():
    from app.router.routing.replica_client import ReplicaStream

    items = [
        ReplicaHello("r1"),
        DeltaBatch((ChoiceDelta(0, "a", None, 3, 1), ChoiceDelta(1, "x", None, 3, 1))),
        ChoiceDelta(1, "y", "length", 3, 2),
        DeltaBatch((ChoiceDelta(0, "b", "stop", 3, 2),)),
    ]

    async def read() -> tuple[list, ReplicaStream]:
        s = ReplicaStream(ListBackend(items), ReplicaRequest("cmpl-1", prompts=("p",), n=2), 5.0)
        got = [await s.open()]
        while (d := await s.next()) is not None:
            got.append(d)
        return got, s

    got, s = asyncio.run(read())
    assert [(d.index, d.text) for d in got] == [(0, "a"), (1, "x"), (1, "y"), (0, "b")]
    assert s.replica == "r1"
    assert {i: (c.text, c.finish_reason) for i, c in s.choices.items()} == {
        0: ("ab", "stop"),
        1: ("xy", "length"),
    }
