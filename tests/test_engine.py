"""The engine against HF transformers, token for token in fp32: staggered async arrivals, preemption,
prefix caching, seeded sampling, stops and input validation (through LLMKernel); and the Engine alone: text
equal to decoding all output ids, typed failures, no adapter manager."""

import asyncio
import random

import pytest
import torch

from app.config.model_config import ModelConfig
from app.errors import AdapterUnavailable, InternalError, InvalidRequest
from app.replica.engine import Engine
from app.replica.engine_config import EngineConfig
from app.replica.lora.null import NullAdapters
from app.replica.models import Model
from app.replica.output_state import Delta
from app.sampling_params import SamplingParams
from loraland import LLMKernel
from tests.hf_oracle import hf_greedy, load_hf

MAX_NEW = 12


def make_prompts(tok, n=16, seed=0):
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world ray serve paged attention adapters".split()
    return [
        tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))), add_special_tokens=False)
        for _ in range(n)
    ]


async def staggered(kernel, prompts, max_tokens, seed=0):
    rng = random.Random(seed)

    async def one(p):
        await asyncio.sleep(rng.random() * 0.05)
        ids, reason = [], None
        async for d in kernel.generate(p, max_tokens=max_tokens, ignore_eos=True):
            ids += d.token_ids
            reason = d.finish_reason
        return ids, reason

    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.fixture(scope="module", params=["llama-gqa", "llama-mqa-rope3", "qwen2-tied"])
def model_case(request, tiny_models):
    d = tiny_models[request.param]
    hf = load_hf(d)
    with LLMKernel(d, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64) as k:
        prompts = make_prompts(k.tokenizer)
        refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        yield d, k, prompts, refs


def test_staggered_async_matches_hf(model_case):
    _, k, prompts, refs = model_case
    outs = asyncio.run(staggered(k, prompts, MAX_NEW))
    assert [o[0] for o in outs] == refs
    assert all(o[1] == "length" for o in outs)


def test_complete_matches_hf_under_preemption(model_case):
    d, _, prompts, refs = model_case
    with LLMKernel(d, dtype="float32", num_kv_blocks=12, block_size=8, max_batch_size=16) as k:
        outs = k.complete(prompts, max_tokens=MAX_NEW, ignore_eos=True)
        assert k.engine.scheduler.num_preemptions > 0
        assert k.engine.allocator.num_used == 0
    assert [o.token_ids for o in outs] == refs


def test_prefix_caching_shares_blocks(llama_dir):
    hf = load_hf(llama_dir)
    peaks = {}
    for caching in (True, False):
        with LLMKernel(
            llama_dir, dtype="float32", num_kv_blocks=128, block_size=8, enable_prefix_caching=caching
        ) as k:
            tok = k.tokenizer
            prefix = tok.encode(
                "Paged attention keeps the KV cache in fixed size blocks. " * 3, add_special_tokens=False
            )
            prompts = [prefix + tok.encode(f" case {i} fox", add_special_tokens=False) for i in range(6)]

            async def run():
                first = k.generate(prompts[0], max_tokens=MAX_NEW, ignore_eos=True)  # noqa: B023 (awaited here)
                ids0 = []
                async for d in first:  # the first prompt's prefix is cached once its prefill is done
                    ids0 += d.token_ids
                    if len(ids0) == 1:
                        rest = asyncio.gather(*(collect(p) for p in prompts[1:]))  # noqa: B023
                return [ids0] + await rest

            async def collect(p):
                return [
                    t async for d in k.generate(p, max_tokens=MAX_NEW, ignore_eos=True) for t in d.token_ids
                ]

            outs = asyncio.run(run())
            assert outs == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
            peaks[caching] = k.engine.allocator.peak_used
            if caching:
                assert k.engine.allocator.hits >= 5 * (len(prefix) // 8)
    assert peaks[True] < peaks[False]


def test_seeded_sampling_same_alone_and_in_busy_batch(llama_dir):
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=256) as k:
        kw = dict(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
        alone = k.complete(["hello world"], **kw)[0].token_ids
        noise = make_prompts(k.tokenizer, 12, seed=3)
        busy = k.complete(noise[:6] + ["hello world"] + noise[6:], **{**kw, "seed": 1234})[6].token_ids
        other_seed = k.complete(["hello world"], **{**kw, "seed": 99})[0].token_ids
    assert alone == busy
    assert alone != other_seed


def test_stops_and_finish_reasons(llama_dir):
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=64) as k:
        full = k.complete(["hello world"], max_tokens=12, ignore_eos=True)[0]
        assert full.finish_reason == "length" and len(full.token_ids) == 12
        # a stop token ends the request, and is not part of the text
        stop_tok = full.token_ids[4]
        first = full.token_ids.index(stop_tok)
        c = k.complete(["hello world"], max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True)[0]
        assert c.finish_reason == "stop" and c.token_ids == full.token_ids[: first + 1]
        # a stop string truncates the text before it
        text = full.text
        needle = text[len(text) // 2 : len(text) // 2 + 2]
        if needle.strip():
            c = k.complete(["hello world"], max_tokens=12, stop=[needle], ignore_eos=True)[0]
            assert c.finish_reason == "stop" and c.text == text[: text.find(needle)]
        # eos is honoured unless ignore_eos
        eos = k.tokenizer.eos_token_id
        k.engine.outputs.eos_ids = {full.token_ids[2]}
        c = k.complete(["hello world"], max_tokens=12)[0]
        assert c.finish_reason == "stop" and len(c.token_ids) <= 3
        k.engine.outputs.eos_ids = {eos}


def test_streamed_text_equals_final_text(llama_dir):
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=64) as k:
        final = k.complete(["the quick brown fox"], max_tokens=16, ignore_eos=True)[0]

        async def run():
            return "".join(
                [d.text async for d in k.generate("the quick brown fox", max_tokens=16, ignore_eos=True)]
            )

        assert asyncio.run(run()) == final.text


def test_abandoned_stream_aborts_and_frees_blocks(llama_dir):
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=64) as k:

        async def run():
            agen = k.generate("hello world", max_tokens=200, ignore_eos=True)
            async for _ in agen:
                break
            await agen.aclose()

        asyncio.run(run())
        for _ in range(200):
            if k.engine.allocator.num_used == 0 and not k.engine.scheduler.running:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert k.engine.allocator.num_used == 0


def test_bad_input_is_refused_with_the_limit(llama_dir, tmp_path):
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=4, block_size=4, max_model_len=64) as k:
        with pytest.raises(InvalidRequest, match="max_model_len is 64"):
            k.complete([[5] * 80])
        with pytest.raises(InvalidRequest, match="KV blocks"):
            k.complete([[5] * 10], max_tokens=30)
        with pytest.raises(InvalidRequest, match="max_tokens"):
            k.complete(["hi"], max_tokens=0)
        with pytest.raises(InvalidRequest, match="unknown sampling parameter.*frequency_pently"):
            k.complete(["hi"], frequency_pently=1.0)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLMKernel(tmp_path)
    bad = tmp_path / "nowts"
    bad.mkdir()
    (bad / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        LLMKernel(bad)


def test_sharded_checkpoint_and_hub_cache_id(llama_dir, tmp_path, monkeypatch):
    """A sharded safetensors index loads; a Hub id resolves through huggingface_hub's offline cache."""
    import shutil

    hf = load_hf(llama_dir)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB", safe_serialization=True)
    for f in llama_dir.glob("tokenizer*"):
        shutil.copy(f, sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = [5, 6, 7, 8]
    ref = hf_greedy(hf, prompt, 6)
    with LLMKernel(sharded, dtype="float32", num_kv_blocks=32) as k:
        assert k.complete([prompt], max_tokens=6, ignore_eos=True)[0].token_ids == ref
    # lay the folder out as a hub cache snapshot: models--org--name/{refs/main, snapshots/<rev>/...}
    cache = tmp_path / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--tiny-org--tiny-llama" / "snapshots" / rev
    shutil.copytree(llama_dir, snap)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with LLMKernel("tiny-org/tiny-llama", dtype="float32", num_kv_blocks=32) as k:
        assert k.complete([prompt], max_tokens=6, ignore_eos=True)[0].token_ids == ref


# ---------------------------------------------------------------------- the Engine alone (no LLMKernel)
@pytest.fixture(scope="module")
def model_and_tok(llama_dir):
    from transformers import AutoTokenizer

    model = Model(llama_dir, ModelConfig.from_folder(llama_dir), torch.float32, torch.device("cpu"))
    return model, AutoTokenizer.from_pretrained(llama_dir)


def engine_of(model_and_tok, adapters=None) -> Engine:
    model, tok = model_and_tok
    cfg = EngineConfig(max_model_len=512, num_kv_blocks=64)
    e = Engine(model, tok, cfg) if adapters is None else Engine(model, tok, cfg, adapters)
    e.start()
    return e


def collect(
    engine: Engine, prompt: list[int], params: SamplingParams, adapter: str | None = None
) -> list[Delta]:
    async def run():
        return [d async for d in engine.stream(prompt, params, adapter=adapter)]

    return asyncio.run(run())


def test_engine_text_equals_decoding_all_output_ids(model_and_tok):
    _, tok = model_and_tok
    engine = engine_of(model_and_tok)
    try:
        prompt = tok.encode("the quick brown fox", add_special_tokens=False)
        ds = collect(engine, prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        ids = [t for d in ds for t in d.token_ids]
        full = tok.decode(ids, skip_special_tokens=True)
        assert len(ids) == 200 and ds[-1].finish_reason == "length"
        assert "".join(d.text for d in ds) == full
        assert (ds[-1].prompt_tokens, ds[-1].completion_tokens) == (len(prompt), 200)
        # a stop string from the middle of that text cuts it there (greedy: the same tokens again)
        needle = next(full[i : i + 3] for i in range(len(full) // 2, len(full)) if full[i : i + 3].strip())
        ds = collect(engine, prompt, SamplingParams(max_tokens=200, ignore_eos=True, stop=(needle, "zzzz")))
        assert ds[-1].finish_reason == "stop"
        assert "".join(d.text for d in ds) == full[: full.find(needle)]
        assert engine.allocator.num_used == 0
    finally:
        engine.stop()


def test_engine_without_adapter_manager_refuses_adapter_requests(model_and_tok):
    engine = engine_of(model_and_tok)
    try:
        assert isinstance(engine.adapters, NullAdapters)
        with pytest.raises(InvalidRequest, match="base model only"):
            engine.add([5, 6, 7], SamplingParams(), lambda d: None, adapter="sql@1")
        assert collect(engine, [5, 6, 7], SamplingParams(max_tokens=3))[-1].finish_reason in (
            "length",
            "stop",
        )
    finally:
        engine.stop()


class ColdAdapters(NullAdapters):
    """Every adapter is cold and its load fails."""

    def __init__(self):
        self.finished_seqs = []

    def submitted(self, key: str) -> None:
        pass

    def admit(self, seq) -> bool:
        return seq.adapter is None

    def finished(self, seq) -> None:
        self.finished_seqs.append(seq)

    def poll(self) -> dict[str, str]:
        return {"x@1": "no such file"}


def test_failures_are_typed(model_and_tok, monkeypatch):
    adapters = ColdAdapters()
    engine = engine_of(model_and_tok, adapters)
    try:
        ds = collect(engine, [5, 6, 7], SamplingParams(max_tokens=3), adapter="x@1")
        assert len(ds) == 1 and ds[0].finish_reason == "abort"
        assert type(ds[0].error) is AdapterUnavailable
        assert str(ds[0].error) == "adapter x@1 could not be loaded: no such file"
        assert [s.adapter for s in adapters.finished_seqs] == ["x@1"]

        def boom(*args):
            raise RuntimeError("kaput")

        monkeypatch.setattr(engine.model, "forward", boom)
        ds = collect(engine, [5, 6, 7], SamplingParams(max_tokens=3))
        assert ds[-1].finish_reason == "abort"
        assert type(ds[-1].error) is InternalError
        assert str(ds[-1].error) == "internal error in the engine step: kaput"
        assert engine.allocator.num_used == 0
    finally:
        engine.stop()
