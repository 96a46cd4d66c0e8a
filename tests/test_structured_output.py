"""response_format (json_object, json_schema) through xgrammar: per-row token bitmasks in the batched sampler.

With the tiny random models the JSON is odd but grammatical: every output that ends by stop parses with
json.loads and validates against its schema; rows without a grammar in the same (multi-adapter) batch are
token for token their solo outputs; a schema the engine cannot compile is a 400 naming response_format; the
openai SDK's chat.completions.create(response_format=...) works through the in-process stack."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from app.errors import InvalidRequest
from app.router.http.openai_sampling import format_key
from loraland import LLMKernel
from tests.fixtures.adapters import SPECS_BY_NAME, make_adapter_set
from tests.fixtures.services import redis_server  # noqa: F401

PROMPTS = ["the quick brown fox", "hello world, this is lora land", "0123456789 + - * / = ( )", "{"]
ADAPTERS = ["all-r4-rs", "attn-r8"]
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["n", "ok", "tag"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def kernel(llama_dir, tmp_path_factory):
    specs = [SPECS_BY_NAME[a] for a in ADAPTERS]
    adapters = make_adapter_set(llama_dir, tmp_path_factory.mktemp("so-adapters"), specs)
    k = LLMKernel(llama_dir, dtype="float32", num_kv_blocks=256, max_adapters=4, max_batch_size=16)
    for name, path in adapters.items():
        k.load_adapter(name, path)
    yield k
    k.close()


def check(text: str, finish: str, schema: dict | None) -> bool:
    """Whether `text` was checked (it ended by stop); asserts it is JSON (an object, valid against `schema`)."""
    if finish != "stop":
        return False
    value = json.loads(text)
    assert isinstance(value, dict), text
    if schema is not None:
        jsonschema.validate(value, schema)
    return True


async def _run_all(k, jobs):
    async def one(prompt, adapter, kw):
        text, tokens, finish = "", [], None
        async for d in k.generate(prompt, adapter, **kw):
            text += d.text
            tokens += d.token_ids
            finish = d.finish_reason or finish
        return text, tokens, finish

    return await asyncio.gather(*(one(*j) for j in jobs))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_json_rows_parse_and_free_rows_are_unchanged_in_a_mixed_batch(kernel, sampled):
    key_schema = format_key(JSON_SCHEMA)
    base = {"max_tokens": MAX_TOKENS}
    if sampled:
        base |= {"temperature": 1.0, "seed": 7}
    free_kw = {"max_tokens": 24, **({"temperature": 0.8, "seed": 3} if sampled else {})}
    jobs, kinds = [], []
    for i, prompt in enumerate(PROMPTS):
        adapter = [None, *ADAPTERS][i % 3]
        jobs.append((prompt, adapter, {**base, "response_format": "json_object"}))
        kinds.append(None)
        jobs.append((prompt, adapter, {**base, "response_format": key_schema, "seed": 11 + i} if sampled
                     else {**base, "response_format": key_schema}))  # fmt: skip
        kinds.append(SCHEMA)
        jobs.append((prompt, [*ADAPTERS, None][i % 3], free_kw))
        kinds.append("free")
    together = asyncio.run(_run_all(kernel, jobs))
    checked = 0
    for (prompt, adapter, kw), kind, (text, tokens, finish) in zip(jobs, kinds, together):
        if kind == "free":
            (solo,) = asyncio.run(_run_all(kernel, [(prompt, adapter, kw)]))
            assert solo[1] == tokens, (prompt, adapter)
            continue
        checked += check(text, finish, kind)
    assert checked >= 3, [r[0][:80] for r in together]  # enough of them ended to mean something


def test_complete_and_chains_shape_the_last_stage(kernel):
    key = format_key(JSON_SCHEMA)
    outs = kernel.complete(PROMPTS, [None, "all-r4-rs|attn-r8", "attn-r8", None], max_tokens=MAX_TOKENS,
                           response_format=key)  # fmt: skip
    assert sum(check(c.text, c.finish_reason, SCHEMA) for c in outs) >= 2, [c.text[:80] for c in outs]


def test_preemption_keeps_grammar_rows_exact(kernel, llama_dir):
    """A recompute after preemption keeps the output, and the matcher (caught up from it) keeps its place."""
    tok = kernel.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:3]]
    many = [p + q for p in prompts for q in prompts]
    kw = dict(max_tokens=40, response_format=format_key(JSON_SCHEMA))
    want = kernel.complete(many, **kw)
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=14, block_size=8, max_batch_size=16) as small:
        got = small.complete(many, **kw)
        assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        check(a.text, a.finish_reason, SCHEMA)


def test_grammar_is_compiled_once_and_cached(kernel):
    key = format_key(JSON_SCHEMA)
    assert kernel.grammars.compile(key) is kernel.grammars.compile(key)
    same = format_key(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": dict(reversed(SCHEMA.items()))}}
    )
    assert same == key


# strings of the kind whose xgrammar rule let control characters in (length-limited), all bounded so that a
# random model's answer ends
BOUNDED = {
    "type": "object",
    "properties": {
        "short": {"type": "string", "maxLength": 6},
        "long": {"type": "string", "minLength": 2, "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["short", "long", "tags"],
    "additionalProperties": False,
}
# and every other kind: free, patterned
CONTROL_SCHEMA = {
    **BOUNDED,
    "properties": {
        **BOUNDED["properties"],
        "free": {"type": "string"},
        "word": {"type": "string", "pattern": "^[a-z ]+$"},
    },
    "required": [*BOUNDED["required"], "free", "word"],
}


def test_grammar_strings_admit_no_raw_control_character(kernel):
    """Every kind of string refuses U+0000-U+001F raw (a free string takes them escaped), for a response_format
    and for a required tool call's constraint (compiled by the same Grammars)."""
    import xgrammar as xg

    from app.router.http.openai_requests import ChatRequest
    from app.router.http.tool_calls import plan_of

    tool = {"type": "function", "function": {"name": "f", "parameters": CONTROL_SCHEMA}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "required"}  # fmt: skip
    call_key = plan_of(ChatRequest.model_validate(body)).constraint()
    schema_key = format_key({"type": "json_schema", "json_schema": {"name": "c", "schema": CONTROL_SCHEMA}})
    value = {"short": "ab", "long": "xyz", "tags": ["t"], "free": "", "word": "a b"}  # CONTROL_SCHEMA's order
    # properties in the grammar's order: format_key sorts a schema's keys, a tool's parameters keep theirs
    for key, as_call in ((schema_key, False), ("json_object", False), (call_key, True)):
        compiled = kernel.grammars.compile(key)
        for field in ("short", "long", "free", "tags"):
            v = dict(value, **{field: ["@"] if field == "tags" else value[field] + "@"})
            text = json.dumps([{"name": "f", "arguments": v}]) if as_call else json.dumps(v, sort_keys=True)
            for ch in ("\t", "\n", "\x00", "\x01", "\x1f"):
                raw, escaped = text.replace("@", ch), text.replace("@", json.dumps(ch)[1:-1])
                assert not xg.GrammarMatcher(compiled).accept_string(raw), (key[:30], field, raw)
                if field == "free":  # xgrammar's length-limited strings take no escapes at all
                    assert xg.GrammarMatcher(compiled).accept_string(escaped), (key[:30], escaped)


def test_outputs_biased_to_control_characters_are_strict_json(kernel):
    """The random model pushed hard toward every token that holds a control character still answers strict
    JSON that validates (json.loads refuses raw U+0000-U+001F inside strings; before the grammar's fix most
    of these answers held raw tabs and U+0001s)."""
    tok = kernel.tokenizer
    control = [i for i in range(len(tok)) if any(ord(c) < 0x20 for c in tok.decode([i]))]
    assert len(control) >= 8  # the byte-level vocabulary's control bytes, at least
    bias = {i: 40.0 for i in control}
    key = format_key({"type": "json_schema", "json_schema": {"name": "c", "schema": BOUNDED}})
    checked = 0
    for seed in (1, 2, 3):
        outs = kernel.complete(PROMPTS, max_tokens=MAX_TOKENS, response_format=key, logit_bias=bias,
                               temperature=1.0, seed=seed)  # fmt: skip
        checked += sum(check(c.text, c.finish_reason, BOUNDED) for c in outs)
    assert checked >= 10


@pytest.mark.parametrize(
    "rf, words",
    [
        ({"type": "yaml"}, "unknown type"),
        ("json", "must be an object"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "must be a JSON schema"),
    ],
)
def test_bad_response_formats_are_refused_by_the_ingress(rf, words):
    with pytest.raises(InvalidRequest) as e:
        format_key(rf)
    assert e.value.param == "response_format" and words in str(e.value)


def test_a_schema_the_engine_cannot_compile_is_refused(kernel):
    bad = format_key(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    )
    with pytest.raises(InvalidRequest) as e:
        kernel.complete(["hi"], max_tokens=4, response_format=bad)
    assert e.value.param == "response_format" and "cannot be compiled" in str(e.value)


# ---- HTTP: the in-process stack, httpx and the openai SDK ------------------------------------------------


@pytest.fixture(scope="module")
def http(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    from tests.fixtures.inproc_stack import module_stack

    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "so-http")


def test_http_bad_schema_is_a_400_naming_response_format(http):
    from tests.fixtures.inproc_stack import openai_error

    bodies = [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        {"type": "yaml"},
    ]

    async def go(client):
        out = []
        for rf in bodies:
            body = {"model": "pub", "messages": [{"role": "user", "content": "hi"}], "response_format": rf}
            r = await client.post("/v1/chat/completions", json=body, headers=http.headers("alpha"))
            out.append((r.status_code, r.json()))
        return out

    for status, body in http.run(go):
        assert status == 400 and openai_error(body) is None, body
        assert body["error"]["param"] == "response_format", body


def test_openai_sdk_json_mode_and_json_schema(http):
    import httpx
    import openai

    async def go():
        client_http = httpx.AsyncClient(transport=httpx.ASGITransport(app=http.api), timeout=120)
        async with openai.AsyncOpenAI(
            api_key=http.keys["alpha"], base_url="http://ll/v1", http_client=client_http
        ) as client:
            out = []
            for model in ("tiny-llama", "pub"):
                for rf, schema in (({"type": "json_object"}, None), (JSON_SCHEMA, SCHEMA)):
                    for prompt in PROMPTS:
                        r = await client.chat.completions.create(
                            model=model,
                            messages=[{"role": "user", "content": prompt}],
                            response_format=rf,
                            max_tokens=MAX_TOKENS,
                        )
                        out.append((r.choices[0].message.content, r.choices[0].finish_reason, schema))
            # streaming, and the completions route (vLLM accepts response_format there too)
            chunks = await client.chat.completions.create(
                model="pub",
                messages=[{"role": "user", "content": PROMPTS[0]}],
                response_format=JSON_SCHEMA,
                max_tokens=MAX_TOKENS,
                stream=True,
            )
            text, finish = "", None
            async for c in chunks:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
            out.append((text, finish, SCHEMA))
            r = await client.completions.create(
                model="pub",
                prompt=PROMPTS[1],
                max_tokens=MAX_TOKENS,
                extra_body={"response_format": JSON_SCHEMA},
            )
            out.append((r.choices[0].text, r.choices[0].finish_reason, SCHEMA))
            return out

    results = asyncio.run(go())
    assert sum(check(text, finish, schema) for text, finish, schema in results) >= 4, results
