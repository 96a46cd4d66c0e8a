"""Many adapters in one batch, token-identical to PEFT in fp32: LRU churn, preemption, merges, chains,
hot load/unload under traffic, and a corrupt adapter failing alone."""

import asyncio
import dataclasses
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from app.config.kernel_config import KernelConfig
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
        assert len(k.stats().resident) == len(adapters)
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
        assert len(k.stats().resident) <= 3
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
        assert not k.has_adapter(names[0]) and names[0] not in k.stats().resident


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


def test_merge_is_built_off_the_loop_and_retired_with_its_components(llama_dir, tmp_path):
    adapters = make_adapter_set(llama_dir, tmp_path / "a", ADAPTER_SPECS[:2])
    a, b = list(adapters)
    merge = f"{a}*0.5+{b}*0.5"
    with LLMKernel(llama_dir, dtype="float32", num_kv_blocks=64) as k:
        load_all(k, adapters)
        m, comp = k.adapter_manager, k.composition
        built_on: list[threading.Thread] = []
        build = comp.stages

        def spy(adapter_id):
            built_on.append(threading.current_thread())
            return build(adapter_id)

        comp.stages = spy

        async def one():
            return [t async for d in k.generate("hello world", merge, max_tokens=2) for t in d.token_ids]

        first = asyncio.run(one())
        assert built_on and threading.main_thread() not in built_on  # the merge was built in a thread
        (key,) = comp.lookup(merge)
        assert asyncio.run(one()) == first and len(built_on) == 1  # built once, then looked up on the loop
        k.load_adapter(b, adapters[b])  # a new version of a component retires the merge built on the old one
        assert m.entries.get(key) is None or m.entries[key].retired
        (key2,) = comp.stages(merge)
        assert key2 != key and asyncio.run(one()) == first  # the same weights, merged again
        k.unload_adapter(a)
        assert m.entries.get(key2) is None or m.entries[key2].retired
        with pytest.raises(UnknownAdapter, match=a):
            k.complete(["hello world"], [merge], max_tokens=1)


def test_kernel_options_live_in_one_config(llama_dir):
    cfg = KernelConfig(dtype="float32", num_kv_blocks=32, max_adapters=2)
    with LLMKernel(llama_dir, cfg, max_batch_size=4) as k:  # keyword options override the config
        assert k.config == dataclasses.replace(cfg, max_batch_size=4)
        assert k.adapter_manager.max_adapters == 2 and k.max_lora_rank == 64
    with pytest.raises(TypeError, match="max_adaptors"):
        LLMKernel(llama_dir, max_adaptors=3)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        LLMKernel(llama_dir, gpu_memory_utilization=0)


def test_importing_the_kernel_writes_no_environment():
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    code = "import os, loraland; assert 'TOKENIZERS_PARALLELISM' not in os.environ, 'set at import'"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
