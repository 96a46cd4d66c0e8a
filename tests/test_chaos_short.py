"""A short chaos run (load_tests/chaos/chaos.py) in the suite: a real Ray cluster with 2 replicas and 2 ingress replicas,
real Redis, moto's S3 server, a mixed load over 8 adapters, chains and merges, streaming and not, with client
disconnects, while each fault is injected once: kill -9 of a replica worker, Redis killed and restarted, S3
stopped and started, kill -9 of one ingress replica. Every 200 must be the single-request greedy reference
(wrong = 0), nothing may be lost (no answer, a hang, a 5xx without an OpenAI message, a stream cut without
[DONE]), and every adapter must serve again within 30 s of each fault's end.

The ingress kill: Serve's HTTP proxy runs IngressLossMiddleware (app/router/http/middleware.py), so a request the
killed ingress held and had not answered is sent again (the other ingress answers it; the answer carries
x-loraland-ingress-retried), and a stream that had started ends with a 503 error event and [DONE]. The only
clean errors that fault may cause are those (load_tests/chaos/chaos.md, "The ingress kill").

The middleware's own cases (fake proxies, no Ray) run first and fast. The chaos run needs a loopback-only
network namespace (Ray probes the network): skipped elsewhere."""

from __future__ import annotations

import asyncio
import json

import pytest

from load_tests.chaos.chaos import FAULTS, ChaosConfig, chaos_stack, run_chaos, table
from load_tests.harness.local_stack import LocalStack, in_offline_namespace

ray_chaos = [pytest.mark.ray, pytest.mark.timeout(900)]
# What each fault may answer besides 200s: clean errors by note prefix (status:code). Anything else is a bug.
ALLOWED_CLEAN = {
    "ingress": ("503:ingress_unavailable", "stream 503:ingress_unavailable"),
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    if not in_offline_namespace():
        pytest.skip("needs a loopback-only network namespace: ../shared/tools/offline pytest ...")
    cfg = ChaosConfig(concurrency=4, pre_s=2.0, down_s=3.0, post_s=5.0, recovery_timeout_s=90.0)
    with LocalStack(chaos_stack(adapters=8, cold=2), workdir=tmp_path_factory.mktemp("chaos")) as stack:
        out = run_chaos(stack, cfg)
    print("\n" + table(out))
    return {r.fault: r for r in out}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_no_wrong_answers_and_recovery_within_30s(rows, fault):
    row = rows[fault]
    assert row.sent > 0 and row.ok > 0, table([row])
    assert row.wrong == 0, table([row])
    assert row.recovery_s is not None and row.recovery_s < 30.0, table([row])


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_nothing_lost(rows, fault):
    row = rows[fault]
    assert row.lost == 0, table([row])


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_ingress_kill_answers_every_request_it_held(rows):
    """One ingress of two killed under load: 0 lost, 0 wrong; the only non-200s are the middleware's own 503s
    (code ingress_unavailable: a started stream cut, or a request whose retries failed too); every request the
    dead ingress held unanswered comes back as a 200 marked retried."""
    row = rows["ingress"]
    assert row.lost == 0 and row.wrong == 0, table([row])
    allowed = ALLOWED_CLEAN["ingress"]
    others = {n: c for n, c in row.notes.items() if n.startswith("clean:") and not n[6:].startswith(allowed)}
    assert not others, table([row])
    assert row.clean <= 4, table([row])  # at most the 4 requests in flight (concurrency 4) at the kill
    assert row.ok + row.clean + row.abandoned == row.sent, table([row])


# ---------------------------------------------------------------------------------------------- the middleware


def _through(app, method="POST", path="/v1/completions", body=b'{"model":"a"}', disconnect=False):
    from app.router.http.middleware import IngressLossMiddleware

    sent, pending = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    asyncio.run(IngressLossMiddleware(app, backoff_s=0)(scope, receive, send))
    return sent


def _start(status=200, ctype=b"application/json"):
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]}


def _body(data, more=False):
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_request_whose_ingress_died_unanswered_is_sent_again_with_its_body():
    bodies = []

    async def proxy(scope, receive, send):
        bodies.append((await receive())["body"])
        if len(bodies) == 1:
            return  # the proxy's ActorDiedError: nothing sent (uvicorn would answer a bare 500)
        await send(_start())
        await send(_body(b"{}"))

    out = _through(proxy)
    assert bodies == [b'{"model":"a"}'] * 2
    assert out[0]["status"] == 200 and (b"x-loraland-ingress-retried", b"1") in out[0]["headers"]


def test_retries_spent_or_a_non_idempotent_route_get_a_503_with_an_openai_error_and_retry_after():
    from tests.fixtures.inproc_stack import openai_error

    tries = []

    async def proxy(scope, receive, send):
        tries.append(1)
        await receive()

    for path, want_tries in (("/v1/chat/completions", 3), ("/v1/adapters", 1)):
        tries.clear()
        out = _through(proxy, path=path)
        assert len(tries) == want_tries, path
        assert out[0]["status"] == 503 and (b"retry-after", b"1") in out[0]["headers"]
        body = json.loads(out[1]["body"])
        assert openai_error(body) is None and body["error"]["code"] == "ingress_unavailable"


def test_a_stream_whose_ingress_died_before_its_first_event_is_retried_after_that_one_ends_with_an_error():
    tries = []

    async def before_first_event(scope, receive, send):
        tries.append(1)
        await send(_start(ctype=b"text/event-stream"))  # held: no bytes reach the client yet
        if len(tries) == 2:
            await send(_body(b"data: [DONE]\n\n"))

    out = _through(before_first_event)
    assert len(tries) == 2 and out[-1]["body"] == b"data: [DONE]\n\n"

    async def mid_stream(scope, receive, send):
        await send(_start(ctype=b"text/event-stream"))
        await send(_body(b'data: {"choices":[]}\n\n', more=True))

    out = _through(mid_stream)
    assert out[-1]["more_body"] is False
    event, done = out[-1]["body"].decode().strip().split("\n\n")
    assert json.loads(event[len("data: ") :])["status"] == 503 and done == "data: [DONE]"


def test_normal_answers_pass_through_and_a_client_that_left_gets_no_retry():
    async def ok(scope, receive, send):
        await send(_start(404))
        await send(_body(b'{"error":{}}'))

    out = _through(ok, method="GET", path="/nope", body=b"")
    assert [m.get("status") for m in out] == [404, None]
    assert out[0]["headers"] == [(b"content-type", b"application/json")]
    tries = []

    async def gone(scope, receive, send):
        tries.append(1)
        await receive()
        await receive()  # the client's disconnect

    assert _through(gone, disconnect=True) == [] and len(tries) == 1


def test_the_proxys_own_plain_text_errors_get_the_openai_shape():
    async def unavailable(scope, receive, send):
        await send(_start(503, b"text/plain; charset=utf-8"))
        await send(_body(b"Deployment unavailable"))

    out = _through(unavailable, method="GET", path="/v1/models", body=b"")
    assert out[0]["status"] == 503 and (b"retry-after", b"1") in out[0]["headers"]
    assert "Deployment unavailable" in json.loads(out[1]["body"])["error"]["message"]
