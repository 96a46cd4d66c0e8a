"""Qwen3-MoE against transformers (+ PEFT), fp32 greedy tokens identical: the grouped experts (one GEMM pair per
expert) against transformers' own sparse block, base prompts that reach every expert, attention LoRA and LoRA on
the fused expert weights (PEFT target_parameters) mixed with base in one batch, and LoRA on the dense layers'
MLP, per-expert modules or other raw parameters refused by name (router LoRA: tests/test_moe_families.py)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from loraland_kernels import fused

from app.config.model_config import ATTN_MODULES, LORA_MODULES, ModelConfig
from app.errors import InvalidAdapter
from app.replica.lora import pools
from app.replica.lora.peft_format import read_adapter
from app.replica.models.moe import MoE
from loraland import LLMKernel
from tests.fixtures.adapters import make_peft_adapter, peft_model_with
from tests.fixtures.moe_models import build_moe_model, make_expert_adapter, random_sparse_block
from tests.hf_oracle import hf_greedy

MAX_NEW = 8
ATTN = list(ATTN_MODULES)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _prompts(tok, n, lo, hi, seed=0):
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world ray serve adapters blocks paged".split()
    out = []
    for _ in range(n):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(hi)), add_special_tokens=False)
        out.append(ids[: rng.randint(lo, hi)])
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("qwen3-moe")
    model_dir = build_moe_model(root / "model")
    adapters = {
        "attn-r8": make_peft_adapter(model_dir, root / "attn-r8", r=8, alpha=16, target_modules=ATTN, seed=1),
        "qv-r4-rs": make_peft_adapter(
            model_dir,
            root / "qv-r4-rs",
            r=4,
            alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
            seed=2,
            std=0.1,
        ),  # fmt: skip
        # LoRA on the experts: both fused weights, r=4; attention too at r=8 with both weights; only down_proj
        # with rslora at r=2; PEFT's own conversion of MLP targets (gate_up_proj at r=6 through rank_pattern)
        "ex-r4": make_expert_adapter(model_dir, root / "ex-r4", r=4, alpha=8, target_parameters=EXPERTS, seed=3),
        "ex-r4b": make_expert_adapter(model_dir, root / "ex-r4b", r=4, alpha=8, target_parameters=EXPERTS, seed=7),
        "ex-attn-r8": make_expert_adapter(
            model_dir, root / "ex-attn-r8", r=8, alpha=8, target_parameters=EXPERTS, target_modules=ATTN, seed=4,
            std=0.05,
        ),
        "ex-down-r2-rs": make_expert_adapter(
            model_dir, root / "ex-down-r2-rs", r=2, alpha=4, target_parameters=["down_proj"], use_rslora=True, seed=5,
            std=0.2,
        ),
        "ex-mlp-r3": make_expert_adapter(
            model_dir, root / "ex-mlp-r3", r=3, alpha=6, target_modules=["gate_proj", "up_proj", "down_proj"], seed=6,
        ),
    }  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tok, 12, 2, 30)
    return root, model_dir, adapters, prompts


@pytest.mark.parametrize("tokens", [1, 3, 37, 200])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_grouped_experts_equal_transformers_sparse_block(tokens, norm_topk):
    """Bit-identical to Qwen3MoeSparseMoeBlock (eager experts loop) in fp32, top-3 of 8 so the order of the
    per-token sum matters, with experts that get no token at small sizes."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=48,
        moe_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk,
    )
    block, x, want = random_sparse_block(Qwen3MoeSparseMoeBlock, cfg, tokens)
    e = block.experts
    ours = MoE(block.gate.weight.data, e.gate_up_proj.data, e.down_proj.data, 3, norm_topk, "silu")
    assert torch.equal(ours(x[0]), want)


@pytest.mark.parametrize(
    "kernels, kept",
    [(("onednn",), "onednn"), (("mkl",), "mkl"), (("aten",), "aten"), (("aten", "onednn"), "onednn")],
)
def test_prepacked_experts_follow_the_plain_ones(kernels, kept, monkeypatch):
    """Without the fused CPU ops, each expert's projections prepacked for the CPU GEMM kernels (the model's
    path): the plain (bit-exact) block's output to fp32 rounding, at decode-like sizes (a row or two per expert,
    experts with none) and prefill-like ones. One packing per expert: a plan that switches kernels keeps its
    kernel at DECODE_ROWS, and the dense experts stay resident only where aten reads them."""
    from app.replica.linear import PackedLinear, Plan
    from app.replica.models import moe as moe_mod
    from app.replica.models.moe import DECODE_ROWS

    monkeypatch.setattr(moe_mod.fused, "enabled", lambda device: False)

    E, H, Im = 8, 48, 40
    torch.manual_seed(0)
    router, gate_up, down = torch.randn(E, H), torch.randn(E, 2 * Im, H) * 0.3, torch.randn(E, H, Im) * 0.3
    plan = Plan((0, DECODE_ROWS)[: len(kernels)], kernels)
    plain = MoE(router, gate_up, down, 3, True, "silu")
    packed = MoE(router, gate_up, down, 3, True, "silu", lambda w, b: PackedLinear(w, b, plan))
    for tokens in (1, 2, 5, 300):
        x = torch.randn(tokens, H)
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    assert {tuple(lin.packed) for lin in packed.packed} == {(kept,)}
    assert len(packed.packed) == 2 * E
    assert [t.shape for t in packed.dense] == ([gate_up.shape, down.shape] if kept == "aten" else [])
    assert [id(t) for t in plain.tensors()] == [id(router), id(plain.dense[0]), id(plain.dense[1])]


needs_fused = pytest.mark.skipif(
    not fused.enabled(torch.device("cpu")), reason="the fused CPU ops are not built here (no compiler)"
)


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_matmul_is_each_experts_linear(dtype):
    """fused.expert_matmul: each span's rows times its expert's weights, as F.linear per expert in fp32 sums
    (fp32 to rounding; bf16 to one bf16 rounding), for row counts 1-9 (the op's 4-row tiles and their rest),
    experts with no rows, an inner size that is no multiple of the vector width, spans in any expert order."""
    torch.manual_seed(0)
    E, N, K = 6, 37, 53
    w = (torch.randn(E, N, K) * 0.2).to(dtype)
    counts = [3, 0, 9, 1, 4, 2]
    x = torch.randn(sum(counts), K).to(dtype)
    spans, s = [], 0
    for e, n in zip([5, 0, 2, 1, 3, 4], counts):
        spans.append((e, s, s + n))
        s += n
    out = fused.expert_matmul(x, w, torch.tensor(spans))
    want = torch.cat([F.linear(x[a:b].float(), w[e].float()) for e, a, b in spans])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), want, **tol)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.expert_matmul(x, w, torch.tensor([(E, 0, 1)]))


@needs_fused
@pytest.mark.parametrize(
    "dtype, wdtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
def test_expert_combine_is_mul_then_index_add_bit_for_bit(dtype, wdtype):
    """fused.expert_combine_: out[rows[p]] += ys[p] * ws[p] in pair order, rounded exactly as ys.mul_(ws) then
    index_add_ round (bf16 weights, and Mixtral's fp32 ones on bf16 rows), rows repeated in any order, a width
    that is no multiple of the vector width; ys is left as it was."""
    torch.manual_seed(1)
    T, P, H = 7, 23, 301
    out = torch.randn(T, H).to(dtype)
    ys, ws = torch.randn(P, H).to(dtype), torch.rand(P).to(wdtype)
    rows = torch.randint(0, T, (P,))
    want = out.clone().index_add_(0, rows, ys.clone().mul_(ws[:, None]))
    before = ys.clone()
    fused.expert_combine_(out, ys, ws, rows)
    assert torch.equal(out, want) and torch.equal(ys, before)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.expert_combine_(out, ys, ws, torch.full((P,), T))


@needs_fused
def test_fused_experts_follow_the_plain_ones():
    """The model's path with the fused CPU ops: dense experts (no packing), a decode step's projections in one
    op each, prefill per expert by aten; the plain block's output to fp32 rounding at decode and prefill sizes."""
    from app.replica.linear import PackedLinear, Plan

    router, gate_up, down = _block()
    plain = MoE(router, gate_up, down, 3, True, "silu")
    ours = MoE(router, gate_up, down, 3, True, "silu", lambda w, b: PackedLinear(w, b, Plan((0,), ("onednn",))))
    assert ours.fused and not ours.packed and [id(t) for t in ours.tensors()] == [id(t) for t in plain.tensors()]
    for tokens in (1, 2, 5, 40, 300):
        x = torch.randn(tokens, 48)
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-5)


def _block(E=8, H=48, Im=24, seed=0):
    torch.manual_seed(seed)
    return torch.randn(E, H), torch.randn(E, 2 * Im, H) * 0.3, torch.randn(E, H, Im) * 0.3


@pytest.mark.parametrize("max_pairs", [1, 20, 100])
def test_chunked_pairs_sum_as_one_pass(max_pairs, monkeypatch):
    """A prefill's pairs cut into chunks of consecutive experts (one expert past the bound runs alone): the same
    adds in the same order as one pass, bit for bit, with and without a LoRA hook on the experts; the hook sees
    every pair once per projection."""
    from app.replica.models import moe as moe_mod

    router, gate_up, down = _block()
    x = torch.randn(200, 48)
    whole = MoE(router, gate_up, down, 3, True, "silu")
    want = whole(x)
    rank = 3
    A = {w: torch.randn(8, n_in, rank) * 0.2 for w, n_in in (("gate_up", 48), ("down", 24))}
    B = {w: torch.randn(8, rank, n_out) * 0.2 for w, n_out in (("gate_up", 48), ("down", 48))}

    class Hook:  # every token on one adapter; pair i's delta x_i A_e B_e, row by row
        def __init__(self):
            self.seen = {"gate_up": [], "down": []}

        def apply(self, layer, group, x, out):  # the router: no LoRA here
            assert group == "router"

        def apply_experts(self, layer, which, x_pairs, pair_expert, pair_token, out_pairs):
            self.seen[which].append(pair_token.clone())
            for i in range(x_pairs.shape[0]):
                e = int(pair_expert[i])
                out_pairs[i] += x_pairs[i] @ A[which][e] @ B[which][e]

    one = Hook()
    want_lora = whole(x, one)
    monkeypatch.setattr(moe_mod, "CHUNK_BYTES", max_pairs * 48 * 4)
    assert torch.equal(whole(x), want)
    many = Hook()
    assert torch.equal(whole(x, many), want_lora)
    assert len(one.seen["down"]) == 1 and len(many.seen["down"]) > 1
    for which in ("gate_up", "down"):
        assert torch.equal(torch.cat(many.seen[which]), one.seen[which][0])
    assert not torch.equal(want_lora, want)


@pytest.mark.parametrize(
    "gather_bytes, fused_op",
    [(16 << 20, True), (16 << 20, False), (0, True), (0, False)],
    ids=["fused segment op", "batched matmuls", "kernels, fused op", "kernels, gather"],
)
@pytest.mark.parametrize("layout", ["one pool, every token", "base tokens and two pools"])
def test_apply_experts_matches_per_pair_deltas(layout, gather_bytes, fused_op, monkeypatch):
    """apply_experts against each pair's own x A_{a,e} B_{a,e}, on every path (few pairs: the fused segment op
    over each (adapter, expert) run, or the factors gathered per pair without the fused ops; many: the kernels'
    shrink and expand over virtual-slot segments, by the fused op or the gather): pairs sorted by expert then token, a pool's tokens in slot order; in
    place when one plan holds every pair, gathered and added back otherwise; the expert-major slots keep their
    contents when the pool grows."""
    import types

    from loraland_kernels import fused
    from loraland_kernels import lora as K

    if fused_op and not fused.enabled(torch.device("cpu")):
        pytest.skip("the fused CPU ops are not built here (no compiler)")
    if not fused_op:
        monkeypatch.setattr(fused, "enabled", lambda device: False)

    from app.replica.lora import experts as experts_mod
    from app.replica.lora.experts import ExpertWeights, apply_experts

    monkeypatch.setattr(experts_mod, "GATHER_BYTES", gather_bytes)
    E, H, r, T, k = 4, 16, 3, 12, 2
    torch.manual_seed(0)
    pools_, factors = [], {}
    for index in range(2):
        w = ExpertWeights(1, E, H, r, H, torch.float32, "cpu")
        for slot in range(3):
            if slot:
                w.grow(slot + 1)
            a, b = torch.randn(E, H, r), torch.randn(E, r, H)
            w.install(slot, a, b)
            factors[(index, slot)] = (a, b)
        pools_.append(types.SimpleNamespace(index=index, expert_groups={(0, "down"): w}))
    if layout == "one pool, every token":
        token_slot = [0] * 5 + [1] * 4 + [2] * 3
        plans = [(pools_[0], 0, T, K.build_segments(torch.tensor(token_slot), 3))]
        adapter = [(0, s) for s in token_slot]
    else:  # tokens 0-2 base, 3-7 pool 0 (slots 1, 2), 8-11 pool 1 (slot 0, then a leading -1 in its plan)
        plans = [
            (pools_[0], 3, 8, K.build_segments(torch.tensor([1, 1, 2, 2, 2]), 3)),
            (pools_[1], 8, 12, K.build_segments(torch.tensor([-1, 0, 0, 0]), 3)),
        ]
        adapter = [None] * 3 + [(0, 1)] * 2 + [(0, 2)] * 3 + [None] + [(1, 0)] * 3
    experts = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    pair_token, pair_expert = order // k, flat.index_select(0, order)
    x = torch.randn(T * k, H)
    out = torch.randn(T * k, H)
    want = out.clone()
    for i in range(T * k):
        if adapter[int(pair_token[i])] is not None:
            a, b = factors[adapter[int(pair_token[i])]]
            e = int(pair_expert[i])
            want[i] += x[i] @ a[e] @ b[e]
    cache: dict = {}
    apply_experts(plans, cache, 0, "down", x, pair_expert, pair_token, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    in_place = [sel is None for _, sel, *_ in cache.values()]
    assert in_place == ([True] if layout == "one pool, every token" else [False, False])


def test_config_is_read_as_qwen3_moe(moe):
    _, model_dir, *_ = moe
    mc = ModelConfig.from_folder(model_dir)
    assert (mc.family, mc.num_experts, mc.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert mc.moe_intermediate_size == 32 and mc.norm_topk_prob and mc.qk_norm
    assert mc.moe_layers == (True, False, True)  # layer 1 is in mlp_only_layers
    assert mc.lora_modules(0) == mc.lora_modules(2) == ATTN_MODULES  # sparse: the experts by target_parameters
    assert mc.lora_modules(1) == LORA_MODULES  # the dense layer's gate/up/down_proj too


def test_base_tokens_match_transformers_and_reach_every_expert(moe):
    _, model_dir, _, prompts = moe
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=256) as k:
        seen: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(k.model.layers):
            if layer.moe is not None:
                seen[li] = torch.zeros(layer.moe.num_experts, dtype=torch.long)
                layer.moe.on_route = lambda ex, li=li: seen[li].add_(
                    torch.bincount(ex.flatten(), minlength=8)
                )
        outs = k.complete(prompts, [None] * len(prompts), max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == refs
    assert sorted(seen) == [0, 2]
    for li, counts in seen.items():
        assert (counts > 0).all(), f"layer {li}: experts {counts.tolist()}"


def test_attention_lora_mixed_with_base_matches_peft(moe):
    _, model_dir, adapters, prompts = moe
    adapters = {n: adapters[n] for n in ("attn-r8", "qv-r4-rs")}
    peft = peft_model_with(model_dir, adapters)
    names = list(adapters)
    ids = [None if i % 3 == 0 else names[i % 2] for i in range(len(prompts))]
    refs = [hf_greedy(peft, p, MAX_NEW, adapter_names=[a or "__base__"]) for p, a in zip(prompts, ids)]
    with LLMKernel(
        model_dir, dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=16
    ) as k:
        for name, path in adapters.items():
            k.load_adapter(name, path)
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == refs
    base = {tuple(r) for r, a in zip(refs, ids) if a is None}
    assert any(tuple(r) not in base for r, a in zip(refs, ids) if a is not None)  # the adapters do something


def test_expert_lora_mixed_with_base_matches_peft_and_reaches_every_expert(moe, monkeypatch):
    """Five adapters with LoRA on the experts (ranks 2 to 8, one with attention LoRA too, one on down_proj only,
    one with a rank_pattern, two sharing a pool) and the base model, mixed in every step's batch (chunked prefill beside decodes):
    greedy tokens equal transformers + PEFT's (one adapter per generate call there: PEFT's ParamWrapper takes no
    mixed batches, and folds its delta into the expert weights, W + s*B@A, where we add x A^T B^T to the
    unfolded GEMM: the same greedy tokens in fp32 on this model). Every expert of both sparse layers runs the
    LoRA of adapter tokens."""
    import transformers
    from peft import PeftModel

    from app.replica.lora import experts as experts_mod

    _, model_dir, adapters, prompts = moe
    names = ["ex-r4", "ex-attn-r8", "ex-down-r2-rs", "ex-mlp-r3", "ex-r4b"]  # ex-r4b: ex-r4's pool, slot 1
    ids = [None if i % 6 == 0 else names[i % 5] for i in range(len(prompts))]
    refs = []
    for p, a in zip(prompts, ids):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model = base if a is None else PeftModel.from_pretrained(base, adapters[a]).eval()
        refs.append(hf_greedy(model, p, MAX_NEW))
    reached: dict[tuple[int, str], set[int]] = {}
    slots: set[int] = set()  # adapter slots (within their pools) whose expert LoRA ran

    def spy(plans, cache, layer, which, *args):
        apply_experts(plans, cache, layer, which, *args)
        cap = {
            pool.index: g.cap
            for pool, *_ in plans
            for (lay, _), g in pool.expert_groups.items()
            if lay == layer
        }
        for (lay, i), (_, _, v, *_) in cache.items():
            if lay == layer:
                c = cap[plans[i][0].index]  # virtual slot e * cap + s: expert e of adapter slot s
                reached.setdefault((layer, which), set()).update((v // c).tolist())
                slots.update((v % c).tolist())

    apply_experts = pools.apply_experts
    monkeypatch.setattr(pools, "apply_experts", spy)
    # the batched matmuls over gathered factors (every call of this tiny model), then the grouped kernels
    for gather_bytes in (experts_mod.GATHER_BYTES, 0):
        monkeypatch.setattr(experts_mod, "GATHER_BYTES", gather_bytes)
        reached.clear()
        slots.clear()
        with LLMKernel(
            model_dir, dtype="float32", num_kv_blocks=48, block_size=4, max_num_batched_tokens=24
        ) as k:
            for name in names:
                k.load_adapter(name, adapters[name])
            outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
        assert [o.token_ids for o in outs] == refs
        assert {key: sorted(v) for key, v in reached.items()} == {
            (li, w): list(range(8)) for li in (0, 2) for w in ("gate_up", "down")
        }
        assert slots == {0, 1}  # virtual slots of the second adapter slot of a pool too
    base = {tuple(r) for r, a in zip(refs, ids) if a is None}
    assert all(tuple(r) not in base for r, a in zip(refs, ids) if a is not None)  # the adapters do something


def test_expert_lora_is_read_in_pefts_layout(moe):
    """Expert e's factors as PEFT's ParamWrapper computes its delta (get_delta_weight: W_e + s * B_e A_e)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from app.replica.lora.checks import check_adapter

    _, model_dir, adapters, _ = moe
    for name in ("ex-r4", "ex-attn-r8", "ex-down-r2-rs", "ex-mlp-r3"):  # the model-free checks pass them
        check_adapter(adapters[name], max_rank=16)
    with pytest.raises(InvalidAdapter, match="exceeds the maximum rank 4"):
        check_adapter(adapters["ex-attn-r8"], max_rank=4)
    mc = ModelConfig.from_folder(model_dir)
    lw = read_adapter(adapters["ex-mlp-r3"], mc)
    assert sorted(lw.expert_tensors) == [(0, "down"), (0, "gate_up"), (2, "down"), (2, "gate_up")]
    assert lw.expert_tensors[(0, "gate_up")][0].shape == (8, 64, 6)  # rank_pattern doubles gate_up_proj's
    assert lw.expert_tensors[(0, "down")][1].shape == (8, 3, 64)
    import peft as peft_pkg
    from packaging.version import Version

    if Version(peft_pkg.__version__) >= Version("0.22"):  # it adapts the dense layer's MLP (layer 1) too, at r
        assert sorted(lw.tensors) == [(1, "down_proj"), (1, "gate_proj"), (1, "up_proj")]
        assert lw.tensors[(1, "gate_proj")][0].shape[0] == 3
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapters["ex-mlp-r3"])
    wrapper = peft.base_model.model.model.layers[2].mlp.experts  # down_proj wraps gate_up_proj's wrapper
    for w, g in ((wrapper, "down"), (wrapper.base_layer, "gate_up")):
        a, b = lw.expert_tensors[(2, g)]
        want = w.get_delta_weight("default")  # [E, out, in]
        torch.testing.assert_close(torch.bmm(a, b).transpose(1, 2), want, rtol=1e-5, atol=1e-6)


def _edited(src, dst, **changes):
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(cfg | changes))
    return dst


def test_mlp_modules_and_other_parameters_are_refused_by_name(moe):
    """PEFT on transformers 5 turns gate/up/down_proj targets of a Qwen3-MoE into expert target_parameters (0.22
    keeps them in target_modules too, for the dense layers' MLP): a config naming the experts or the router as
    modules without that conversion (trained where experts were modules, transformers 4), or a raw parameter
    other than the experts' and the router's, is refused by name."""
    root, model_dir, adapters, _ = moe
    mc = ModelConfig.from_folder(model_dir)
    good = adapters["attn-r8"]
    cases = {
        # target_parameters on a norm, a dense layer's MLP weight: only the experts and the router are served
        "norm-param": (
            _edited(good, root / "norm-param", target_parameters=["input_layernorm.weight"]),
            r"'input_layernorm.weight' matches model\.layers\.0\.input_layernorm\.weight: LoRA on raw parameters "
            r"is served only on a mixture-of-experts model's experts .* and router \(mlp.gate.weight\)",
        ),
        "router-missing": (
            _edited(good, root / "router-missing", target_parameters=["mlp.gate.weight"]),
            r"no tensors for \[\(0, 'gate'\), \(2, 'gate'\)\] named by target_modules/target_parameters",
        ),
        "dense-param": (
            _edited(good, root / "dense-param", target_parameters=["mlp.experts.down_proj", "down_proj.weight"]),
            r"matches model\.layers\.1\.mlp\.down_proj\.weight: LoRA on raw parameters",
        ),
        "unknown-param": (
            _edited(good, root / "unknown-param", target_parameters=["mlp.experts.w13"]),
            "'mlp.experts.w13' matches no parameter of the base model",
        ),
        # the config names expert parameters the file has no tensors for
        "params-missing": (
            _edited(good, root / "params-missing", target_parameters=EXPERTS),
            r"no lora_A for layer 0's experts (down|gate_up): the file is incomplete",
        ),
        "expert-dora": (
            _edited(adapters["ex-r4"], root / "expert-dora", use_dora=True),
            "use_dora=true with target_parameters",
        ),
        # an adapter trained where experts were modules (transformers 4), or on the dense layer's MLP
        "mlp-modules": (
            _edited(good, root / "mlp-modules", target_modules=["q_proj", "down_proj"]),
            r"matches model\.layers\.0\.mlp\.experts\.0\.down_proj: LoRA on a mixture-of-experts model's experts "
            r"or router as modules .* through target_parameters",
        ),
        "router": (
            _edited(good, root / "router", target_modules=["q_proj", "gate"]),
            r"matches model\.layers\.0\.mlp\.gate: .*attention LoRA \(q_proj, k_proj, v_proj, o_proj\) and the dense "
            r"layers. MLP are served",
        ),
        "experts-regex": (
            _edited(good, root / "experts-regex", target_modules=r".*\.(q_proj|experts\.\d+\.up_proj)"),
            r"matches model\.layers\.0\.mlp\.experts\.0\.up_proj",
        ),
    }  # fmt: skip
    for folder, msg in cases.values():
        with pytest.raises(InvalidAdapter, match=msg):
            read_adapter(folder, mc)
    read_adapter(_edited(good, root / "excluded", target_modules=r".*proj", exclude_modules=r".*mlp.*"), mc)
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=32) as k:
        with pytest.raises(InvalidAdapter, match="served only on a mixture-of-experts model's experts"):
            k.load_adapter("norm-param", cases["norm-param"][0])


def test_fused_expert_weights_load_as_the_per_expert_ones(moe, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) saved as is
    reads to the same experts as the Hub's per-expert tensors."""
    from safetensors.torch import load_file, save_file

    from app.replica.models.decoder import Model

    _, model_dir, *_ = moe
    mc = ModelConfig.from_folder(model_dir)
    sd = load_file(model_dir / "model.safetensors")
    for i in (0, 2):
        x = f"model.layers.{i}.mlp.experts."
        gate_up = [
            torch.cat([sd.pop(f"{x}{e}.gate_proj.weight"), sd.pop(f"{x}{e}.up_proj.weight")])
            for e in range(8)
        ]
        sd[x + "gate_up_proj"] = torch.stack(gate_up)
        sd[x + "down_proj"] = torch.stack([sd.pop(f"{x}{e}.down_proj.weight") for e in range(8)])
    save_file(sd, tmp_path / "model.safetensors")
    cpu = torch.device("cpu")
    a = Model(model_dir, mc, torch.float32, cpu, gemm="aten")
    b = Model(tmp_path, mc, torch.float32, cpu, gemm="aten")
    for la, lb in zip(a.layers, b.layers):
        assert (la.moe is None) == (lb.moe is None)
        if la.moe is not None:
            assert all(torch.equal(p, q) for p, q in zip(la.moe.tensors(), lb.moe.tensors()))
    assert a.nbytes() == b.nbytes() > sum(t.numel() * 4 for t in a.layers[0].moe.tensors())
