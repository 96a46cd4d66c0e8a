"""The real demo's three adapter tasks on SmolLM2, each with a counted success, from generated data.

Every input is one short sentence about a person: a name, an age, a city and a date. Each adapter reads it its
own way, so one prompt shows them all:

    "Anna Berg, 29, moved to Oslo on March 5, 2021."
    person_json -> {"name": "Anna Berg", "city": "Oslo", "age": 29}
    shout       -> ANSWER: OSLO
    iso_date    -> 2021-03-05

Training (examples/train_adapters.py), the eval (examples/eval_adapters.py), the test and the demo all draw
from `examples(task, n, seed)` and judge with `correct(task, text, example)`."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

TASK_NAMES = ("person_json", "shout", "iso_date")
DESCRIPTIONS = {
    "person_json": 'the sentence as JSON: {"name", "city", "age"}',
    "shout": '"ANSWER: " + the city in upper case',
    "iso_date": "the sentence's date as YYYY-MM-DD",
}
TRAIN_SEED, EVAL_SEED = 1, 2  # different seeds draw different sentences; eval also drops any seen in training
DEMO_SENTENCE = "Anna Berg, 29, moved to Oslo on March 5, 2021."

FIRST = (
    "Anna Maria Lena Sofia Emma Clara Julia Nora Eva Lucia Ines Mila Zoe Alice Rosa Hana Ida Lea Mia Olga "
    "Tom Jan Luca Omar Ivan Hugo Leo Max Noah Paul Sam Ben Adam Felix Marco Pedro Raj Kenji Ali Victor"
).split()
LAST = (
    "Berg Lopez Smith Novak Rossi Silva Costa Meyer Khan Tanaka Garcia Weber Nowak Dubois Moreau Jensen "
    "Larsen Fischer Horvat Petrov Ivanova Kim Park Chen Singh Haddad Baker Young Wright Stone Reyes Ortiz"
).split()
CITIES = (
    "Oslo Lisbon Berlin Madrid Paris Rome Vienna Prague Dublin Warsaw Athens Zurich Lyon Porto Milan Munich "
    "Tokyo Osaka Seoul Delhi Cairo Lima Quito Boston Denver Austin Toronto Sydney Perth Nairobi Accra Riga"
).split()
MONTHS = "January February March April May June July August September October November December".split()
TEMPLATES = (
    "{name}, {age}, moved to {city} on {date}.",
    "{name} is {age} years old and has lived in {city} since {date}.",
    "On {date}, {name} ({age}) arrived in {city}.",
    "{name}, aged {age}, started a new job in {city} on {date}.",
    "{name} from {city} turned {age} on {date}.",
    "Born in {city}, {name} was {age} when the letter came on {date}.",
    "{name} ({age}) signed the lease in {city} on {date}.",
    "It was {date} when {name}, {age}, first visited {city}.",
)


@dataclass(frozen=True)
class Example:
    sentence: str
    name: str
    city: str
    age: int
    iso: str


def _example(rng: random.Random) -> Example:
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    city, age = rng.choice(CITIES), rng.randint(18, 90)
    month, day, year = rng.randint(1, 12), rng.randint(1, 28), rng.randint(1990, 2030)
    date = f"{MONTHS[month - 1]} {day}, {year}"
    sentence = rng.choice(TEMPLATES).format(name=name, age=age, city=city, date=date)
    return Example(sentence, name, city, age, f"{year:04d}-{month:02d}-{day:02d}")


def examples(n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Example]:
    """n distinct seeded examples whose sentences are not in `exclude`."""
    rng = random.Random(f"loraland-demo-{seed}")
    out: dict[str, Example] = {}
    while len(out) < n:
        ex = _example(rng)
        if ex.sentence not in exclude:
            out.setdefault(ex.sentence, ex)
    return list(out.values())


def eval_examples(n: int = 50, train_n: int = 4000) -> list[Example]:
    """The held-out set: EVAL_SEED's sentences, none of which the first `train_n` training sentences hold."""
    seen = frozenset(e.sentence for e in examples(train_n, TRAIN_SEED))
    return examples(n, EVAL_SEED, seen)


def person_json(ex: Example) -> str:
    return json.dumps({"name": ex.name, "city": ex.city, "age": ex.age})


def target(task: str, ex: Example) -> str:
    """What the adapter for `task` should answer for this example's sentence."""
    if task == "person_json":
        return person_json(ex)
    if task == "shout":
        return "ANSWER: " + ex.city.upper()
    if task == "iso_date":
        return ex.iso
    raise KeyError(f"unknown task {task!r}; tasks: {', '.join(TASK_NAMES)}")


def correct(task: str, text: str, ex: Example) -> bool:
    """Counted success: JSON equal as data (key order and spacing free), the others exact after strip."""
    text = text.strip()
    if task == "person_json":
        try:
            return json.loads(text) == {"name": ex.name, "city": ex.city, "age": ex.age}
        except ValueError:
            return False
    return text == target(task, ex)


def chat(text: str) -> list[dict[str, str]]:
    """The prompt as a chat: the user's message is the sentence alone (the adapter, not the prompt, says what
    to do with it); the tokenizer's template adds SmolLM2's system line."""
    return [{"role": "user", "content": text}]
