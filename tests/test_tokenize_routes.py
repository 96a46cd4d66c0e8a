"""vLLM's POST /tokenize and /detokenize through the in-process stack (build_api over a real ReplicaCore and
Catalog, httpx over ASGI): shapes, the model field resolved like a completion's, tenant keys, OpenAI errors."""

from __future__ import annotations

import pytest

from tests.fixtures.inproc_stack import module_stack, openai_error
from tests.fixtures.services import redis_server  # noqa: F401


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "tok")


def post(stack, who, path, body):
    async def go(client):
        r = await client.post(path, json=body, headers=stack.headers(who))
        return r.status_code, r.json()

    return stack.run(go)


def test_tokenize_prompt_and_detokenize_round_trip(stack):
    tok = stack.kernel.tokenizer
    text = "the quick brown fox"
    for model in ("tiny-llama", "pub", "a-private", "pub|a-private", "pub*0.5+a-private*0.5"):
        status, body = post(stack, "alpha", "/tokenize", {"model": model, "prompt": text})
        assert status == 200, body
        assert body["tokens"] == tok.encode(text, add_special_tokens=True)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == stack.kernel.max_model_len
    status, body = post(
        stack, "alpha", "/tokenize", {"model": "pub", "prompt": text, "add_special_tokens": False}
    )
    assert status == 200 and body["tokens"] == tok.encode(text, add_special_tokens=False)
    status, back = post(stack, "alpha", "/detokenize", {"model": "pub", "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(body["tokens"])}


def test_tokenize_messages_matches_the_prompt_generation_uses(stack):
    from app.replica.chat import render_chat

    tok = stack.kernel.tokenizer
    messages = [{"role": "user", "content": "hello there"}]
    status, body = post(stack, "alpha", "/tokenize", {"model": "pub", "messages": messages})
    assert status == 200, body
    assert body["tokens"] == tok.encode(render_chat(messages, tok), add_special_tokens=False)
    status, body = post(
        stack, "alpha", "/tokenize", {"model": "pub", "messages": messages, "add_generation_prompt": False}
    )
    rendered = render_chat(messages, tok, add_generation_prompt=False)
    assert status == 200 and body["tokens"] == tok.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize(
    "who, path, body, status, param",
    [
        (None, "/tokenize", {"model": "pub", "prompt": "x"}, 401, None),
        ("Bearer wrong", "/detokenize", {"model": "pub", "tokens": [1]}, 401, None),
        ("alpha", "/tokenize", {"model": "b-private", "prompt": "x"}, 404, "model"),
        ("beta", "/detokenize", {"model": "a-private", "tokens": [1]}, 404, "model"),
        ("alpha", "/tokenize", {"model": "pub"}, 400, "prompt"),
        (
            "alpha",
            "/tokenize",
            {"model": "pub", "prompt": "x", "messages": [{"role": "user"}]},
            400,
            "prompt",
        ),
        ("alpha", "/tokenize", {"prompt": "x"}, 400, "model"),
        ("alpha", "/detokenize", {"model": "pub", "tokens": ["a"]}, 400, "tokens[0]"),
        ("alpha", "/detokenize", {"model": "pub", "tokens": [10**9]}, 400, "tokens"),
        ("alpha", "/detokenize", {"model": "pub", "tokens": [-1]}, 400, "tokens"),
    ],
)
def test_tokenize_errors_are_openai_shaped(stack, who, path, body, status, param):
    got, reply = post(stack, who, path, body)
    assert got == status, reply
    assert openai_error(reply) is None, reply
    if param is not None:
        assert reply["error"]["param"] == param, reply
