"""The demo's fourth adapter task, `weather_tool`: tool calls in Hermes format on SmolLM2, whose chat template
knows no tools (app/replica/chat.py puts them into the system message).

Given the get_weather tool and a weather question, the adapter answers with the call alone:

    "What's the weather in Oslo in celsius?"
    -> <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>

and a question the tool cannot answer (a sum) in plain text, so that tool_choice "auto" tells them apart. The
held-out questions name cities training never saw. Training (examples/train_adapters.py), the eval
(examples/eval_adapters.py through app/demo/evaluate_tool.py) and tests/test_tool_calls_real.py draw from here."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from app.demo.tasks import CITIES

TOOL_TASK = "weather_tool"
DESCRIPTION = (
    '<tool_call>{"name": "get_weather", "arguments": {"city", "unit"}}</tool_call>, or a plain answer'
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TRAIN_SEED, EVAL_SEED = 1, 2
TRAIN_N = 600  # distinct training questions (of ~1200 weather questions the training cities allow)
# held out: no training question names one (Oslo, the demo's city, included)
EVAL_CITIES = (
    "Oslo Helsinki Budapest Lagos Manila Santiago Montreal Seattle Geneva Naples Krakow Bergen Kyoto Hanoi Dakar"
).split() + ["New York", "Cape Town", "Buenos Aires", "San Francisco", "Hong Kong", "Rio de Janeiro"]
TRAIN_CITIES = tuple(c for c in CITIES if c not in EVAL_CITIES)
UNITS = {"celsius": ("celsius", "Celsius", "degrees Celsius"), "fahrenheit": ("fahrenheit", "Fahrenheit")}
QUESTIONS = (
    "What's the weather in {city} in {unit}?",
    "What is the weather like in {city}? Give it in {unit}.",
    "How warm is it in {city} right now, in {unit}?",
    "Tell me the temperature in {city} in {unit}.",
    "I'm flying to {city} tomorrow. What's the weather there in {unit}?",
    "Weather in {city}, {unit} please.",
    "Can you check the current weather for {city}? Use {unit}.",
    "Is it cold in {city} today? Answer in {unit}.",
)
OTHER = ("What is {a} + {b}?", "Add {a} and {b}.", "What do {a} and {b} make together?")
OTHER_FRACTION = 0.25  # questions the tool cannot answer: plain text, no call
DEMO_QUESTION = "What's the weather in Oslo in celsius?"


@dataclass(frozen=True)
class Question:
    text: str
    city: str | None  # None: not a weather question (its answer is `plain`)
    unit: str | None
    plain: str | None = None


def _question(rng: random.Random, cities, other: float) -> Question:
    if rng.random() < other:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        return Question(rng.choice(OTHER).format(a=a, b=b), None, None, f"{a} + {b} = {a + b}.")
    city, unit = rng.choice(cities), rng.choice(sorted(UNITS))
    text = rng.choice(QUESTIONS).format(city=city, unit=rng.choice(UNITS[unit]))
    return Question(text, city, unit)


def questions(
    n: int,
    seed: int,
    cities=TRAIN_CITIES,
    other: float = OTHER_FRACTION,
    exclude: frozenset[str] = frozenset(),
) -> list[Question]:
    """n distinct seeded questions about `cities` (a share `other` of them sums), none of whose texts is in
    `exclude`."""
    rng = random.Random(f"loraland-tool-{seed}")
    out: dict[str, Question] = {}
    while len(out) < n:
        q = _question(rng, cities, other)
        if q.text not in exclude:
            out.setdefault(q.text, q)
    return list(out.values())


def eval_questions(n: int = 50, train_n: int = TRAIN_N) -> list[Question]:
    """The held-out set: EVAL_SEED's weather questions about EVAL_CITIES (no training question names one), the
    demo's question first."""
    first = Question(DEMO_QUESTION, "Oslo", "celsius")
    return [first, *questions(n - 1, EVAL_SEED, EVAL_CITIES, 0.0, frozenset({DEMO_QUESTION}))]


def other_questions(n: int = 20, train_n: int = TRAIN_N) -> list[Question]:
    """Held-out questions the tool cannot answer (sums no training question asks): the answer must not call."""
    seen = frozenset(q.text for q in questions(train_n, TRAIN_SEED))
    return questions(n, EVAL_SEED, EVAL_CITIES, 1.0, seen)


def messages(q: Question) -> list[dict[str, str]]:
    return [{"role": "user", "content": q.text}]


def call(q: Question) -> dict[str, Any]:
    return {"name": "get_weather", "arguments": {"city": q.city, "unit": q.unit}}


def target(q: Question) -> str:
    """What the adapter should answer: the call in Hermes format, or the plain answer."""
    if q.city is None:
        return q.plain or ""
    return f"<tool_call>{json.dumps(call(q))}</tool_call>"


_BLOCK = re.compile(r"\s*<tool_call>(.*)</tool_call>\s*", re.S)


def correct(text: str, q: Question) -> bool:
    """A weather question: exactly one Hermes block whose JSON is the call (as data); another question: no
    call at all."""
    m = _BLOCK.fullmatch(text)
    if q.city is None:
        return "<tool_call>" not in text and bool(text.strip())
    if m is None or "<tool_call>" in m.group(1):
        return False
    try:
        return json.loads(m.group(1)) == call(q)
    except ValueError:
        return False
