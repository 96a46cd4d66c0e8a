"""Mixtral and OLMoE against transformers (+ PEFT), fp32 greedy tokens identical, and router LoRA on every MoE
family: base and adapters of ranks 2 to 8 (attention LoRA, expert LoRA through target_parameters, router LoRA
through PEFT's `gate` -> `gate.weight` conversion, all of them at once) mixed in one batch whose tokens reach
every expert of every layer. Tiny random configs built with transformers' own classes (tests/fixtures)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from app.config.model_config import ATTN_MODULES, ModelConfig
from app.errors import InvalidRequest
from app.replica.lora.peft_format import read_adapter
from loraland import LLMKernel
from tests.fixtures.adapters import make_peft_adapter
from tests.fixtures.moe_models import MOE_MODELS, build_moe_model, make_expert_adapter, random_sparse_block
from tests.hf_oracle import hf_greedy

MAX_NEW = 8
ATTN = list(ATTN_MODULES)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# each family's names for its experts' projections in target_modules (PEFT converts them to target_parameters)
MLP_NAMES = {"mixtral": ["w1", "w2", "w3"], "olmoe": ["gate_proj", "up_proj", "down_proj"]}
SPARSE = {"mixtral": [0, 1], "olmoe": [0, 1], "qwen3-moe": [0, 2]}


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _adapters(kind, model_dir, root):
    """attention LoRA r8; experts r4 (target_parameters); router r2 (target_modules 'gate', as PEFT converts it);
    q/v + experts + router r6 (PEFT's own conversion of the MLP names, gate_up at r12 by its rank_pattern)."""
    out = {
        "attn-r8": make_peft_adapter(model_dir, root / "attn-r8", r=8, alpha=16, target_modules=ATTN, seed=1),
        "router-r2": make_expert_adapter(
            model_dir, root / "router-r2", r=2, alpha=4, target_modules=["gate"], seed=3, std=0.5
        ),
    }
    if kind != "qwen3-moe":
        out["ex-r4"] = make_expert_adapter(
            model_dir, root / "ex-r4", r=4, alpha=8, target_parameters=EXPERTS, seed=2, std=0.2
        )
        out["all-r6"] = make_expert_adapter(
            model_dir,
            root / "all-r6",
            r=6,
            alpha=6,
            target_modules=["q_proj", "v_proj", *MLP_NAMES[kind], "gate"],
            seed=4,
            std=0.1,
        )
    else:  # router LoRA beside expert LoRA on a model with a dense layer (layer 1)
        out["ex-router-r4"] = make_expert_adapter(
            model_dir,
            root / "ex-router-r4",
            r=4,
            alpha=8,
            target_parameters=[*EXPERTS, "mlp.gate.weight"],
            target_modules=["k_proj"],
            seed=5,
            std=0.2,
        )
    return out


@pytest.fixture(scope="module", params=["mixtral", "olmoe", "qwen3-moe"])
def family(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = build_moe_model(root / "model", kind)
    return kind, model_dir, _adapters(kind, model_dir, root)


def test_configs_are_read_as_their_families(family):
    kind, model_dir, _ = family
    mc = ModelConfig.from_folder(model_dir)
    want = {"mixtral": ("mixtral", 8, 2, 32, True), "olmoe": ("olmoe", 8, 3, 32, False)}
    want["qwen3-moe"] = ("qwen3_moe", 8, 2, 32, True)
    got = (mc.family, mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.norm_topk_prob)
    assert got == want[kind]
    assert [i for i, s in enumerate(mc.moe_layers) if s] == SPARSE[kind]
    assert mc.windows() == ((8, 8) if kind == "mixtral" else (None,) * mc.num_layers)
    assert mc.qk_norm == (kind != "mixtral")
    assert mc.linear_shapes()["gate"] == (64, 8)  # the router, for router LoRA


def test_base_and_adapters_mixed_match_transformers_and_peft(family):
    """Every adapter and the base in one batch (chunked prefill beside decodes, 4-token blocks): each prompt's
    greedy tokens equal transformers' (+ PEFT with that adapter alone: PEFT's ParamWrapper takes no mixed
    batches). The batch reaches every expert of every sparse layer; router LoRA changes the tokens."""
    import transformers
    from peft import PeftModel

    kind, model_dir, adapters = family
    names = list(adapters)
    ids = [None, *names, None]  # one prompt each (HF's generate is the slow part), the base twice
    prompts = _prompts(len(ids), 6, 24, 384)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base_refs = [
        hf_greedy(hf, p, MAX_NEW) for p in prompts
    ]  # also: what the adapters' prompts get without them
    refs = list(base_refs)
    for name in names:  # one PeftModel per adapter, each on a fresh base
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        peft = PeftModel.from_pretrained(base, adapters[name]).eval()
        for i in (i for i, a in enumerate(ids) if a == name):
            refs[i] = hf_greedy(peft, prompts[i], MAX_NEW)
    with LLMKernel(
        model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=24
    ) as k:
        seen = {li: torch.zeros(8, dtype=torch.long) for li in SPARSE[kind]}
        for li in SPARSE[kind]:
            k.model.layers[li].moe.on_route = lambda ex, li=li: seen[li].add_(
                torch.bincount(ex.flatten(), minlength=8)
            )
        for name, path in adapters.items():
            k.load_adapter(name, path)
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == refs
    for li, counts in seen.items():
        assert (counts > 0).all(), f"layer {li}: experts {counts.tolist()}"
    for name in names:  # every adapter, the router-only one too, changes the tokens
        assert any(refs[i] != base_refs[i] for i, a in enumerate(ids) if a == name), name


def test_router_lora_is_read_as_pefts_delta(family):
    """The router's LoRA as PEFT's ParamWrapper on mlp.gate.weight computes it (W + s * B A), on each sparse layer
    and no other; the model-free checks pass it; merges of it are refused (as for expert LoRA)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from app.replica.lora.checks import check_adapter
    from app.replica.lora.merge import merge_adapters

    kind, model_dir, adapters = family
    for path in adapters.values():  # the model-free checks (adapters validate) pass router keys too
        check_adapter(path, max_rank=16)
    mc = ModelConfig.from_folder(model_dir)
    lw = read_adapter(adapters["router-r2"], mc)
    assert sorted(lw.tensors) == [(li, "gate") for li in SPARSE[kind]]
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapters["router-r2"]
    )
    for li in SPARSE[kind]:
        want = peft.base_model.model.model.layers[li].mlp.gate.get_delta_weight("default")
        torch.testing.assert_close(lw.delta(li, "gate"), want.reshape(8, 64), rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidRequest, match="experts or router"):
        merge_adapters([(lw, 0.5), (read_adapter(adapters["attn-r8"], mc), 0.5)], "m")


def test_unsupported_variants_are_refused_by_name(tmp_path):
    """clip_qkv (OLMoE), Qwen2-MoE's shared expert and an unknown MoE architecture: refused at load, naming what is
    served."""
    _, _, cfg = MOE_MODELS["olmoe"]
    base = {"architectures": ["OlmoeForCausalLM"], "vocab_size": 384, **cfg}
    with pytest.raises(ValueError, match="clip_qkv=8.0 is not supported"):
        ModelConfig.from_dict(base | {"clip_qkv": 8.0})
    for arch in ("Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM"):
        with pytest.raises(ValueError, match=r"LoRA-Land serves .*'MixtralForCausalLM', 'OlmoeForCausalLM'"):
            ModelConfig.from_dict(base | {"architectures": [arch]})
    (tmp_path / "config.json").write_text(json.dumps(base | {"num_experts": 0}))
    with pytest.raises(ValueError, match="at least one expert"):
        ModelConfig.from_folder(tmp_path)


def test_olmoe_q_norm_spans_the_whole_projection():
    """OLMoE's q/k norms over [heads * head_dim] (one RMS per token), called as the forward calls a per-head
    norm; equal to transformers' OlmoeRMSNorm on q_proj's output, unlike a per-head norm."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from app.replica.models.norms import RMSNorm
    from app.replica.models.olmoe import WideNorm

    torch.manual_seed(0)
    hf = OlmoeRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
    q = torch.randn(5, 64) * torch.linspace(0.1, 3, 64)  # heads of different scales
    ours = WideNorm(hf.weight.data, 1e-5)
    got = ours(q.reshape(-1, 16)).view(5, 64)
    torch.testing.assert_close(got, hf(q), rtol=0, atol=1e-6)
    per_head = RMSNorm(hf.weight.data[:16], 1e-5)(q.reshape(-1, 16)).view(5, 64)
    assert not torch.allclose(per_head, hf(q), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37, 200])
def test_mixtral_routing_equals_transformers_sparse_block(tokens, dtype):
    """MoE with Mixtral's routing (renormalised, weights kept in fp32): the router's weights and experts equal to
    MixtralTopKRouter's in fp32 and bf16 (where keeping them in fp32 matters); the block bit-identical to
    MixtralSparseMoeBlock's eager experts loop in fp32. (In bf16 the block is not bit-identical for any family:
    one index_add_ over a token's k rows rounds once, transformers' k index_add_ calls round k times.)"""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from app.replica.models.moe import MIXTRAL, MoE

    cfg = MixtralConfig(hidden_size=48, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3)
    block, x, want = random_sparse_block(MixtralSparseMoeBlock, cfg, tokens, dtype)
    e = block.experts
    ours = MoE(block.gate.weight.data, e.gate_up_proj.data, e.down_proj.data, 3, MIXTRAL, "silu")
    _, hf_weights, hf_experts = block.gate(x[0])
    weights, experts = ours.route(x[0])
    assert (
        weights.dtype == torch.float32
        and torch.equal(weights, hf_weights)
        and torch.equal(experts, hf_experts)
    )
    if dtype == torch.float32:
        assert torch.equal(ours(x[0]), want)
    else:
        torch.testing.assert_close(ours(x[0]), want, rtol=0.02, atol=0.03)  # a few bf16 ulps
