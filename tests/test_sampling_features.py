"""Sampling features in the batched sampler (issue 18): logprobs, penalties, min_p, logit_bias, min_tokens.

Oracles: HF transformers + PEFT in fp32. Log probabilities equal HF's log_softmax of the same logits (base and
adapter); the penalties match HF's logits processors under greedy decoding token for token (repetition:
HF's own RepetitionPenaltyLogitsProcessor; presence/frequency, logit_bias, min_tokens: the tiny references
below); rows of a mixed batch get exactly what they get alone; and the HTTP shapes, through the in-process
stack with the openai SDK, streaming and not.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from app.errors import InvalidRequest
from app.replica import sampling
from app.replica.logits_processors import apply_processors
from app.replica.sampler_state import SamplerState
from app.replica.sampling import sample, sample_with_logprobs
from app.sampling_params import SamplingParams
from loraland import LLMKernel
from tests.fixtures.adapters import SPECS_BY_NAME, make_adapter_set, peft_model_with
from tests.fixtures.services import redis_server  # noqa: F401
from tests.hf_oracle import hf_greedy

PROMPTS = ["the quick brown fox", "hello world, this is lora land", "0123456789 + - * / = ( )"]
ADAPTER = "all-r4-rs"
OTHER = "attn-r8"
V = 384


@pytest.fixture(scope="module")
def case(llama_dir, tmp_path_factory):
    specs = [SPECS_BY_NAME[ADAPTER], SPECS_BY_NAME[OTHER]]
    adapters = make_adapter_set(llama_dir, tmp_path_factory.mktemp("sf-adapters"), specs)
    peft = peft_model_with(llama_dir, adapters)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    k = LLMKernel(llama_dir, dtype="float32", num_kv_blocks=256, max_adapters=4)
    for name, path in adapters.items():
        k.load_adapter(name, path)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    yield k, peft, prompts
    k.close()


def hf_logprobs(peft, ids: list[int], out: list[int], adapter: str | None) -> torch.Tensor:
    """HF's log_softmax at each output position: [len(out), V]."""
    full = torch.tensor([ids + out])
    with torch.no_grad():
        logits = peft(full, adapter_names=[adapter or "__base__"]).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)


# ---- log probabilities ---------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [None, ADAPTER])
@pytest.mark.parametrize("how", [dict(), dict(temperature=0.9, seed=11, top_k=50)])
def test_logprobs_equal_hf_log_softmax(case, adapter, how):
    """Raw logprobs (vLLM's default): log_softmax of the model's logits, whatever the temperature/top-k."""
    k, peft, prompts = case
    outs = k.complete(prompts, [adapter] * len(prompts), max_tokens=8, ignore_eos=True, logprobs=5, **how)
    for ids, c in zip(prompts, outs):
        ref = hf_logprobs(peft, ids, c.token_ids, adapter)
        assert [s.token_id for s in c.logprobs] == c.token_ids
        for j, s in enumerate(c.logprobs):
            assert abs(s.logprob - ref[j, s.token_id].item()) < 1e-4
            vals, idx = ref[j].topk(5)
            assert list(s.top_ids) == idx.tolist()
            assert max(abs(a - b) for a, b in zip(s.top_logprobs, vals.tolist())) < 1e-4


def test_logprobs_are_raw_before_penalties_and_bias(case):
    k, peft, prompts = case
    kw = dict(max_tokens=8, ignore_eos=True, logprobs=2)
    c = k.complete(prompts[:1], **kw, repetition_penalty=1.8, logit_bias={7: 5.0})[0]
    ref = hf_logprobs(peft, prompts[0], c.token_ids, None)
    for j, s in enumerate(c.logprobs):
        assert abs(s.logprob - ref[j, s.token_id].item()) < 1e-4
    zero = k.complete(prompts[:1], max_tokens=3, ignore_eos=True, logprobs=0)[0]
    assert all(s.top_ids == () for s in zero.logprobs) and len(zero.logprobs) == 3
    assert k.complete(prompts[:1], max_tokens=3, ignore_eos=True)[0].logprobs is None


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_prompt_logprobs_equal_hf_log_softmax(case, llama_dir, adapter):
    """echo's prompt log probabilities: every prompt position, over chunked prefill, never from the prefix
    cache (a prompt seen before is computed again), the first token without one."""
    k, peft, prompts = case
    ids = prompts[1] + prompts[2]
    for _ in range(2):  # the second time its blocks are in the prefix cache
        c = k.complete([ids], [adapter], max_tokens=2, ignore_eos=True, logprobs=1, prompt_logprobs=4)[0]
        assert [s.token_id for s in c.prompt_logprobs] == ids
        assert c.prompt_logprobs[0].logprob is None
        full = torch.tensor([ids])
        with torch.no_grad():
            logits = peft(full, adapter_names=[adapter or "__base__"]).logits[0].float()
        ref = torch.log_softmax(logits[:-1], dim=-1)
        for j, s in enumerate(c.prompt_logprobs[1:]):
            assert abs(s.logprob - ref[j, ids[j + 1]].item()) < 1e-4
            vals, idx = ref[j].topk(4)
            assert list(s.top_ids) == idx.tolist()
            assert max(abs(a - b) for a, b in zip(s.top_logprobs, vals.tolist())) < 1e-4
    # chunked prefill (8 tokens a step), a chain: the caller's prompt under the first stage
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8) as small:
        c = small.complete([ids], max_tokens=2, ignore_eos=True, prompt_logprobs=0)[0]
    for j, s in enumerate(c.prompt_logprobs[1:]):
        assert abs(s.logprob - hf_logprobs(peft, ids[:1], ids[1:], None)[j, ids[j + 1]].item()) < 1e-4
    chained = k.complete([ids], [f"{ADAPTER}|{OTHER}"], max_tokens=2, ignore_eos=True, prompt_logprobs=0)[0]
    alone = k.complete([ids], [ADAPTER], max_tokens=2, ignore_eos=True, prompt_logprobs=0)[0]
    assert [(s.token_id, s.logprob) for s in chained.prompt_logprobs] == [
        (s.token_id, s.logprob) for s in alone.prompt_logprobs
    ]


def test_preemption_keeps_prompt_logprobs_and_penalty_counts(case, llama_dir):
    """A recompute after preemption neither repeats prompt log probabilities nor recounts penalized tokens."""
    k, _, prompts = case
    many = [p + q for p in prompts for q in prompts]
    kw = dict(max_tokens=12, ignore_eos=True, prompt_logprobs=2, logprobs=1, repetition_penalty=1.5)
    kw.update(presence_penalty=0.7, frequency_penalty=0.3)
    want = k.complete(many, **kw)
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=14, block_size=8, max_batch_size=16) as small:
        got = small.complete(many, **kw)
        assert small.engine.scheduler.num_preemptions > 0
    for ids, a, b in zip(many, got, want):
        assert a.token_ids == b.token_ids
        assert [s.token_id for s in a.prompt_logprobs] == ids
        assert (
            max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
            < 1e-4
        )


# ---- penalties, bias, min_tokens against HF --------------------------------------------------------------


class OpenAIPenalties(LogitsProcessor):
    """Reference: OpenAI's presence/frequency penalties over the generated tokens, one token at a time."""

    def __init__(self, n_prompt: int, presence: float, frequency: float):
        self.n, self.presence, self.frequency = n_prompt, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b in range(scores.shape[0]):
            counts: dict[int, int] = {}
            for t in input_ids[b, self.n :].tolist():
                counts[t] = counts.get(t, 0) + 1
            for t, c in counts.items():
                scores[b, t] -= self.frequency * c + self.presence
        return scores


class Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


class MinTokens(LogitsProcessor):
    def __init__(self, n_prompt: int, min_tokens: int, stops: list[int]):
        self.n, self.min, self.stops = n_prompt, min_tokens, stops

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if input_ids.shape[1] - self.n < self.min:
            scores[:, self.stops] = float("-inf")
        return scores


PENALTIES = [
    dict(repetition_penalty=1.6),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=1.2),
    dict(presence_penalty=-1.0, frequency_penalty=0.6),
    dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.4),
]


@pytest.mark.parametrize("adapter", [None, ADAPTER])
@pytest.mark.parametrize("pen", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalties_match_hf_processors_under_greedy(case, adapter, pen):
    k, peft, prompts = case
    n = 16
    outs = k.complete(prompts, [adapter] * len(prompts), max_tokens=n, ignore_eos=True, **pen)
    plain = k.complete(prompts, [adapter] * len(prompts), max_tokens=n, ignore_eos=True)
    for ids, c in zip(prompts, outs):
        procs = []
        if pen.get("presence_penalty") or pen.get("frequency_penalty"):
            procs.append(
                OpenAIPenalties(len(ids), pen.get("presence_penalty", 0.0), pen.get("frequency_penalty", 0.0))
            )
        hf_kw = dict(adapter_names=[adapter or "__base__"], logits_processor=LogitsProcessorList(procs))
        if "repetition_penalty" in pen:
            hf_kw["repetition_penalty"] = pen["repetition_penalty"]
        assert c.token_ids == hf_greedy(peft, ids, n, **hf_kw)
    assert [c.token_ids for c in outs] != [c.token_ids for c in plain]  # the penalty did something


def test_logit_bias_and_min_tokens_match_hf(case):
    k, peft, prompts = case
    ids, n = prompts[1], 10
    plain = k.complete([ids], max_tokens=n, ignore_eos=True)[0].token_ids
    bias = {plain[0]: -100.0, plain[2]: -3.5, 17: 4.0}
    got = k.complete([ids], max_tokens=n, ignore_eos=True, logit_bias=bias)[0].token_ids
    ref = hf_greedy(
        peft, ids, n, adapter_names=["__base__"], logits_processor=LogitsProcessorList([Bias(bias)])
    )
    assert got == ref and got != plain
    # min_tokens: the stop token ids cannot end the output before min_tokens tokens
    stops = plain[:2]
    early = k.complete([ids], max_tokens=n, ignore_eos=True, stop_token_ids=stops)[0]
    assert early.token_ids == plain[:1] and early.finish_reason == "stop"
    got = k.complete([ids], max_tokens=n, ignore_eos=True, stop_token_ids=stops, min_tokens=4)[0]
    ref = hf_greedy(
        peft,
        ids,
        n,
        adapter_names=["__base__"],
        logits_processor=LogitsProcessorList([MinTokens(len(ids), 4, stops)]),
    )
    end = next((i for i, t in enumerate(ref) if t in stops), n - 1)
    assert got.token_ids == ref[: end + 1] and len(got.token_ids) > 4


def test_min_tokens_holds_back_stop_strings(case):
    k, _, prompts = case
    plain = k.complete(prompts[:1], max_tokens=8, ignore_eos=True)[0]
    first = k.tokenizer.decode(plain.token_ids[:1])
    assert first.strip()
    stop = first.strip()[:1]
    cut = k.complete(prompts[:1], max_tokens=8, ignore_eos=True, stop=[stop])[0]
    assert len(cut.token_ids) == 1
    held = k.complete(prompts[:1], max_tokens=8, ignore_eos=True, stop=[stop], min_tokens=3)[0]
    assert len(held.token_ids) > 3 and held.token_ids[:4] == plain.token_ids[:4]


def test_logit_bias_outside_the_vocabulary_is_refused(case):
    k, _, prompts = case
    with pytest.raises(InvalidRequest) as e:
        k.complete(prompts[:1], max_tokens=2, logit_bias={10**6: 1.0})
    assert e.value.param == "logit_bias" and "vocabulary" in str(e.value)


# ---- mixed batches -----------------------------------------------------------------------------------------

ROWS = [
    (None, {}),
    (ADAPTER, {"logprobs": 3, "repetition_penalty": 1.4}),
    (OTHER, {"presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {5: 3.0}}),
    (None, {"temperature": 0.8, "seed": 7, "min_p": 0.05, "logprobs": 0}),
    (OTHER, {}),
    (ADAPTER, {"temperature": 1.0, "seed": 3, "top_k": 20, "presence_penalty": -0.5, "min_tokens": 5}),
    (None, {"repetition_penalty": 1.2, "logprobs": 20, "temperature": 0.5, "seed": 1, "top_p": 0.9}),
    (ADAPTER, {}),
]


def test_mixed_batch_rows_get_what_they_get_alone(case, monkeypatch):
    from app.replica import engine

    k, _, prompts = case
    steps = []  # per step: how many rows used a processor, logprobs, neither

    def spy(logits, params, *a, **kw):
        steps.append(
            (sum(p.processed for p in params), sum(p.logprobs is not None for p in params), len(params))
        )
        return sample_with_logprobs(logits, params, *a, **kw)

    monkeypatch.setattr(engine, "sample_with_logprobs", spy)

    async def one(i, adapter, kw):
        toks, lps = [], []
        async for d in k.generate(prompts[i % len(prompts)], adapter, max_tokens=10, ignore_eos=True, **kw):
            toks += d.token_ids
            lps += d.logprobs or []
        return toks, lps

    async def together():
        return await asyncio.gather(*(one(i, a, kw) for i, (a, kw) in enumerate(ROWS)))

    async def alone():
        return [await one(i, a, kw) for i, (a, kw) in enumerate(ROWS)]

    mixed = asyncio.run(together())
    assert max(n for _, _, n in steps) == len(ROWS)  # all rows did share steps
    assert any(0 < proc < n and 0 < lp < n for proc, lp, n in steps)
    single = asyncio.run(alone())
    for (a, kw), (t1, l1), (t2, l2) in zip(ROWS, mixed, single):
        assert t1 == t2, (a, kw)
        assert len(l1) == (len(t1) if "logprobs" in kw else 0) == len(l2)
        for x, y in zip(l1, l2):
            assert x.token_id == y.token_id and x.top_ids == y.top_ids and abs(x.logprob - y.logprob) < 1e-5


# ---- the sampler alone -------------------------------------------------------------------------------------


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_rows_without_options_take_the_fast_path(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("processors ran for a batch that needs none")

    monkeypatch.setattr(sampling, "apply_processors", boom)
    monkeypatch.setattr(sampling, "sample_logprobs", boom)
    ps = [SamplingParams(), SamplingParams(temperature=0.7, seed=1, top_k=5, top_p=0.9)]
    toks, lps = sample_with_logprobs(rows(2), ps, [SamplerState(), SamplerState()])
    assert all(isinstance(t, int) for t in toks) and lps == [None, None]


def test_each_row_of_a_mixed_sampler_batch_equals_itself_alone():
    x = rows(6, seed=4)
    hist = [([1, 2, 3, 3], [4, 4, 5]), ([9], []), ([7, 7], [8]), ([1], [2, 2, 2]), ([5], [5]), ([6], [])]
    ps = [
        SamplingParams(repetition_penalty=1.5, logprobs=4),
        SamplingParams(),
        SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, temperature=1.0, seed=3),
        SamplingParams(logit_bias=((2, -100.0), (11, 7.0)), min_p=0.2, temperature=0.9, seed=5, logprobs=0),
        SamplingParams(min_tokens=2, stop_token_ids=(5,), max_tokens=4),
        SamplingParams(temperature=1.3, seed=9, logprobs=20),
    ]
    together = sample_with_logprobs(
        x, ps, [SamplerState() for _ in ps], histories=hist, stop_ids=frozenset({1})
    )
    for i, p in enumerate(ps):
        alone = sample_with_logprobs(
            x[i : i + 1], [p], [SamplerState()], histories=hist[i : i + 1], stop_ids=frozenset({1})
        )
        assert together[0][i] == alone[0][0] and together[1][i] == alone[1][0]


def test_processors_follow_their_definitions():
    x = rows(1, seed=2)
    prompt, out = [3, 4, 4], [4, 9, 9, 9]
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    y = x.clone()
    apply_processors(y, [p], [SamplerState()], [(prompt, out)], frozenset())
    want = x.clone()[0]
    for t in {3, 4, 9}:
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[4] -= 0.25 * 1 + 0.5
    want[9] -= 0.25 * 3 + 0.5
    assert torch.allclose(y[0], want)
    # counts kept incrementally (one new token per step) equal counts built at once
    st = SamplerState()
    for j in range(1, len(out) + 1):
        z = x.clone()
        apply_processors(z, [p], [st], [(prompt, out[:j])], frozenset())
    assert torch.equal(z, y) and st.counted == len(out)


def test_min_tokens_masks_eos_unless_ignored_and_bias_moves_argmax():
    x = rows(3, seed=6)
    top = x.argmax(-1).tolist()
    hist = [([1], []), ([1], []), ([1], [0, 0])]
    ps = [
        SamplingParams(min_tokens=2, max_tokens=4),  # the model's EOS (its argmax here) is masked
        SamplingParams(min_tokens=2, max_tokens=4, ignore_eos=True),  # EOS allowed
        SamplingParams(min_tokens=2, max_tokens=4),  # two tokens already: nothing masked
    ]
    eos = frozenset({top[0], top[1], top[2]})
    got = sample(x, ps, [SamplerState() for _ in ps], histories=hist, stop_ids=eos)
    assert got[0] != top[0] and got[1] == top[1] and got[2] == top[2]
    second = x[0].topk(2).indices[1].item()
    biased = sample(
        x[:1], [SamplingParams(logit_bias=((top[0], -100.0),))], [SamplerState()], histories=hist[:1]
    )
    assert biased == [second]


def test_min_p_drops_unlikely_tokens():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        p = SamplingParams(temperature=1.0, seed=seed, min_p=0.35)
        seen.add(sample(x, [p], [SamplerState()])[0])
    assert seen == {0, 1}  # 0.15 < 0.35 * 0.5


@pytest.mark.parametrize(
    "kw, field, words",
    [
        (dict(logprobs=21), "logprobs", "[0, 20]"),
        (dict(logprobs=True), "logprobs", "got True"),
        (dict(presence_penalty=2.5), "presence_penalty", "[-2.0, 2.0]"),
        (dict(frequency_penalty=math.nan), "frequency_penalty", "[-2.0, 2.0]"),
        (dict(repetition_penalty=0.0), "repetition_penalty", "(0, 100.0]"),
        (dict(min_p=-0.1), "min_p", "[0, 1]"),
        (dict(logit_bias={-3: 1.0}), "logit_bias", "token ids"),
        (dict(logit_bias={3: 1000.0}), "logit_bias", "[-100.0, 100.0]"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens", "max_tokens=2"),
    ],
)
def test_new_values_the_sampler_cannot_honour_are_refused(kw, field, words):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_kwargs(**kw)
    assert e.value.param == field and words in str(e.value), str(e.value)


# ---- HTTP: the OpenAI shapes through the in-process stack, with the openai SDK ------------------------------


@pytest.fixture(scope="module")
def http(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    from tests.fixtures.inproc_stack import module_stack

    yield from module_stack(redis_server, llama_dir, tmp_path_factory, "sf-http")


def sdk(stack, fn):
    import httpx
    import openai

    async def go():
        client_http = httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.api), timeout=120)
        async with openai.AsyncOpenAI(
            api_key=stack.keys["alpha"], base_url="http://ll/v1", http_client=client_http
        ) as client:
            return await fn(client)

    return asyncio.run(go())


def test_http_completions_logprobs_streaming_and_not(http):
    prompt, n = "the quick brown fox", 6

    async def go(client):
        kw = dict(model="pub", prompt=prompt, max_tokens=n, logprobs=3, extra_body={"ignore_eos": True})
        whole = await client.completions.create(**kw)
        chunks = [c async for c in await client.completions.create(**kw, stream=True)]
        return whole, chunks

    whole, chunks = sdk(http, go)
    choice = whole.choices[0]
    lp = choice.logprobs
    ref = http.kernel.complete([prompt], ["pub@1"], max_tokens=n, ignore_eos=True, logprobs=3)[0]
    assert len(lp.tokens) == n and "".join(lp.tokens) == choice.text == ref.text
    assert max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs, ref.logprobs)) < 1e-5
    texts = [http.kernel.tokenizer.decode([t]) for t in ref.token_ids]
    assert lp.tokens == texts
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(n)]
    for tok, top, s in zip(lp.tokens, lp.top_logprobs, ref.logprobs):
        # keyed by token text: the top 3 and the sampled token (tokens of one text, e.g. partial UTF-8, share)
        assert set(top) == {http.kernel.tokenizer.decode([t]) for t in s.top_ids} | {tok}
        assert top[tok] == pytest.approx(s.logprob, abs=1e-5)  # greedy: the likeliest of its text
    assert whole.usage.completion_tokens == n
    # streamed: the same tokens, logprobs and offsets, spread over the chunks
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert (
        max(abs(a - b) for a, b in zip([x for s in streamed for x in s.token_logprobs], lp.token_logprobs))
        < 1e-5
    )
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_http_echo_with_prompt_logprobs_as_lm_eval_asks(http):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, temperature 0."""
    prompt = "the quick brown fox jumps"
    ids = http.kernel.tokenizer.encode(prompt, add_special_tokens=False)

    async def go(client):
        kw = dict(model="pub", prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
        whole = await client.completions.create(**kw)
        chunks = [c async for c in await client.completions.create(**kw, stream=True)]
        bare = await client.completions.create(model="pub", prompt=[ids], max_tokens=2, echo=True)
        return whole, chunks, bare

    whole, chunks, bare = sdk(http, go)
    ref = http.kernel.complete([prompt], ["pub@1"], max_tokens=1, logprobs=1, prompt_logprobs=1)[0]
    choice = whole.choices[0]
    assert choice.text == prompt + ref.text
    lp = choice.logprobs
    assert lp.tokens == [http.kernel.tokenizer.decode([t]) for t in ids + ref.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [s.logprob for s in ref.prompt_logprobs[1:] + ref.logprobs]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-5
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(prompt)
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [t for c in streamed if c.logprobs for t in c.logprobs.text_offset] == lp.text_offset
    # echo without logprobs: the prompt's text (token ids decoded) first, no logprobs
    assert (
        bare.choices[0].text.startswith(http.kernel.tokenizer.decode(ids))
        and bare.choices[0].logprobs is None
    )


def test_http_chat_logprobs_and_top_logprobs_streaming_and_not(http):
    messages = [{"role": "user", "content": "hello world"}]

    async def go(client):
        kw = dict(model="tiny-llama", messages=messages, max_tokens=5, logprobs=True, top_logprobs=2)
        whole = await client.chat.completions.create(**kw)
        chunks = [c async for c in await client.chat.completions.create(**kw, stream=True)]
        plain = await client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=5)
        return whole, chunks, plain

    whole, chunks, plain = sdk(http, go)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == whole.choices[0].message.content
    for e in content:
        # exact bytes: a token may hold part of a UTF-8 character, which its text shows as U+FFFD
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token and len(e.top_logprobs) == 2
        assert "\ufffd" in e.token or e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].token == e.token  # greedy: the sampled token is the most likely
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    # a second run may read the prompt's KV from the prefix cache: the same numbers to float32 rounding
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-5
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content


def test_http_penalties_and_bias_match_the_kernel(http):
    prompt = "hello world, this is lora land"
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5, min_tokens=3, logit_bias={"17": 3.0})

    async def go(client):
        extra = {"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 3}
        return await client.completions.create(
            model="pub",
            prompt=prompt,
            max_tokens=10,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            logit_bias={"17": 3.0},
            extra_body=extra,
        )

    got = sdk(http, go)
    kw = dict(kw, logit_bias={17: 3.0}, repetition_penalty=1.3, min_p=0.1, ignore_eos=True)
    assert got.choices[0].text == http.kernel.complete([prompt], ["pub@1"], max_tokens=10, **kw)[0].text


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"echo": True, "logprobs": 25}, "logprobs"),
        ("completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": 500}}, "logit_bias"),
        ("completions", {"repetition_penalty": -1}, "repetition_penalty"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_http_refusals_name_the_field(http, route, body, param):
    base = (
        {"model": "tiny-llama", "prompt": "x"}
        if route == "completions"
        else {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}
    )

    async def go(client):
        path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
        return await client.post(path, json={**base, "max_tokens": 2, **body}, headers=http.headers("alpha"))

    r = http.run(go)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
