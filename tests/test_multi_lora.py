"""Many adapters in one batch, token-identical to PEFT in fp32: LRU churn, preemption, merges, chains,
hot load/unload under traffic, and a corrupt adapter failing alone."""

import asyncio
import random

import pytest
import torch

from app.errors import InvalidAdapter, UnknownAdapter
from loraland import LLMKernel
from tests.fixtures.adapters import ADAPTER_SPECS, make_adapter_set, peft_model_with, write_corrupt_adapter
from tests.hf_oracle import hf_greedy

MAX_NEW = 8


def mixed_batch(tok, names, n=32, seed=0):
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world ray serve adapters blocks".split()
    prompts = [
        tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(2, 20))), add_special_tokens=False)
        for _ in range(n)
    ]
    ids = [None if i % 5 == 0 else names[i % len(names)] for i in range(n)]
    return prompts, ids


@pytest.fixture(scope="module", params=["llama-gqa", "llama-mqa-rope3", "qwen2-tied"])
def lora_case(request, tiny_models, tmp_path_factory):
    model_dir = tiny_models[request.param]
    adapters = make_adapter_set(model_dir, tmp_path_factory.mktemp(f"adapters-{request.param}"))
    peft = peft_model_with(model_dir, adapters)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(model_dir)
    prompts, ids = mixed_batch(tok, list(adapters))
    refs = [hf_greedy(peft, p, MAX_NEW, adapter_names=[a or "__base__"]) for p, a in zip(prompts, ids)]
    return model_dir, adapters, peft, prompts, ids, refs


def load_all(k, adapters):
    for name, path in adapters.items():
        k.load_adapter(name, path)


def test_mixed_batch_matches_peft(lora_case):
    model_dir, adapters, _, prompts, ids, refs = lora_case
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=256, max_adapters=16) as k:
        load_all(k, adapters)
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
        assert len(k.stats()["resident"]) == len(adapters)
    assert [o.token_ids for o in outs] == refs
    # the adapters really change the output
    base_refs = [r for r, a in zip(refs, ids) if a is None]
    assert any(r not in base_refs for r, a in zip(refs, ids) if a is not None)


def test_mixed_batch_with_lru_churn_and_preemption(lora_case):
    model_dir, adapters, _, prompts, ids, refs = lora_case
    with LLMKernel(
        model_dir, dtype="float32", num_kv_blocks=14, block_size=8, max_adapters=3, max_cpu_adapters=4
    ) as k:
        load_all(k, adapters)
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
        m = k.adapter_manager
        assert m.evictions > 0 and k.engine.scheduler.num_preemptions > 0
        assert len(k.stats()["resident"]) <= 3
    assert [o.token_ids for o in outs] == refs


def test_merge_matches_peft_cat(lora_case):
    model_dir, adapters, peft, prompts, _, _ = lora_case
    a, b = "attn-r8", "mlp-r16-rs"  # the first term without rslora: PEFT's merged config copies its flag
    peft.add_weighted_adapter([a, b], [0.7, 0.3], "cat-merge", combination_type="cat")
    refs = [hf_greedy(peft, p, MAX_NEW, adapter_names=["cat-merge"]) for p in prompts[:6]]
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=128) as k:
        load_all(k, adapters)
        outs = k.complete(prompts[:6], [f"{a}*0.7+{b}*0.3"] * 6, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == refs


def test_chain_equals_stages_one_by_one(lora_case):
    model_dir, adapters, _, prompts, _, _ = lora_case
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=128) as k:
        load_all(k, adapters)
        texts = [k.tokenizer.decode(p) for p in prompts[:5]]
        chained = k.infer(texts, ["qv-r2|all-r32"] * 5, max_tokens=MAX_NEW, ignore_eos=True)
        first = k.infer(texts, ["qv-r2"] * 5, max_tokens=MAX_NEW, ignore_eos=True)
        second = k.infer(first, ["all-r32"] * 5, max_tokens=MAX_NEW, ignore_eos=True)
        assert chained == second
        k.set_adaptive_chain(["qv-r2", "all-r32"])
        assert k.infer(texts, max_tokens=MAX_NEW, ignore_eos=True) == second
        k.set_adaptive_chain(None)
        assert k.infer(texts, max_tokens=MAX_NEW, ignore_eos=True) != second


def test_hot_load_unload_under_traffic(llama_dir, tmp_path):
    adapters = make_adapter_set(llama_dir, tmp_path / "a", ADAPTER_SPECS[:4])
    names = list(adapters)
    peft = peft_model_with(llama_dir, adapters)
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=256, max_adapters=8) as k:
        tok = k.tokenizer
        load_all(k, {n: adapters[n] for n in names[:3]})
        prompt = tok.encode("the quick brown fox", add_special_tokens=False)
        long_new = 40

        async def run():
            async def one(name, n):
                return [
                    t
                    async for d in k.generate(prompt, name, max_tokens=n, ignore_eos=True)
                    for t in d.token_ids
                ]

            victim = asyncio.create_task(one(names[0], long_new))
            others = [asyncio.create_task(one(n, long_new)) for n in names[1:3]]
            await asyncio.sleep(0.05)
            k.unload_adapter(names[0])  # in flight: it must finish correctly
            with pytest.raises(UnknownAdapter, match=names[0]):
                await one(names[0], 4)
            with pytest.raises(InvalidAdapter):  # a corrupt adapter fails alone
                k.load_adapter("broken", write_corrupt_adapter(adapters[names[1]], tmp_path / "bad", "nan"))
            k.load_adapter(names[3], adapters[names[3]])  # hot load while others decode
            late = await one(names[3], 8)
            return await victim, [await o for o in others], late

        victim, others, late = asyncio.run(run())
        assert victim == hf_greedy(peft, prompt, long_new, adapter_names=[names[0]])
        assert others == [hf_greedy(peft, prompt, long_new, adapter_names=[n]) for n in names[1:3]]
        assert late == hf_greedy(peft, prompt, 8, adapter_names=[names[3]])
        assert not k.has_adapter(names[0]) and names[0] not in k.stats()["resident"]


def test_cold_adapter_waits_while_others_decode(llama_dir, tmp_path):
    """A request whose adapter must be re-read from disk waits; the running requests keep decoding."""
    adapters = make_adapter_set(llama_dir, tmp_path / "a", ADAPTER_SPECS[:2])
    a, b = list(adapters)
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=256, max_adapters=1, max_cpu_adapters=1) as k:
        load_all(k, adapters)  # host cache of one: `a` is evicted from host when `b` is loaded
        m = k.adapter_manager
        assert m.entries[m.resolve(a)].weights is None
        outs = k.complete(["hello world", "hello world"], [b, a], max_tokens=6, ignore_eos=True)
        assert m.loads >= 1 and all(len(o.token_ids) == 6 for o in outs)


def test_resident_bytes_follow_each_adapters_rank(llama_dir, tmp_path):
    adapters = make_adapter_set(llama_dir, tmp_path / "a")
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=64, max_adapters=32) as k:
        load_all(k, adapters)
        k.complete(["hi"] * len(adapters), list(adapters), max_tokens=1)
        touched, own = k.adapter_manager.resident_bytes()
        real = sum(k.adapter_manager.entries[k.adapter_manager.resolve(n)].weights.nbytes() for n in adapters)
    assert own == real * torch.empty((), dtype=torch.float32).element_size() // 4
    assert touched <= 1.1 * own
