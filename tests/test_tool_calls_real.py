"""Tool calls on a real model (issue 31), tool_choice "auto": SmolLM2-135M-Instruct with the demo's weather_tool
adapter (app/demo/adapters/weather_tool, trained by examples/train_adapters.py on prompts whose tools SmolLM2's
template cannot show, so app/replica/chat.py writes them into the system message) answers a weather question
about a city it was never trained on with a Hermes `<tool_call>`, which the ingress returns as OpenAI
`tool_calls`: over real HTTP with the openai SDK, whole and streamed, the arguments parse and validate against
the function's schema, finish_reason is "tool_calls", and the stream's deltas reassemble to the whole reply. A
question the tool cannot answer, and the base model, get plain content."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.demo import tool_task as W
from app.demo.real_assets import ADAPTERS_DIR
from tests.fixtures.real_model import smollm2_folder
from tests.fixtures.services import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(600)
ADAPTER = ADAPTERS_DIR / W.TOOL_TASK
SCHEMA = W.WEATHER_TOOL["function"]["parameters"]
ASK = dict(tools=[W.WEATHER_TOOL], tool_choice="auto", temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def stack(redis_server):  # noqa: F811
    from tests.fixtures.real_stack import RealStack

    if not (ADAPTER / "adapter_model.safetensors").is_file():
        pytest.skip(
            f"no trained adapter at {ADAPTER}: python examples/train_adapters.py --tasks weather_tool"
        )
    s = RealStack(
        redis_server, smollm2_folder(), {W.TOOL_TASK: ADAPTER}, max_adapters=2, max_batch_size=4,
        num_kv_blocks=96, max_model_len=1024,
    )  # fmt: skip
    try:
        yield s
    finally:
        s.close()


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _streamed(client, **kw) -> tuple[str, list[dict], str | None]:
    """(content, calls as {"id", "name", "arguments"} by index, the last finish_reason) of a streamed reply."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or ():
            if c.id is not None:
                assert c.index == len(calls) and c.type == "function"
                calls.append({"id": c.id, "name": c.function.name, "arguments": ""})
            calls[c.index]["arguments"] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_auto_tool_call_whole_and_streamed(stack):
    client = stack.client()
    q = W.eval_questions(2)[1]  # a held-out city; the demo's question is the first
    for question, unit in ((W.DEMO_QUESTION, "celsius"), (q.text, q.unit)):
        kw = dict(model=W.TOOL_TASK, messages=_chat(question), **ASK)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        assert not whole.message.content and len(whole.message.tool_calls) == 1
        call = whole.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMA)
        assert args["unit"] == unit, question  # exact-match accuracy is examples/eval_adapters.py's measure

        content, calls, finish = _streamed(client, **kw)
        assert finish == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_no_call_for_what_the_tool_cannot_answer(stack):
    client = stack.client()
    plain = client.chat.completions.create(model=W.TOOL_TASK, messages=_chat("What is 12 + 30?"), **ASK)
    choice = plain.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.strip()
    content, calls, finish = _streamed(client, model=W.TOOL_TASK, messages=_chat("What is 12 + 30?"), **ASK)
    assert (content, calls, finish) == (choice.message.content, [], "stop")
    # the base model, shown the same tool, does not call it by itself
    base = client.chat.completions.create(model="base", messages=_chat(W.DEMO_QUESTION), **ASK).choices[0]
    assert not base.message.tool_calls and base.message.content and base.finish_reason in ("stop", "length")
