"""OpenAI tool calling: the Hermes `<tool_call>` parser, the constraint schema of a required or named call, the
stream assembler, and the whole path through the in-process HTTP stack with the openai SDK.

The tiny random model answers in gibberish, which is what shows the grammar works: every required or named call
it makes parses and validates against its function's schema."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from app.router.http.openai_requests import ChatRequest
from app.router.http.tool_calls import ToolPlan, plan_of
from app.router.http.tool_stream import ChoiceCalls, HermesCalls, JsonCalls
from tests.fixtures.services import redis_server  # noqa: F401

FUNCTIONS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
    },
    "lookup": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "tag"],
    },
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": p}}
    for n, p in FUNCTIONS.items()
]
MESSAGES = [{"role": "user", "content": "what is the weather in paris, and 2 + 3?"}]


def _plan(**body) -> ToolPlan:
    return plan_of(ChatRequest.model_validate({"model": "m", "messages": MESSAGES, **body}))


def _read(reader, pieces) -> tuple[str, list[list]]:
    """(content, [[name, arguments]]) from feeding `pieces` one at a time, then finishing."""
    content, calls = "", []
    for ev in [e for p in pieces for e in reader.feed(p)] + reader.finish():
        if ev[0] == "content":
            content += ev[1]
        elif ev[0] == "call":
            assert ev[1] == len(calls)
            calls.append([ev[2], ev[3]])
        else:
            calls[ev[1]][1] += ev[2]
    return content, calls


# ---------------------------------------------------------------------------------------------- Hermes parser
HERMES = [
    (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "",
        [["add", '{"a": 1, "b": 2}']],
    ),
    (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"tag": "réd"}}\n</tool_call>',
        "",
        [["add", '{"a": 1}'], ["lookup", '{"tag": "réd"}']],
    ),
    (
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\nDone <tool',
        "Let me check.\nDone <tool",
        [["get_weather", "{}"]],
    ),
    (
        'a <tool_call>{"name": "add", "arguments": {"a": 1</tool_call> b',
        'a <tool_call>{"name": "add", "arguments": {"a": 1</tool_call> b',
        [],
    ),  # fmt: skip
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [["add", '{"a": 1}']]),  # never closed
    ("plain text, no calls \n", "plain text, no calls \n", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_parser_whole_and_one_character_at_a_time(text, content, calls):
    assert _read(HermesCalls(), [text]) == (content, calls)
    assert _read(HermesCalls(), list(text)) == (content, calls)


def test_hermes_parallel_false_keeps_the_first_call():
    text = HERMES[1][0]
    assert _read(HermesCalls(parallel=False), [text]) == ("", [["add", '{"a": 1}']])


# ---------------------------------------------------------------------------------------------- constraint
def test_constraint_schema_of_required_named_and_single_calls():
    required = json.loads(_plan(tools=TOOLS, tool_choice="required").constraint())
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    cases = required["items"]["anyOf"]
    assert [c["properties"]["name"]["const"] for c in cases] == list(FUNCTIONS)
    assert all(list(c["properties"]) == ["name", "arguments"] for c in cases)  # name streams first
    good = [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "lookup", "arguments": {"ok": True, "tag": "red"}},
    ]
    jsonschema.validate(good, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"city": "x", "unit": "c"}}], required)
    single = json.loads(_plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constraint())
    assert single["maxItems"] == 1
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert json.loads(named.constraint()) == FUNCTIONS["add"]
    assert _plan(tools=TOOLS).constraint() is None and _plan(tools=TOOLS, tool_choice="none").parses is False
    bare = _plan(tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice="required")
    assert json.loads(bare.constraint())["items"]["properties"]["arguments"] == {
        "type": "object",
        "properties": {},
    }


# ---------------------------------------------------------------------------------------------- stream assembler
def test_json_call_scanner_reassembles_any_split():
    text = '[{"name": "add", "arguments": {"a": "}\\"{,", "b": [1, {"c": 2}]}}, {"name": "lookup", "arguments": {}}]'
    want = ("", [["add", '{"a": "}\\"{,", "b": [1, {"c": 2}]}'], ["lookup", "{}"]])
    assert _read(JsonCalls(), [text]) == want
    assert _read(JsonCalls(), list(text)) == want
    assert _read(JsonCalls(), [text[:7], text[7:40], text[40:]]) == want
    assert _read(JsonCalls("add"), ['{"a": ', "1}"]) == ("", [["add", '{"a": 1}']])
    # escapes pass through as generated (the grammar admits no raw control character: test_structured_output)
    esc = '[{"name": "f", "arguments": {"a\\tb": "x\\u0001y"}}]'
    assert _read(JsonCalls(), list(esc)) == ("", [["f", '{"a\\tb": "x\\u0001y"}']])


def test_choice_deltas_have_openai_shape_and_reassemble_to_the_message():
    plan = _plan(tools=TOOLS, tool_choice="required")
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "lookup", "arguments": {"ok": true}}]'
    stream = ChoiceCalls(plan)
    deltas = [d for i in range(0, len(text), 5) for d in stream.deltas(text[i : i + 5], False)]
    deltas += stream.deltas("", True)
    firsts = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [f["index"] for f in firsts] == [0, 1] and all(f["type"] == "function" for f in firsts)
    assert [f["function"]["name"] for f in firsts] == ["add", "lookup"]
    later = [d["tool_calls"][0] for d in deltas if "id" not in d["tool_calls"][0]]
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in later)
    args = ["", ""]
    for d in deltas:
        c = d["tool_calls"][0]
        args[c["index"]] += c["function"]["arguments"]
    message = ChoiceCalls(plan).message(text)
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("add", args[0]),
        ("lookup", args[1]),
    ]
    assert ChoiceCalls(plan).finish_reason("stop") == "stop"  # no call made yet
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_auto_stream_chunks_carry_role_first_and_finish_last():
    from app.router.http.openai_responses import stream_chunk
    from app.router.http.tool_stream import ToolOutput

    out = ToolOutput(_plan(tools=TOOLS))
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    pieces = [text[i : i + 9] for i in range(0, len(text), 9)]
    chunks = []
    for k, piece in enumerate(pieces):
        reason = "stop" if k == len(pieces) - 1 else None
        base = stream_chunk("id", "m", 0, piece, reason, True, k == 0)
        chunks += out.chunks(base, piece, k == 0)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert calls == [{"index": 0, "id": calls[0]["id"], "type": "function",
                      "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]  # fmt: skip
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]
    }
    msg = ToolOutput(_plan(tools=TOOLS)).shape(body)["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] == "Sure."
    assert msg["message"]["tool_calls"][0]["function"] == calls[0]["function"]


def test_chat_template_gets_the_tools_and_the_call_messages():
    from transformers import PreTrainedTokenizerFast

    from app.replica.chat import render_chat
    from app.router.http.tool_calls import chat_messages

    tok = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer(
        __import__("tokenizers").models.WordLevel({"a": 0}, unk_token="a")))  # fmt: skip
    tok.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}call {{ c.function.name }} {{ c.function.arguments.a }}{% endfor %}"
        "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{% endfor %}"
    )
    body = {
        "model": "m",
        "messages": [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
    }  # fmt: skip
    messages = chat_messages(ChatRequest.model_validate(body))
    text = render_chat(
        messages, tok, add_generation_prompt=False, tools=[{"type": "function", "function": {"name": "add"}}]
    )
    assert text == f"[tool add]<user>{MESSAGES[0]['content']}<assistant>call add 2<tool>5 for call_1"


def test_a_template_without_tools_gets_them_in_the_system_message():
    """SmolLM2's kind of template (it never reads `tools`): the tools in Hermes format in the system message
    (appended to the caller's own), past calls as <tool_call> text, tool results as one user turn."""
    from transformers import PreTrainedTokenizerFast

    from app.replica.chat import TOOLS_SYSTEM, knows_tools, render_chat
    from app.router.http.tool_calls import chat_messages

    tok = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer(
        __import__("tokenizers").models.WordLevel({"a": 0}, unk_token="a")))  # fmt: skip
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert not knows_tools(tok.chat_template) and knows_tools("{{ tools }}")
    described = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in TOOLS[:2]))
    assert render_chat(MESSAGES, tok, tools=TOOLS[:2]) == f"<system>{described}<user>{MESSAGES[0]['content']}"
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "tool", "tool_call_id": "c2", "content": "red"},
        ],
    }  # fmt: skip
    text = render_chat(chat_messages(ChatRequest.model_validate(body)), tok, tools=TOOLS[:2])
    assert text == (
        f"<system>Be brief.\n\n{described}<user>{MESSAGES[0]['content']}<assistant>"
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
        "<user><tool_response>\n5\n</tool_response>\n<tool_response>\nred\n</tool_response>"
    )
    # what "auto" parses back is the format the system message asks for
    assert _read(HermesCalls(), [text.split("<assistant>")[1].split("<user>")[0]])[1] == [
        ["add", '{"a": 2, "b": 3}'],
        ["lookup", "{}"],
    ]


# ---------------------------------------------------------------------------------------------- HTTP end to end
@pytest.fixture(scope="module")
def http(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    from tests.fixtures.inproc_stack import module_stack

    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "tools")


def _client(http):
    import openai

    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=http.api), timeout=120)
    return openai.AsyncOpenAI(api_key=http.keys["alpha"], base_url="http://ll/v1", http_client=transport)


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), FUNCTIONS[call.function.name])


def test_required_calls_always_parse_and_validate(http):
    async def go():
        async with _client(http) as client:
            jobs = [
                client.chat.completions.create(
                    model="tiny-llama" if i % 2 else "pub",
                    messages=[{"role": "user", "content": f"request {i}: call something"}],
                    tools=TOOLS,
                    tool_choice="required",
                    parallel_tool_calls=i % 4 != 0,
                    temperature=1.0,
                    seed=i,
                    max_tokens=480,  # the random model may call up to ~5 functions, ~60 tokens each
                )
                for i in range(20)
            ]
            return await asyncio.gather(*jobs)

    for i, r in enumerate(asyncio.run(go())):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls, choice
        assert i % 4 != 0 or len(choice.message.tool_calls) == 1  # parallel_tool_calls=False
        for call in choice.message.tool_calls:
            _check_call(call)


def test_named_choice_and_auto_and_none(http):
    async def go():
        async with _client(http) as client:
            named = await client.chat.completions.create(
                model="tiny-llama",
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=200,
            )
            free = [
                await client.chat.completions.create(
                    model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=16
                )
                for choice in ("auto", "none")
            ]
            return named, free

    named, free = asyncio.run(go())
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    _check_call(calls[0])
    assert named.choices[0].finish_reason == "stop"  # OpenAI's answer for a forced function
    for r in free:  # the random model writes no <tool_call>: its text comes back as content
        assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "n": 2}])
def test_streamed_required_call_reassembles_to_the_whole_reply(http, sampling):
    kw = dict(model="pub", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=480, **sampling)

    async def go():
        async with _client(http) as client:
            whole = await client.chat.completions.create(**kw)
            chunks = [c async for c in await client.chat.completions.create(**kw, stream=True)]
            return whole, chunks

    whole, chunks = asyncio.run(go())
    calls: dict[int, dict[int, dict]] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        choice = c.choices[0]
        assert not choice.delta.content
        got = calls.setdefault(choice.index, {})
        for t in choice.delta.tool_calls or ():
            if t.index not in got:  # the first delta of a call names it
                assert t.id and t.type == "function" and t.function.name
                got[t.index] = {"name": t.function.name, "arguments": t.function.arguments or ""}
            else:
                assert t.id is None and t.function.name is None
                got[t.index]["arguments"] += t.function.arguments
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert len(whole.choices) == len(calls) == sampling.get("n", 1)
    for choice in whole.choices:
        want = [
            {"name": t.function.name, "arguments": t.function.arguments} for t in choice.message.tool_calls
        ]
        got = calls[choice.index]
        assert [got[i] for i in sorted(got)] == want
        assert finish[choice.index] == choice.finish_reason == "tool_calls"
    assert len([c for c in chunks if c.choices[0].delta.tool_calls]) > len(calls)  # arguments came in pieces


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": 3}}}]},
        "tools[0].function.parameters",
    ),  # fmt: skip
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": "add"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": {}}}]}]},
        "messages[0].tool_calls[0].function.arguments",
    ),  # fmt: skip
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
]


def test_bad_tool_requests_are_400s_naming_the_field(http):
    from tests.fixtures.inproc_stack import openai_error

    async def go(client):
        out = []
        for extra, _ in BAD:
            body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, **extra}
            r = await client.post("/v1/chat/completions", json=body, headers=http.headers("alpha"))
            out.append((r.status_code, r.json()))
        return out

    for (status, body), (extra, param) in zip(http.run(go), BAD):
        assert status == 400 and openai_error(body) is None, (extra, body)
        assert body["error"]["param"] == param, (extra, body)
