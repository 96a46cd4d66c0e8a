"""Pure parts of the HTTP surface: the `model` grammar, error mapping, SSE framing, request shaping, auth."""

from __future__ import annotations

import json
import pickle

import pytest

from app.errors import (
    AdapterUnavailable,
    CatalogUnavailable,
    InvalidAdapter,
    InvalidRequest,
    LoraLandError,
    QueueFull,
    UnknownAdapter,
)
from app.names import ModelSpec, Term, parse_model, resolved
from app.protocol import ChoiceDelta, Failure
from app.replica.chat import render_chat
from app.router.http import openai_requests as bodies
from app.router.http import openai_responses as resp
from app.router.http import openai_sampling as samp
from app.router.http import openai_validation as checks
from app.router.http.errors import HTTPFailure, error_reply, replica_failed

BASE = frozenset({"tiny", "/models/tiny"})


@pytest.mark.parametrize(
    "text, kind, canonical",
    [
        ("tiny", "base", ""),
        ("/models/tiny", "base", ""),
        ("sql", "adapter", "sql"),
        ("acme/sql-expert", "adapter", "acme/sql-expert"),
        ("acme/sql@3", "adapter", "acme/sql@3"),
        ("fr|polish", "chain", "fr|polish"),
        (" fr | polish@2 ", "chain", "fr|polish@2"),
        ("a*0.7+b*0.3", "merge", "a*0.7+b*0.3"),
        ("a*.5 + b@2*1e-1", "merge", "a*0.5+b@2*0.1"),
        ("a*-1+b", "merge", "a*-1+b*1"),
    ],
)
def test_model_field_grammar(text, kind, canonical):
    spec = parse_model(text, BASE)
    assert spec.kind == kind and spec.canonical() == canonical
    assert parse_model(spec.canonical() or "tiny", BASE) == spec  # canonical form parses back to itself


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "required"),
        ("a||b", "empty chain stage"),
        ("a+", "empty merge term"),
        ("a*0.5", "only allowed in a merge"),
        ("a*zero+b", "not a number"),
        ("a*0+b", "non-zero"),
        ("a*inf+b", "not a number"),
        ("a+a*2", "twice"),
        ("bad name", "not an adapter name"),
        ("x@v2", "not an adapter name"),
        ("../etc", "not an adapter name"),
        ("|".join("abcdefghi"), "at most 8 stages"),
    ],
)
def test_model_field_errors_name_the_field(text, needle):
    with pytest.raises(InvalidRequest, match=needle) as e:
        parse_model(text, BASE)
    assert e.value.param == "model"


def test_model_field_must_be_a_string():
    with pytest.raises(InvalidRequest, match="model: required"):
        parse_model(42, BASE)


def test_resolved_pins_versions():
    spec = parse_model("a*0.5+b@2*0.5|c", BASE)
    pinned = resolved(spec, {"a": 4, "b@2": 2, "c": 1})
    assert pinned.canonical() == "a@4*0.5+b@2*0.5|c@1"
    assert [t.ref for t in pinned.terms()] == ["a@4", "b@2", "c@1"]
    assert ModelSpec(((Term("x", 1),),)).kind == "adapter"


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (UnknownAdapter("model: no such adapter"), 404, "model_not_found"),
        (InvalidRequest("max_tokens: must be >= 1"), 400, "invalid_value"),
        (InvalidAdapter("r=99 exceeds max_lora_rank"), 400, "invalid_adapter"),
        (QueueFull("queue full", retry_after_s=3), 429, "queue_full"),
        (AdapterUnavailable("s3 down"), 503, "adapter_unavailable"),
        (CatalogUnavailable("redis://x down"), 503, "catalog_unavailable"),
        (TimeoutError(), 504, "timeout"),
        (HTTPFailure(403, "no", code="forbidden"), 403, "forbidden"),
        (RuntimeError("secret internals"), 500, "internal_error"),
    ],
)
def test_error_classes_map_to_one_status_each(exc, status, code):
    reply = error_reply(exc)
    assert reply.status == status
    err = reply.body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    if status == 500:
        assert "secret" not in err["message"]  # no internals leak
    if status in (429, 503, 504):
        assert int(reply.headers["Retry-After"]) >= 1 and reply.retryable
    if status == 429:
        assert reply.headers["Retry-After"] == "3"


def test_invalid_request_param_comes_from_the_message_prefix():
    assert error_reply(InvalidRequest("top_p: must be in (0, 1]")).body["error"]["param"] == "top_p"
    assert error_reply(InvalidRequest("the prompt has 900 tokens")).body["error"]["param"] is None


def test_ray_errors_are_retryable_and_unwrapped():
    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import BackPressureError

    died = error_reply(ActorDiedError())
    assert died.status == 503 and died.body["error"]["code"] == "replica_unavailable"
    assert replica_failed(ActorDiedError()) and not replica_failed(QueueFull("x"))
    bp = error_reply(BackPressureError(num_queued_requests=10, max_queued_requests=10, retry_after_s=2.0))
    assert bp.status == 429 and bp.headers["Retry-After"] == "2"
    wrapped = RayTaskError("generate", "traceback...", UnknownAdapter("model: gone")).as_instanceof_cause()
    assert error_reply(wrapped).status == 404


def test_in_band_failure_round_trips():
    failure = Failure.of(QueueFull("the replica's queue is full", retry_after_s=2))
    failure = pickle.loads(pickle.dumps(failure))  # crosses Ray as plain data
    again = error_reply(failure.to_exception())
    assert again.status == 429 and again.headers["Retry-After"] == "2"
    assert again.body["error"]["message"] == "the replica's queue is full"


@pytest.mark.parametrize(
    "exc",
    [
        UnknownAdapter("model: no adapter 'x'"),
        InvalidAdapter("lora_A has rank 8, the config says 4"),
        InvalidRequest("top_p: must be in (0, 1]"),
        QueueFull("full", retry_after_s=3),
        AdapterUnavailable("s3 is down; retry later"),
        CatalogUnavailable("redis://x down"),
        LoraLandError("a chain stage produced no text"),
        RuntimeError("secret internals"),
    ],
)
def test_an_in_band_failure_maps_like_the_exception_it_names(exc):
    """The replica sends Failure.of(exc); the ingress must answer exactly as if exc were raised in it."""
    direct, in_band = error_reply(exc), error_reply(Failure.of(exc).to_exception())
    assert (in_band.status, in_band.body, in_band.headers) == (direct.status, direct.body, direct.headers)


def test_a_private_error_subclass_travels_as_its_public_base():
    class _Missing(AdapterUnavailable):
        pass

    failure = Failure.of(_Missing("hf://org/repo is gone"))
    assert (failure.kind, failure.retryable) == ("AdapterUnavailable", True)
    assert error_reply(failure.to_exception()).status == 503


def test_choice_deltas_merge_into_the_whole_choice():
    whole = ChoiceDelta(0, "a", None, 3, 1)
    whole.merge(ChoiceDelta(0, " b", None, 3, 2))
    whole.merge(ChoiceDelta(0, " c", "length", 3, 3))
    assert whole == ChoiceDelta(0, "a b c", "length", 3, 3)
    use = resp.completion_response("id", "m", [whole], resp.usage(3, 3), chat=False)
    assert use["choices"][0]["text"] == "a b c" and use["choices"][0]["finish_reason"] == "length"


def test_sse_framing():
    assert resp.sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert resp.SSE_DONE == b"data: [DONE]\n\n"
    chunk = resp.stream_chunk("id1", "m", 0, "hé", None, chat=True, first=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "hé",
    }
    assert json.loads(resp.sse(chunk)[6:]) == chunk  # non-ASCII text survives
    assert resp.finish_reason("abort") == "stop" and resp.finish_reason("length") == "length"


def test_sampling_and_prompts_are_shaped_for_the_kernel():
    req = checks.validate(
        bodies.CompletionRequest,
        {
            "model": "m",
            "prompt": [[1, 2], [3]],
            "max_tokens": 4,
            "top_k": -1,
            "stop": "\n",
            "seed": 3,
            "user": "u",
        },
    )
    assert samp.sampling_of(req) == {"max_tokens": 4, "stop": "\n", "seed": 3}
    assert bodies.prompts_of(req) == [[1, 2], [3]]
    assert bodies.prompts_of(checks.validate(bodies.CompletionRequest, {"model": "m", "prompt": [5, 6]})) == [
        [5, 6]
    ]
    chat = checks.validate(
        bodies.ChatRequest,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "x"}]}
            ],
            "max_completion_tokens": 3,
            "ignore_eos": True,
            "top_k": 5,
        },
    )
    assert bodies.messages_of(chat) == [{"role": "user", "content": "hi x"}]
    assert samp.sampling_of(chat) == {"max_tokens": 3, "top_k": 5, "ignore_eos": True}
    assert render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "messages": []}, "messages"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}},
            "stream_options",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5},
            "presence_penalty",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_chat_validation_names_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        req = checks.validate(bodies.ChatRequest, body)
        bodies.messages_of(req)
    assert e.value.param == param


def test_auth_keys_survive_a_catalog_outage():
    from app.catalog.redis_server import start_redis
    from app.catalog.store import Catalog
    from app.router.http.auth import Authenticator

    url, stop = start_redis()
    try:
        catalog = Catalog(url)
        key = catalog.create_tenant("acme")
        other = catalog.create_tenant("other")
        auth = Authenticator(catalog, "admintok")
        assert auth.caller(f"Bearer {key}").tenant == "acme"
        assert auth.caller("Bearer admintok").tenant is None and auth.admin("Bearer admintok").admin
        with pytest.raises(HTTPFailure) as e:
            auth.admin(f"Bearer {key}")
        assert e.value.status == 403
        with pytest.raises(HTTPFailure) as e:
            auth.caller("Basic abc")
        assert e.value.status == 401
    finally:
        stop()
    # Redis is gone: a key seen a moment ago still works, an unseen one is a clear 503.
    assert auth.caller(f"Bearer {key}").tenant == "acme"
    with pytest.raises(CatalogUnavailable):
        auth.caller(f"Bearer {other}")
    assert error_reply(CatalogUnavailable("x")).status == 503
    off = Authenticator(None, None, no_auth=True)
    assert off.caller(None).tenant is None and off.admin(None).admin


# ---- sampling features (issue 18): logprobs, penalties, min_p, logit_bias, min_tokens ----------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMP = {"model": "m", "prompt": "x"}


def test_sampling_features_reach_the_kernel():
    req = checks.validate(
        bodies.CompletionRequest,
        {
            **COMP,
            "logprobs": 3,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.3,
            "min_p": 0.1,
            "logit_bias": {"7": -100, "12": 2.5},
            "min_tokens": 2,
            "max_tokens": 5,
        },
    )
    assert samp.sampling_of(req) == {
        "max_tokens": 5,
        "logprobs": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.3,
        "min_p": 0.1,
        "logit_bias": {7: -100.0, 12: 2.5},
        "min_tokens": 2,
    }
    assert (
        samp.sampling_of(checks.validate(bodies.CompletionRequest, {**COMP, "logprobs": 0}))["logprobs"] == 0
    )
    echo = checks.validate(bodies.CompletionRequest, {**COMP, "echo": True, "logprobs": 2})
    assert samp.sampling_of(echo) == {"logprobs": 2, "prompt_logprobs": 2}
    assert samp.sampling_of(checks.validate(bodies.CompletionRequest, {**COMP, "echo": True})) == {}
    chat = checks.validate(bodies.ChatRequest, {**CHAT, "logprobs": True, "top_logprobs": 4})
    assert samp.sampling_of(chat) == {"logprobs": 4}
    assert samp.sampling_of(checks.validate(bodies.ChatRequest, {**CHAT, "logprobs": True})) == {
        "logprobs": 0
    }
    assert "logprobs" not in samp.sampling_of(
        checks.validate(bodies.ChatRequest, {**CHAT, "logprobs": False})
    )


@pytest.mark.parametrize(
    "cls, body, param, words",
    [
        (bodies.CompletionRequest, {**COMP, "logprobs": 21}, "logprobs", "[0, 20]"),
        (bodies.CompletionRequest, {**COMP, "logprobs": -1}, "logprobs", "[0, 20]"),
        (bodies.CompletionRequest, {**COMP, "logprobs": True}, "logprobs", "got True"),
        (bodies.CompletionRequest, {**COMP, "logprobs": "5"}, "logprobs", "[0, 20]"),
        (bodies.ChatRequest, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        (bodies.ChatRequest, {**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        (bodies.ChatRequest, {**CHAT, "logprobs": 3}, "logprobs", "boolean"),
        (bodies.CompletionRequest, {**COMP, "presence_penalty": 2.5}, "presence_penalty", "2"),
        (bodies.CompletionRequest, {**COMP, "frequency_penalty": -3}, "frequency_penalty", "-2"),
        (bodies.CompletionRequest, {**COMP, "presence_penalty": 1e308 * 10}, "presence_penalty", "2"),
        (bodies.CompletionRequest, {**COMP, "repetition_penalty": 0}, "repetition_penalty", "0"),
        (bodies.CompletionRequest, {**COMP, "min_p": 1.5}, "min_p", "1"),
        (bodies.CompletionRequest, {**COMP, "min_tokens": -1}, "min_tokens", "0"),
        (
            bodies.CompletionRequest,
            {**COMP, "min_tokens": 9, "max_tokens": 4},
            "min_tokens",
            "max_tokens (4)",
        ),
        (bodies.CompletionRequest, {**COMP, "logit_bias": {"x": 1}}, "logit_bias", "'x'"),
        (bodies.CompletionRequest, {**COMP, "logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
        (bodies.CompletionRequest, {**COMP, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        (bodies.CompletionRequest, {**COMP, "logit_bias": {"5": "1"}}, "logit_bias", "[-100, 100]"),
        (bodies.CompletionRequest, {**COMP, "logit_bias": {"5": float("nan")}}, "logit_bias", "nan"),
        (bodies.CompletionRequest, {**COMP, "logit_bias": [1, 2]}, "logit_bias", "object"),
        (bodies.CompletionRequest, {**COMP, "suffix": "x"}, "suffix", "not supported"),
    ],
)
def test_sampling_feature_refusals_name_the_field(cls, body, param, words):
    with pytest.raises(InvalidRequest) as e:
        checks.validate(cls, body)
    assert e.value.param == param, str(e.value)
    assert words in str(e.value), str(e.value)


def test_logprobs_response_shapes():
    from app.protocol import TokenLogprob

    def tl(t, lp, top=()):
        return TokenLogprob(ord(t[0]), t, lp, t.encode(), tuple(top))

    entries = [tl("He", -0.5, [tl("He", -0.5), tl("A", -1.5)]), tl("llo", -0.25, [tl("y", -0.1)])]
    comp = resp.choice_logprobs(entries, chat=False)
    assert comp == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"He": -0.5, "A": -1.5}, {"y": -0.1, "llo": -0.25}],  # the sampled token too
        "text_offset": [0, 2],
    }
    assert resp.choice_logprobs(entries[1:], chat=False, offset=2)["text_offset"] == [2]
    chat = resp.choice_logprobs(entries, chat=True)
    assert chat["content"][0] == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "A", "logprob": -1.5, "bytes": [65]},
        ],
    }
    assert resp.choice_logprobs(None, chat=True) is None
    one = ChoiceDelta(0, "He", logprobs=entries[:1])
    one.merge(ChoiceDelta(0, "llo", "stop", logprobs=entries[1:]))
    body = resp.completion_response("id", "m", [one], resp.usage(1, 2), chat=False)
    assert body["choices"][0]["logprobs"]["tokens"] == ["He", "llo"]
    assert (
        resp.completion_response("id", "m", [ChoiceDelta(0, "x")], resp.usage(1, 1), chat=True)["choices"][0][
            "logprobs"
        ]
        is None
    )
    # echo: the prompt's text and tokens first, its first token without a logprob
    prompt = [TokenLogprob(1, "Hi", None, b"Hi"), TokenLogprob(2, " you", -3.0, b" you", (tl(" you", -3.0),))]
    echoed = ChoiceDelta(
        0, "He", "length", prompt_text="Hi you", prompt_logprobs=prompt, logprobs=entries[:1]
    )
    choice = resp.completion_response("id", "m", [echoed], resp.usage(2, 1), chat=False)["choices"][0]
    assert choice["text"] == "Hi youHe"
    assert choice["logprobs"] == {
        "tokens": ["Hi", " you", "He"],
        "token_logprobs": [None, -3.0, -0.5],
        "top_logprobs": [None, {" you": -3.0}, {"He": -0.5, "A": -1.5}],
        "text_offset": [0, 2, 6],
    }
