"""What one tenant can learn about another's adapters over HTTP (issue 16, security): nothing. Another tenant's
adapter, by name, by version, in a chain, in a merge, streaming or not, on either generate route, answers
exactly as a name that does not exist (same status, code, param, and message up to the name the caller sent);
listings and admin routes say nothing either; and no answer ever names an adapter the caller did not send. Also:
repeated bad API keys are throttled (app/router/http/auth.py BadKeyThrottle).

In-process stack (tests/fixtures/inproc_stack.py): tenants alpha and beta, `pub` public, `a-private` alpha's,
`b-private` and `b-secret-xyz` beta's."""

from __future__ import annotations

import pytest

from app.router.http.auth import BAD_KEY_BURST
from tests.fixtures.inproc_stack import module_stack, openai_error
from tests.fixtures.services import redis_server  # noqa: F401

FOREIGN, MISSING = "b-private", "zz-missing"
NEVER_SAID = ("b-secret-xyz", "beta")  # alpha never sends these: no answer to alpha may contain them

TEMPLATES = ["{x}", "{x}@1", "pub|{x}", "{x}|pub", "pub*0.5+{x}*0.5", "ties(pub*0.5+{x}*0.5;density=0.5)",
             "a-private|pub*0.3+{x}*0.7"]  # fmt: skip


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "leak")


def _body(chat: bool, model: str, stream: bool) -> dict:
    body = {"model": model, "max_tokens": 2, "stream": stream}
    if chat:
        return {**body, "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "prompt": "hi"}


def _same_up_to_name(foreign, missing) -> None:
    assert foreign.status_code == missing.status_code == 404, (foreign.text, missing.text)
    ef, em = foreign.json()["error"], missing.json()["error"]
    assert openai_error(foreign.json()) is None
    assert {k: ef[k] for k in ("type", "code", "param")} == {k: em[k] for k in ("type", "code", "param")}
    assert ef["message"].replace(FOREIGN, "X") == em["message"].replace(MISSING, "X")


def test_a_foreign_adapter_answers_exactly_like_a_missing_one(stack):
    async def go(client):
        out = []
        for template in TEMPLATES:
            for chat in (False, True):
                for stream in (False, True):
                    path = "/v1/chat/completions" if chat else "/v1/completions"
                    pair = []
                    for name in (FOREIGN, MISSING):
                        body = _body(chat, template.format(x=name), stream)
                        pair.append(await client.post(path, json=body, headers=stack.headers("alpha")))
                    out.append((template, chat, stream, *pair))
        return out

    for template, chat, stream, foreign, missing in stack.run(go):
        _same_up_to_name(foreign, missing)
        for word in NEVER_SAID:
            assert word not in foreign.text and word not in missing.text, (
                template,
                chat,
                stream,
                foreign.text,
            )

    # The owner can use it: the 404 above is about alpha, not a broken adapter.
    r = stack.run(
        lambda c: c.post("/v1/completions", json=_body(False, FOREIGN, False), headers=stack.headers("beta"))
    )
    assert r.status_code == 200, r.text


def test_listings_and_admin_routes_say_nothing_about_other_tenants(stack):
    async def go(client):
        models = {
            who: {
                m["id"] for m in (await client.get("/v1/models", headers=stack.headers(who))).json()["data"]
            }
            for who in ("alpha", "beta")
        }
        pairs = []
        for method, path in [("GET", "/v1/adapters/{x}"), ("DELETE", "/v1/adapters/{x}"),
                             ("GET", "/v1/adapters/{x}/quota"), ("PUT", "/v1/adapters/{x}/quota"),
                             ("GET", "/v1/adapters"), ("GET", "/v1/placement")]:  # fmt: skip
            pair = []
            for name in (FOREIGN, MISSING):
                kw = {"json": {"requests_per_minute": 1}} if method == "PUT" else {}
                pair.append(
                    await client.request(method, path.format(x=name), headers=stack.headers("alpha"), **kw)
                )
            pairs.append((method, path, *pair))
        return models, pairs

    models, pairs = stack.run(go)
    assert models["alpha"] == {"tiny-llama", "pub", "a-private"}
    assert models["beta"] == {"tiny-llama", "pub", "b-private", "b-secret-xyz"}
    for method, path, foreign, missing in pairs:
        assert foreign.status_code == missing.status_code == 403, (method, path, foreign.text)
        assert foreign.json() == missing.json(), (method, path)
        for word in (*NEVER_SAID, FOREIGN):
            assert word not in foreign.text, (method, path, foreign.text)
    assert stack.catalog.get(FOREIGN) is not None  # the DELETE with alpha's key removed nothing


def test_repeated_bad_api_keys_are_throttled(stack):
    """BAD_KEY_BURST unknown keys from one address, then 429 + Retry-After without a catalog lookup; a key the
    ingress has seen valid still passes from the same address (as for a client behind the guesser's NAT)."""

    async def go(client):
        first = await client.post(
            "/v1/completions", json=_body(False, "pub", False), headers=stack.headers("alpha")
        )
        assert first.status_code == 200, first.text
        bad = [
            await client.post(
                "/v1/completions",
                json=_body(False, "pub", False),
                headers={"Authorization": f"Bearer ll-guess-{i}"},
            )
            for i in range(50)
        ]
        good = await client.post(
            "/v1/completions", json=_body(False, "pub", False), headers=stack.headers("alpha")
        )
        return bad, good

    bad, good = stack.run(go)
    assert all(r.status_code in (401, 429) for r in bad)
    assert good.status_code == 200, good.text  # another caller's valid key is not locked out
    throttled = [r for r in bad if r.status_code == 429]
    assert throttled, "50 bad keys in a row, never a 429"
    assert throttled[0].headers.get("Retry-After") and openai_error(throttled[0].json()) is None
    assert throttled[0].json()["error"]["code"] == "too_many_invalid_keys"
    assert [r.status_code for r in bad[:BAD_KEY_BURST]] == [401] * BAD_KEY_BURST
    assert all(r.status_code == 429 for r in bad[BAD_KEY_BURST + 1 :])  # ~1 refill a second at most


def test_bad_key_throttle_refills_at_its_rate(monkeypatch):
    from app.router.http import auth

    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    t = auth.BadKeyThrottle(burst=3, per_s=0.5, max_sources=2)
    for _ in range(3):
        assert t.wait_s("a") == 0
        t.failed("a")
    assert t.wait_s("a") == pytest.approx(2.0) and t.wait_s("b") == 0 and t.wait_s(None) == 0
    now[0] += 1.0
    assert t.wait_s("a") == pytest.approx(1.0)
    now[0] += 1.0
    assert t.wait_s("a") == 0
    t.failed("b")
    t.failed("c")  # over max_sources: the least recently failing ("a") is forgotten, so it starts full
    assert list(t._buckets) == ["b", "c"] and t.wait_s("a") == 0
