"""The engine's output side without a model: incremental detokenization, stop strings and stop tokens.

The oracle is the engine's previous rule, which decoded all output ids at every token (O(n^2) per request):
the windowed detokenizer must send the very same deltas, and the text must equal decoding all output ids."""

from __future__ import annotations

import random

import pytest

from app.replica.outputs import Delta, OutputProcessor
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams
from tests.fixtures.models import build_tokenizer

EOS = 1
MAX_MODEL_LEN = 100_000


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def old_deltas(tok, prompt_len: int, ids: list[int], p: SamplingParams) -> list[tuple]:
    """The previous engine's _append/_Detok, verbatim in substance: full decode at every token."""
    hold = max((len(s) for s in p.stop), default=1) - 1
    sent = sent_tokens = 0
    out, deltas = [], []
    for tok_id in ids:
        out.append(tok_id)
        reason, hide_last = None, False
        if tok_id in p.stop_token_ids or (not p.ignore_eos and tok_id == EOS):
            reason, hide_last = "stop", True
        elif len(out) >= p.max_tokens or prompt_len + len(out) >= MAX_MODEL_LEN:
            reason = "length"
        text = tok.decode(out[:-1] if hide_last else out, skip_special_tokens=True)
        if p.stop:
            start = max(0, sent - hold)
            hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
            if hits:
                text = text[: min(hits)[0]]
                reason = "stop"
        if reason is None:
            cut = len(text) - hold
            while cut > sent and text[cut - 1] == "\ufffd":
                cut -= 1
            new_text = text[sent:cut] if cut > sent else ""
        else:
            new_text = text[sent:]
        sent += len(new_text)
        deltas.append((new_text, out[sent_tokens:], reason))
        sent_tokens = len(out)
        if reason is not None:
            break
    return deltas


class CountingTokenizer:
    """Counts the token ids passed to decode: the detokenizer's cost."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def run(tok, ids: list[int], p: SamplingParams, prompt_len: int = 3) -> tuple[list[Delta], Sequence]:
    proc = OutputProcessor(tok, {EOS}, MAX_MODEL_LEN)
    got: list[Delta] = []
    seq = Sequence(0, [5] * prompt_len, p)
    seq.output = proc.state(p, got.append)
    for t in ids:
        d = proc.append(seq, t)
        got.append(d)
        if d.finish_reason is not None:
            break
    return got, seq


def test_same_deltas_as_full_decoding_on_random_tokens(tok):
    """Random ids split multi-byte characters, hit the special tokens and stop anywhere."""
    rng = random.Random(0)
    vocab = len(tok)
    text = "héllo € wörld 😀 the quick brown fox, 0123456789 ok! Paged attention"
    natural = tok.encode(text, add_special_tokens=False)
    for case in range(300):
        n = rng.randint(1, 60)
        if case % 2:
            ids = [rng.randrange(vocab) for _ in range(n)]
        else:
            start = rng.randrange(len(natural))
            ids = (natural[start:] + natural)[:n]
        decoded = tok.decode(ids, skip_special_tokens=True)
        stops: list[str] = []
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            if decoded:
                i = rng.randrange(len(decoded))
                stops.append(decoded[i : i + rng.randint(1, 4)])
        if rng.random() < 0.2:
            stops.append("never in the text at all")
        p = SamplingParams(
            max_tokens=rng.randint(1, n + 2),
            stop=tuple(stops),
            stop_token_ids=tuple(rng.sample(ids, 1)) if rng.random() < 0.2 else (),
            ignore_eos=rng.random() < 0.5,
        )
        got, _ = run(tok, ids, p)
        want = old_deltas(tok, 3, ids, p)
        assert [(d.text, d.token_ids, d.finish_reason) for d in got] == want, (ids, p)


def test_long_generation_text_equals_decoding_all_ids_in_linear_cost(tok):
    text = "The quick brown fox jumps over the lazy dog — héllo wörld, € 5 😀 ok. " * 60
    ids = tok.encode(text, add_special_tokens=False)
    ids = ids[:40] + [EOS] + ids[40:]  # a special token mid-stream is skipped, and ignore_eos keeps going
    assert len(ids) > 2000
    p = SamplingParams(max_tokens=len(ids), ignore_eos=True)
    counting = CountingTokenizer(tok)
    got, _ = run(counting, ids, p)
    assert got[-1].finish_reason == "length" and len(got) == len(ids)
    assert "".join(d.text for d in got) == tok.decode(ids, skip_special_tokens=True)
    assert [t for d in got for t in d.token_ids] == ids
    # each token decodes a window of a few tokens, never the whole output
    assert counting.decoded < 12 * len(ids)


def test_long_generation_with_stop_strings(tok):
    text = "héllo wörld, the quick brown fox 😀 jumps. " * 40 + "STOP here and then more text"
    ids = tok.encode(text, add_special_tokens=False)
    p = SamplingParams(max_tokens=len(ids), stop=("STOP", "never"), ignore_eos=True)
    got, _ = run(tok, ids, p)
    full = tok.decode(ids, skip_special_tokens=True)
    assert got[-1].finish_reason == "stop"
    assert "".join(d.text for d in got) == full[: full.find("STOP")]
    # the stop string's first characters were held back, never sent
    assert all("S" not in d.text for d in got)


def test_stop_token_is_left_out_of_the_text(tok):
    ids = tok.encode("hello world the quick brown fox", add_special_tokens=False)
    stop_at = len(ids) // 2
    p = SamplingParams(max_tokens=100, stop_token_ids=(ids[stop_at],))
    got, _ = run(tok, ids, p)
    first = ids.index(ids[stop_at])
    assert got[-1].finish_reason == "stop" and len(got) == first + 1
    assert "".join(d.text for d in got) == tok.decode(ids[:first], skip_special_tokens=True)
    # EOS ends the request the same way unless ignore_eos
    got, _ = run(tok, ids[:3] + [EOS] + ids[3:], SamplingParams(max_tokens=100))
    assert got[-1].finish_reason == "stop" and "".join(d.text for d in got) == tok.decode(ids[:3])


def test_split_multibyte_character_is_held_back(tok):
    ids = tok.encode("a😀b", add_special_tokens=False)
    got, _ = run(tok, ids, SamplingParams(max_tokens=100, ignore_eos=True))
    assert all("\ufffd" not in d.text for d in got)
    assert "".join(d.text for d in got) == "a😀b"
    # a generation that ends inside a character sends what decoding all ids gives
    got, _ = run(tok, ids[:-2], SamplingParams(max_tokens=len(ids) - 2, ignore_eos=True))
    assert "".join(d.text for d in got) == tok.decode(ids[:-2])
