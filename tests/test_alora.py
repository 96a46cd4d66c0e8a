"""Activated LoRA (PEFT alora_invocation_tokens): the delta applies from the start of the last occurrence of the
invocation sequence in the prompt on, token-identical to PEFT's aLoRA in fp32; before it the KV is the base
model's and the prefix cache shares it with base requests."""

import json
import random
import shutil

import pytest
import torch

from app.errors import InvalidAdapter, InvalidRequest
from app.replica.lora.peft_format import adapter_summary
from app.replica.sequence import alora_start
from loraland import LLMKernel
from tests.fixtures.adapters import make_peft_adapter, peft_model_with
from tests.hf_oracle import hf_greedy

MAX_NEW = 6
INV_A = [7, 19, 23]
INV_B = [31, 5]


def make_alora(model_dir, out, invocation, *, seed, r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=list(targets),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        alora_invocation_tokens=list(invocation),
    )
    pm = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    pm.save_pretrained(out, safe_serialization=True)
    return out


def prompts_with(inv, rng, vocab=300):
    """Invocation at the start, in the middle, at the end, twice, and absent (plus a prompt that holds only
    a prefix of it at the end)."""

    def words(n):
        out = []
        while len(out) < n:
            t = rng.randrange(40, vocab)
            out.append(t)
        return out

    return [
        inv + words(12),
        words(9) + inv + words(7),
        words(20) + inv,
        words(5) + inv + words(6) + inv + words(4),
        words(15),
        words(11) + inv[:-1],
        inv,
    ]


@pytest.fixture(scope="module")
def case(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("alora")
    adapters = {
        "chk-a": make_alora(llama_dir, root / "chk-a", INV_A, seed=11),
        "chk-b": make_alora(llama_dir, root / "chk-b", INV_B, seed=12, r=4, targets=("q_proj", "v_proj")),
        "plain": make_peft_adapter(
            llama_dir, root / "plain", r=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=13
        ),
    }
    peft = peft_model_with(llama_dir, adapters)
    rng = random.Random(0)
    prompts, ids = [], []
    for name, inv in (("chk-a", INV_A), ("chk-b", INV_B)):
        ps = prompts_with(inv, rng)
        prompts += ps
        ids += [name] * len(ps)
    extra = prompts_with(INV_A, rng)[:3]
    prompts += extra + extra
    ids += ["plain"] * 3 + [None] * 3
    refs = [hf_greedy(peft, p, MAX_NEW, adapter_names=[a or "__base__"]) for p, a in zip(prompts, ids)]
    base = [hf_greedy(peft, p, MAX_NEW, adapter_names=["__base__"]) for p in prompts]
    return llama_dir, adapters, peft, prompts, ids, refs, base


def test_activation_point_is_peft_rule():
    assert alora_start([1, 2, 3, 1, 2], (1, 2)) == 3
    assert alora_start([1, 2, 3], (1, 2, 3)) == 0
    assert alora_start([1, 2], (1, 2, 3)) is None
    assert alora_start([9, 1, 2, 1], (1, 2)) == 1


def test_peft_reference_is_really_activated(case):
    _, _, _, prompts, ids, refs, base = case
    # with the invocation the adapter changes the output; without it PEFT serves the base model
    on = [
        i
        for i, (p, a) in enumerate(zip(prompts, ids))
        if a == "chk-a" and alora_start(p, tuple(INV_A)) is not None
    ]
    assert any(refs[i] != base[i] for i in on)
    off = [
        i for i, (p, a) in enumerate(zip(prompts, ids)) if a and a.startswith("chk") and refs[i] == base[i]
    ]
    assert off


@pytest.mark.parametrize("chunk,blocks", [(4096, 256), (7, 256), (4096, 24)])
def test_mixed_alora_lora_base_match_peft(case, chunk, blocks):
    """One batch; chunked prefill (7 tokens a step: chunks that cross the activation point); a small KV cache
    (preemption by recompute, then prefix reuse across base-keyed and adapter-keyed blocks)."""
    model_dir, adapters, _, prompts, ids, refs, _ = case
    with LLMKernel(
        model_dir, dtype="float32", num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=chunk
    ) as k:
        for n, p in adapters.items():
            k.load_adapter(n, p)
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
        if blocks < 100:
            assert k.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs
    for o, p, a in zip(outs, prompts, ids):
        if a in ("chk-a", "chk-b"):
            inv = tuple(INV_A if a == "chk-a" else INV_B)
            assert o.alora_activated is (alora_start(p, inv) is not None)
        else:
            assert o.alora_activated is None


def _long_prefix(n, seed=1):
    rng = random.Random(seed)
    return [rng.randrange(40, 300) for _ in range(n)]


def test_prefix_cache_shared_with_base(case):
    model_dir, adapters, peft, *_ = case
    prefix = _long_prefix(96)
    q = prefix + INV_A + [50, 60, 70]
    ref = hf_greedy(peft, q, MAX_NEW, adapter_names=["chk-a"])
    ref_base = hf_greedy(peft, prefix, MAX_NEW, adapter_names=["__base__"])
    bs = 8
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=256, block_size=bs) as k:
        k.load_adapter("chk-a", adapters["chk-a"])
        alloc = k.engine.scheduler.alloc
        assert k.complete([prefix], [None], max_tokens=MAX_NEW, ignore_eos=True)[0].token_ids == ref_base
        h0 = alloc.hits
        out = k.complete([q], ["chk-a"], max_tokens=MAX_NEW, ignore_eos=True)[0]
        assert out.token_ids == ref and out.alora_activated is True
        assert alloc.hits - h0 == len(prefix) // bs  # every full base block before the activation point
        # the reverse: an aLoRA request first, then the base model on the same conversation
        p2 = _long_prefix(80, seed=2)
        q2 = p2 + INV_A + [44]
        ref2 = hf_greedy(peft, q2, MAX_NEW, adapter_names=["chk-a"])
        assert k.complete([q2], ["chk-a"], max_tokens=MAX_NEW, ignore_eos=True)[0].token_ids == ref2
        h1 = alloc.hits
        got = k.complete([p2 + [45]], [None], max_tokens=MAX_NEW, ignore_eos=True)[0].token_ids
        assert alloc.hits - h1 == len(p2) // bs
        assert got == hf_greedy(peft, p2 + [45], MAX_NEW, adapter_names=["__base__"])
        # a plain LoRA still never shares KV with the base model
        adapters_plain = adapters["plain"]
        k.load_adapter("plain", adapters_plain)
        h2 = alloc.hits
        k.complete([prefix + [50]], ["plain"], max_tokens=2, ignore_eos=True)
        assert alloc.hits == h2


def test_refusals_and_summary(case, tmp_path):
    model_dir, adapters, *_ = case
    from app.replica.lora.checks import check_adapter

    check_adapter(adapters["chk-a"], max_rank=64)  # `loraland adapters validate/push` accept it
    s = adapter_summary(adapters["chk-a"])
    assert s["alora_invocation_tokens"] == INV_A
    assert adapter_summary(adapters["plain"])["alora_invocation_tokens"] is None

    def variant(name, **changes):
        d = tmp_path / name
        shutil.copytree(adapters["chk-a"], d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(changes)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return d

    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=64) as k:
        for bad, words in (
            (variant("empty", alora_invocation_tokens=[]), "non-empty list"),
            (variant("strs", alora_invocation_tokens=["a"]), "non-empty list"),
            (variant("oov", alora_invocation_tokens=[1, 100000]), "vocabulary"),
        ):
            with pytest.raises(InvalidAdapter, match=words):
                k.load_adapter(bad.name, bad)
        k.load_adapter("chk-a", adapters["chk-a"])
        k.load_adapter("plain", adapters["plain"])
        with pytest.raises(InvalidRequest, match="chk-a.*activated LoRA"):
            k.complete([[50, 60]], ["chk-a*0.5+plain*0.5"], max_tokens=2)
        # a chain runs each stage as PEFT's generate would: allowed
        k.infer(["hello"], ["plain|chk-a"], max_tokens=2, ignore_eos=True)


def test_step_plan_masks_per_token(case):
    """The LoRA plan of one step: a chunk wholly before activation is a base chunk (no plan rows of its own),
    the chunk that crosses it gets a plan whose leading tokens are slot -1, plain LoRA rows stay one plan."""
    from app.replica.batch import Batch, ScheduledSeq
    from app.replica.batch_builder import BatchBuilder
    from app.replica.sequence import Sequence
    from app.sampling_params import SamplingParams

    model_dir, adapters, *_ = case
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=64, block_size=4) as k:
        for n in ("chk-a", "plain"):
            k.load_adapter(n, adapters[n])
        m = k.adapter_manager
        prompt = [50] * 10 + INV_A + [60] * 5  # activation at 10
        seqs = [Sequence(i, list(prompt), SamplingParams(max_tokens=1), adapter=m.resolve(a)) for i, a in
                enumerate(["chk-a", "chk-a", "plain", "chk-a"])]  # fmt: skip
        for s in seqs:
            assert m.admit(s)
        assert [s.lora_start for s in seqs] == [10, 10, 0, 10]
        b = Batch([ScheduledSeq(seqs[0], 8, 0), ScheduledSeq(seqs[1], 6, 6), ScheduledSeq(seqs[2], 5, 0),
                   ScheduledSeq(seqs[3], 2, 12)])  # fmt: skip
        for it in b.items:
            it.seq.num_computed = it.start
            it.seq.block_ids = list(range(5))
        fb, *_ = BatchBuilder(4, torch.device("cpu"), m).build(b)
        assert b.items[0].seq is seqs[0]  # wholly before activation: sorted among the base rows
        plans = [(p.start, p.end, p.segments.num_base) for p in fb.lora.plans]
        # seqs[0]: rows 0-7 base; then the crossing chunk (4 of 6 before activation) alone, the decode-like
        # chunk of seqs[3] after it, and plain's rows in its own pool: every row is in exactly one plan
        assert (8, 14, 4) in plans and sum(e - s for s, e, _ in plans) == 6 + 5 + 2


def test_usage_says_whether_the_alora_adapter_activated():
    """OpenAI's usage carries alora_activated for aLoRA requests: False when a prompt lacked the invocation
    (that prompt was served as the base model), absent for other requests."""
    from app.protocol import ChoiceDelta
    from app.router.service import IngressService

    first = ChoiceDelta(0, "a", None, 5, 1, alora_activated=True)
    first.merge(ChoiceDelta(0, "b", "stop", 5, 2))  # a later delta without the flag keeps it
    assert IngressService.usage_of({0: first}, 1)["alora_activated"] is True
    mixed = {0: first, 1: ChoiceDelta(1, "c", "stop", 4, 1, alora_activated=False)}
    assert IngressService.usage_of(mixed, 1)["alora_activated"] is False
    assert "alora_activated" not in IngressService.usage_of({0: ChoiceDelta(0, "d", "stop", 3, 1)}, 1)
