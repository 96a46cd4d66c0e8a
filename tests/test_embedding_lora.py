"""LoRA on embed_tokens/lm_head and modules_to_save copies of them (issue 19): read as PEFT saves them, batched
per token beside plain LoRA adapters and the base model, greedy tokens identical to HF+PEFT in fp32 (each row
equal to its adapter's single-request PEFT output), the size limit on full copies, copies counted in resident
bytes, and what stays refused (merges, DoRA on them, tied adapter weights) with a message naming why."""

from __future__ import annotations

import json

import pytest
import torch
from loraland_kernels import lora as K
from loraland_kernels import reference as R
from safetensors.torch import load_file, save_file

from app.config.kernel_config import KernelConfig
from app.config.model_config import ModelConfig
from app.errors import InvalidAdapter, InvalidRequest
from app.replica.lora.checks import check_adapter
from app.replica.lora.dora import BaseWeights
from app.replica.lora.manager import AdapterManager
from app.replica.lora.merge import merge_adapters
from app.replica.lora.peft_format import adapter_summary, read_adapter
from app.replica.lora.vocab import with_vocab_copies
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams
from tests.fixtures.adapters import SPECS_BY_NAME, make_peft_adapter
from tests.fixtures.vocab_adapters import VOCAB_SPECS, make_vocab_set, peft_single_requests

MAX_NEW = 6
TRAINED = "emb-trained"  # LoRA on embed_tokens whose saved base_layer weight differs from the base's


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-tied"])  # qwen2-tied: tie_word_embeddings
def case(request, tiny_models, tmp_path_factory):
    model_dir = tiny_models[request.param]
    root = tmp_path_factory.mktemp(f"vocab-{request.param}")
    adapters = make_vocab_set(model_dir, root)
    adapters["qv-r2"] = make_peft_adapter(model_dir, root / "qv-r2", **SPECS_BY_NAME["qv-r2"].kwargs())
    # save_embedding_layers wrote the base embedding beside the LoRA: change it, as a retrained embedding would
    trained = root / TRAINED
    trained.mkdir()
    (trained / "adapter_config.json").write_text((adapters["emb-r4"] / "adapter_config.json").read_text())
    t = load_file(adapters["emb-r4"] / "adapter_model.safetensors")
    key = next(k for k in t if k.endswith("embed_tokens.base_layer.weight"))
    t[key] = t[key] + 0.05 * torch.randn(t[key].shape, generator=torch.Generator().manual_seed(5))
    save_file(t, trained / "adapter_model.safetensors")
    adapters[TRAINED] = trained
    return model_dir, adapters


def _manager(mc, base, **kw) -> AdapterManager:
    return AdapterManager(
        mc, max_adapters=8, max_cpu_adapters=None, dtype=torch.float32, device=torch.device("cpu"),
        base_weights=base, **kw,
    )  # fmt: skip


def test_read_as_peft_saves(case):
    model_dir, adapters = case
    mc = ModelConfig.from_folder(model_dir)
    V, H = mc.vocab_size, mc.hidden_size
    for spec in VOCAB_SPECS:
        folder = adapters[spec.name]
        lw = read_adapter(folder, mc)
        saved = load_file(folder / "adapter_model.safetensors")
        lora = {m for m in spec.target_modules if m in ("embed_tokens", "lm_head")}
        assert set(lw.vocab_tensors) == lora and set(lw.vocab_copies) == set(spec.modules_to_save)
        assert set(lw.base_layers) == lora  # PEFT's save_embedding_layers, on by default with such targets
        for m, (a, b) in lw.vocab_tensors.items():
            want = ("lora_embedding_A", "lora_embedding_B") if m == "embed_tokens" else ("lora_A", "lora_B")
            ka = next(k for k in saved if f"{m}.{want[0]}" in k)
            kb = next(k for k in saved if f"{m}.{want[1]}" in k)
            assert torch.equal(a, saved[ka]) and torch.equal(b, saved[kb])
            assert a.shape == ((spec.r, V) if m == "embed_tokens" else (spec.r, H))
        for m, w in lw.vocab_copies.items():
            assert w.shape == (V, H) and torch.equal(
                w, saved[next(k for k in saved if k.endswith(f"{m}.weight"))]
            )
        assert lw.nbytes() == 4 * (
            sum(a.numel() + b.numel() for a, b in [*lw.tensors.values(), *lw.vocab_tensors.values()])
            + sum(w.numel() for w in [*lw.vocab_copies.values(), *lw.base_layers.values()])
        )
        check_adapter(folder, max_rank=64)  # the registration checks accept what PEFT saved
        assert lora <= set(adapter_summary(folder)["target_modules"])


def test_saved_base_layers_resolved_against_the_base(case):
    """A saved base weight equal to the served one is dropped (no copy, nothing resident); one that differs is
    the adapter's own copy, as PEFT's load (into the base model) makes it."""
    model_dir, adapters = case
    mc, base = ModelConfig.from_folder(model_dir), BaseWeights(model_dir)
    same = with_vocab_copies(read_adapter(adapters["emb-r4"], mc), base, max_bytes=0, dtype=torch.float32)
    assert same.base_layers == {} and same.vocab_copies == {}
    lw = read_adapter(adapters[TRAINED], mc)
    tied = mc.tie_word_embeddings
    trained = with_vocab_copies(lw, base, max_bytes=None, dtype=torch.float32, tied=tied)
    # tied: PEFT loads the saved weight into the parameter embed_tokens and lm_head share, so both change
    assert set(trained.vocab_copies) == ({"embed_tokens", "lm_head"} if tied else {"embed_tokens"})
    assert trained.base_layers == {}
    for w in trained.vocab_copies.values():
        assert torch.equal(w, lw.base_layers["embed_tokens"])
    with pytest.raises(InvalidAdapter, match="max_saved_module_bytes"):
        with_vocab_copies(lw, base, max_bytes=0, dtype=torch.float32)


def test_shrink_embedding_matches_reference():
    gen = torch.Generator().manual_seed(0)
    S, V, r = 5, 37, 3
    A = torch.randn(S, V, r, generator=gen)
    for slots in ([-1, -1, 0, 0, 2, 4, 4, 4], [1], [3, 3, 3], [-1, 0]):
        sid = torch.tensor(slots)
        ids = torch.randint(0, V, (len(slots),), generator=gen)
        got = K.shrink_embedding(ids, A, K.build_segments(sid, S))
        torch.testing.assert_close(got, R.shrink_embedding_ref(ids, A, sid), atol=0, rtol=0)


@pytest.mark.parametrize("prompt_logprobs", [None, 2])  # 2: prompt rows after the sampled ones (not sorted)
def test_mixed_batch_matches_peft(case, prompt_logprobs):
    """embed_tokens LoRA, lm_head LoRA (with q/v), both (rslora), modules_to_save of lm_head and of
    embed_tokens, a trained saved embedding, a plain q/v adapter and the base model, all in one batch."""
    from loraland import LLMKernel

    model_dir, adapters = case
    tok = __import__("transformers").AutoTokenizer.from_pretrained(model_dir)
    words = "the quick brown fox jumps over lazy dog hello world ray serve adapters blocks".split()
    gen = torch.Generator().manual_seed(1)
    names = [*adapters, None]
    prompts, ids = [], []
    for i in range(2 * len(names)):
        n = int(torch.randint(2, 14, (1,), generator=gen))
        text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=gen))
        prompts.append(tok.encode(text, add_special_tokens=False))
        ids.append(names[i % len(names)])
    refs = peft_single_requests(model_dir, adapters, list(zip(prompts, ids)), MAX_NEW)
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=128, max_adapters=8) as k:
        for name, path in adapters.items():
            k.load_adapter(name, path)
        extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True, **extra)
        sigs = [p.signature for p in k.adapter_manager.pools.values()]
    assert {m for s in sigs for m, _ in s.vocab} == {"embed_tokens", "lm_head"}
    assert {m for s in sigs for m in s.copies} == {"embed_tokens", "lm_head"}
    assert [o.token_ids for o in outs] == refs
    base = [r for r, a in zip(refs, ids) if a is None]
    for name in adapters:  # every adapter changes what the base model says
        assert any(r not in base for r, a in zip(refs, ids) if a == name), name


def test_prompt_logprobs_of_lm_head_adapters_match_peft(case):
    """Prompt positions' logits rows come after the sampled ones: each takes its own adapter's lm_head."""
    from peft import PeftModel

    from loraland import LLMKernel
    from tests.hf_oracle import load_hf

    model_dir, adapters = case
    names = ["head-r8-qv", "save-head", "emb-head-rs"]
    prompt = [5, 9, 17, 33, 2, 70, 11]
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=64, max_adapters=8) as k:
        for n in names:
            k.load_adapter(n, adapters[n])
        outs = k.complete([prompt] * 3, names, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    for name, c in zip(names, outs):
        peft = PeftModel.from_pretrained(load_hf(model_dir), adapters[name]).eval()
        with torch.no_grad():
            ref = torch.log_softmax(peft(torch.tensor([prompt])).logits[0, :-1].float(), -1)
        for j, s in enumerate(c.prompt_logprobs[1:]):
            assert abs(s.logprob - ref[j, prompt[j + 1]].item()) < 1e-4, (name, j)


def test_head_rows_in_any_order(case):
    """LoraBatch.head on rows in a scrambled order equals each row's own lm_head: LoRA or copy or base."""
    model_dir, adapters = case
    mc, base = ModelConfig.from_folder(model_dir), BaseWeights(model_dir)
    m = _manager(mc, base)
    try:
        names = ["head-r8-qv", "save-head", "emb-head-rs", "qv-r2"]
        lws = {}
        for n in names:
            lw = read_adapter(adapters[n], mc, name=n)
            lws[n] = m.register(n, 1, lambda lw=lw: lw, lw).weights
        order = [None, *names, "save-head"]
        seqs = [Sequence(i, [1], SamplingParams(), adapter=n and f"{n}@1") for i, n in enumerate(order)]
        assert all(m.admit(s) for s in seqs)
        seqs.sort(key=m.sort_key)
        counts = [2, 1, 3, 2, 1, 2]
        batch = m.lora_batch(list(zip(seqs, counts)))
        owner = [s.adapter and s.adapter.split("@")[0] for s, n in zip(seqs, counts) for _ in range(n)]
        rows = torch.tensor([9, 0, 4, 2, 10, 5, 7, 1, 3])
        x = torch.randn(len(rows), mc.hidden_size, generator=torch.Generator().manual_seed(0))
        W = base.vocab_weight("lm_head")
        logits = x @ W.T
        batch.head(rows, x, logits)
        for i, t in enumerate(rows.tolist()):
            lw, want = lws.get(owner[t]), x[i] @ W.T
            if lw is not None and "lm_head" in lw.vocab_copies:
                want = x[i] @ lw.vocab_copies["lm_head"].T
            if lw is not None and "lm_head" in lw.vocab_tensors:
                a, b = lw.vocab_tensors["lm_head"]
                want = want + lw.scale * (b @ (a @ x[i]))
            torch.testing.assert_close(logits[i], want, atol=1e-5, rtol=1e-5)
    finally:
        m.close()


def test_size_limit_and_resident_bytes(case):
    """A full copy above max_saved_module_bytes is refused, naming the limit and the option; under it, the
    copy is counted in the adapter's resident bytes."""
    from loraland import LLMKernel

    model_dir, adapters = case
    mc = ModelConfig.from_folder(model_dir)
    copy_bytes = mc.vocab_size * mc.hidden_size * 4
    assert KernelConfig().max_saved_module_bytes >= 1 << 30
    with pytest.raises(ValueError, match="max_saved_module_bytes"):
        KernelConfig(max_saved_module_bytes=-1)
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=32, max_adapters=4,
                   max_saved_module_bytes=copy_bytes - 1) as k:  # fmt: skip
        for name in ("save-head", "save-emb", TRAINED):
            with pytest.raises(InvalidAdapter) as e:
                k.load_adapter(name, adapters[name])
            copies = 2 if name == TRAINED and mc.tie_word_embeddings else 1
            assert f"{copy_bytes - 1}-byte limit (max_saved_module_bytes)" in str(e.value)
            assert f"{copies * copy_bytes} bytes" in str(e.value)
        k.load_adapter("emb-r4", adapters["emb-r4"])  # its saved base weight is the base's: no copy
    base = BaseWeights(model_dir)
    m = _manager(mc, base, max_saved_module_bytes=copy_bytes)
    try:
        for n in ("save-head", "qv-r2"):
            lw = read_adapter(adapters[n], mc, name=n)
            m.register(n, 1, lambda lw=lw: lw, lw)
        seqs = [
            Sequence(i, [1], SamplingParams(), adapter=f"{n}@1") for i, n in enumerate(["save-head", "qv-r2"])
        ]
        assert all(m.admit(s) for s in seqs)
        per = {n: m.entries[f"{n}@1"].slot[0].nbytes_per_slot() for n in ("save-head", "qv-r2")}
        lw = m.entries["save-head@1"].weights
        lora = 4 * sum(a.numel() + b.numel() for a, b in lw.tensors.values())
        assert per["save-head"] == lora + copy_bytes
        assert lw.nbytes() == lora + copy_bytes
        assert m.resident_bytes()[1] == per["save-head"] + per["qv-r2"]
        pool, slot = m.entries["save-head@1"].slot
        assert torch.equal(pool.copies["lm_head"][slot], lw.vocab_copies["lm_head"])
    finally:
        m.close()


def test_merges_refuse_them(case):
    model_dir, adapters = case
    mc = ModelConfig.from_folder(model_dir)
    plain = read_adapter(adapters["qv-r2"], mc)
    for n in ("emb-r4", "head-r8-qv", "save-head"):
        with pytest.raises(
            InvalidRequest, match="embed_tokens/lm_head.*merging such adapters is not supported"
        ):
            merge_adapters([(plain, 0.5), (read_adapter(adapters[n], mc), 0.5)], "m")


def _edited(src, dst, **changes):
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize(
    "src, changes, words",
    [
        ("save-head", {"modules_to_save": ["lm_head", "q_proj"]}, "modules_to_save entry 'q_proj'"),
        ("save-head", {"modules_to_save": ["score"]}, "modules_to_save entry 'score'"),
        ("emb-r4", {"use_dora": True}, "DoRA"),
        ("save-head", {"target_modules": ["q_proj", "v_proj", "lm_head"]}, "lm_head"),
        ("head-r8-qv", {"layers_to_transform": [0]}, "layers_to_transform"),
    ],
)
def test_still_refused_by_field(case, tmp_path, src, changes, words):
    """What stays unsupported is refused with a message naming the field."""
    model_dir, adapters = case
    folder = _edited(adapters[src], tmp_path / "bad", **changes)
    with pytest.raises(InvalidAdapter) as e:
        read_adapter(folder, ModelConfig.from_folder(model_dir))
    assert words in str(e.value)


def test_chains_run_them_and_merges_refuse_through_the_kernel(case):
    """A chain is stages of whole adapters: supported as is. A merge of one is refused with the reason."""
    from loraland import LLMKernel

    model_dir, adapters = case
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=64, max_adapters=4) as k:
        for n in ("emb-r4", "save-head", "qv-r2"):
            k.load_adapter(n, adapters[n])
        texts = ["the quick brown fox", "hello world ray serve"]
        chained = k.infer(texts, ["emb-r4|save-head"] * 2, max_tokens=MAX_NEW, ignore_eos=True)
        first = k.infer(texts, ["emb-r4"] * 2, max_tokens=MAX_NEW, ignore_eos=True)
        assert chained == k.infer(first, ["save-head"] * 2, max_tokens=MAX_NEW, ignore_eos=True)
        with pytest.raises(InvalidRequest, match="merging such adapters is not supported"):
            k.infer(texts[:1], ["qv-r2*0.5+save-head*0.5"], max_tokens=2)


def test_tied_adapter_weights_refused(case, tmp_path):
    """ensure_weight_tying matters only when the base ties its embeddings: refused there, by name."""
    model_dir, adapters = case
    mc = ModelConfig.from_folder(model_dir)
    folder = _edited(adapters["emb-r4"], tmp_path / "tying", ensure_weight_tying=True)
    if not mc.tie_word_embeddings:
        assert set(read_adapter(folder, mc).vocab_tensors) == {"embed_tokens"}
        return
    with pytest.raises(InvalidAdapter, match="ensure_weight_tying=true"):
        read_adapter(folder, mc)
