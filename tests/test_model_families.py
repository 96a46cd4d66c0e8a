"""Every served family against transformers + PEFT, fp32 greedy tokens identical: Qwen3 (q/k norms, explicit
head_dim, tied and untied), Gemma 3 (sandwich norms, interleaved sliding/global layers with prompts longer than
the window, two RoPE bases, soft-capping, scaled embeddings), Phi-3 / Phi-4-mini (fused checkpoints and fused
PEFT targets, partial rotary, LongRoPE on both sides of its switch). Base and adapters mixed in one batch."""

from __future__ import annotations

import json
import random

import pytest

from app.config.model_config import ModelConfig
from loraland import LLMKernel
from tests.fixtures.adapters import make_peft_adapter, peft_model_with
from tests.fixtures.family_models import FAMILY_MODELS, build_family_model
from tests.hf_oracle import hf_greedy

MAX_NEW = 8
SEPARATE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's module names


def _adapters(kind, model_dir, root):
    targets = FUSED if kind.startswith("phi3") else SEPARATE
    return {
        "all-r8": make_peft_adapter(
            model_dir, root / "all-r8", r=8, alpha=16, target_modules=targets, seed=1
        ),
        "attn-r4-rs": make_peft_adapter(
            model_dir, root / "attn-r4-rs", r=4, alpha=8, target_modules=targets[:2], use_rslora=True, seed=2
        ),
        "mlp-r16": make_peft_adapter(
            model_dir, root / "mlp-r16", r=16, alpha=8, target_modules=targets[-2:], seed=3
        ),
    }


def _prompts(tok, n, lo, hi, seed=0):
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world ray serve adapters blocks paged".split()
    out = []
    for _ in range(n):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(hi)), add_special_tokens=False)
        out.append(ids[: rng.randint(lo, hi)])
    return out


@pytest.fixture(scope="module", params=list(FAMILY_MODELS))
def family(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = build_family_model(root / "model", kind)
    adapters = _adapters(kind, model_dir, root)
    peft = peft_model_with(model_dir, adapters)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(model_dir)
    # Gemma 3's window is 6 and Phi's LongRoPE switches at 24: prompts from 2 to 30 tokens cross both
    prompts = _prompts(tok, 15, 2, 30)
    names = list(adapters)
    ids = [None if i % 4 == 0 else names[i % len(names)] for i in range(len(prompts))]
    refs = [hf_greedy(peft, p, MAX_NEW, adapter_names=[a or "__base__"]) for p, a in zip(prompts, ids)]
    return kind, model_dir, adapters, prompts, ids, refs


def test_config_is_read_as_the_family(family):
    kind, model_dir, *_ = family
    mc = ModelConfig.from_folder(model_dir)
    assert mc.family == kind.split("-")[0]
    if kind == "gemma3":
        assert mc.layer_windows == (6, 6, None, 6) and mc.local_rope_theta == 10000.0
        assert mc.final_logit_softcap == 30.0 and mc.embed_scale == 8.0
    if kind == "phi3":
        assert mc.partial_rotary_factor == 0.75 and mc.rope_scaling["rope_type"] == "longrope"


def test_mixed_batch_matches_transformers_and_peft(family):
    kind, model_dir, adapters, prompts, ids, refs = family
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=256, max_adapters=8) as k:
        for name, path in adapters.items():
            k.load_adapter(name, path)
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == refs
    base = {tuple(r) for r, a in zip(refs, ids) if a is None}
    assert any(tuple(r) not in base for r, a in zip(refs, ids) if a is not None)  # the adapters do something


def test_chunked_prefill_prefix_cache_and_preemption_keep_the_tokens(family):
    """Small blocks, a small token budget (prompts prefilled in chunks), few blocks (preemption by recompute),
    then the same prompts again (prefix-cache hits): the tokens do not move."""
    kind, model_dir, adapters, prompts, ids, refs = family
    with LLMKernel(
        model_dir, dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=16, max_adapters=8
    ) as k:
        for name, path in adapters.items():
            k.load_adapter(name, path)
        first = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
        again = k.complete(prompts[:4], ids[:4], max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in first] == refs
    assert [o.token_ids for o in again] == refs[:4]


def test_an_unserved_architecture_or_rope_type_is_refused_by_name(tmp_path):
    cfg = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1}  # fmt: skip
    with pytest.raises(ValueError, match="Gemma3ForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dict(cfg)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="'yarn'.*longrope"):
        ModelConfig.from_dict(cfg)
    cfg["rope_scaling"] = None
    cfg["layer_types"] = ["chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelConfig.from_dict(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"layer_types": None}))
