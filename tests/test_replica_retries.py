"""The ingress sends a request again when its replica dies before it produced output (issues 16, 17): at most
MAX_ATTEMPTS times in all, each retry and each give-up counted in loraland_replica_retries; any other failure,
and a death after a stream began, are never retried."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from app import metrics
from app.errors import QueueFull
from app.protocol import ChoiceDelta, Failure, ReplicaHello, ReplicaRequest
from app.router.http.errors import replica_failed
from app.router.routing import replica_client
from app.router.routing.replica_client import MAX_ATTEMPTS, ReplicaStream


class DyingReplicas:
    """A Backend whose n-th stream follows script[n]: "dies" (the replica dies before answering), "dies late"
    (a hello and one delta, then the replica dies), "fails" (an in-band Failure), "ok" (a whole reply)."""

    def __init__(self, *script: str):
        self.script, self.calls = list(script), 0

    def stream(self, request: ReplicaRequest):
        what = self.script[self.calls]
        self.calls += 1
        rid = f"r{self.calls}"

        async def items():
            if what == "dies":
                raise ActorDiedError()
            yield ReplicaHello(rid)
            if what == "fails":
                yield Failure("QueueFull", "the replica's queue is full", retryable=True)
                return
            yield ChoiceDelta(0, f"from {rid}", None, 3, 1)
            if what == "dies late":
                raise ActorDiedError()
            yield ChoiceDelta(0, " done", "stop", 3, 2)

        return items()

    async def call(self, method, *args):
        raise NotImplementedError


def retries() -> dict[str, float]:
    series = dict((tuple(k), v) for k, v in metrics.REPLICA_RETRIES.snapshot()[4])
    return {o: series.get((o,), 0.0) for o in ("retried", "gave_up")}


def delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(replica_client, "RETRY_PAUSE_S", (0.0,))


def stream_of(backend) -> ReplicaStream:
    return ReplicaStream(backend, ReplicaRequest("req-1"), timeout_s=5)


def test_a_request_whose_replicas_die_first_is_sent_again_until_one_answers():
    before = retries()
    backend = DyingReplicas("dies", "dies", "ok")
    s = stream_of(backend)
    first = asyncio.run(s.open())
    assert (first.text, s.replica, backend.calls) == ("from r3", "r3", 3)
    assert delta(before, retries()) == {"retried": 2, "gave_up": 0}


def test_retries_are_bounded_and_the_last_death_reaches_the_client_as_retryable():
    before = retries()
    backend = DyingReplicas(*["dies"] * (MAX_ATTEMPTS + 2))
    with pytest.raises(Exception) as e:
        asyncio.run(stream_of(backend).open())
    assert replica_failed(e.value)  # mapped to 503 replica_unavailable with Retry-After by the ingress
    assert backend.calls == MAX_ATTEMPTS
    assert delta(before, retries()) == {"retried": MAX_ATTEMPTS - 1, "gave_up": 1}


def test_collect_restarts_a_reply_cut_by_a_death_and_keeps_only_the_new_replicas_text():
    before = retries()
    backend = DyingReplicas("dies late", "dies", "ok")
    s = stream_of(backend)
    choices = asyncio.run(s.collect())
    assert choices[0].text == "from r3 done" and choices[0].finish_reason == "stop"
    assert backend.calls == 3
    assert delta(before, retries()) == {"retried": 2, "gave_up": 0}
    # the bound covers open's deaths and collect's together
    backend = DyingReplicas("dies late", "dies", "dies late", "ok")
    with pytest.raises(Exception) as e:
        asyncio.run(stream_of(backend).collect())
    assert replica_failed(e.value) and backend.calls == MAX_ATTEMPTS


def test_other_failures_and_deaths_after_streaming_began_are_not_retried():
    before = retries()
    backend = DyingReplicas("fails", "ok")
    with pytest.raises(QueueFull):
        asyncio.run(stream_of(backend).open())
    assert backend.calls == 1

    async def stream_then_die():
        s = stream_of(DyingReplicas("dies late", "ok"))
        await s.open()  # the client has this delta: the death that follows must reach it, not a restart
        await s.next()

    with pytest.raises(Exception) as e:
        asyncio.run(stream_then_die())
    assert replica_failed(e.value)
    assert delta(before, retries()) == {"retried": 0, "gave_up": 0}
