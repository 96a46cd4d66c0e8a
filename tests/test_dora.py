"""DoRA adapters (PEFT use_dora=True) in the grouped LoRA path: read and refused as PEFT's files say, factors
equal to PEFT's m / ||W + delta||, pools that rescale only DoRA rows, and greedy tokens identical to HF+PEFT in
fp32 for batches mixing DoRA adapters (several ranks, with and without rslora) with plain LoRA and the base."""

from __future__ import annotations

import json
import re

import pytest
import torch
from loraland_kernels import reference as R

from app.config.model_config import ModelConfig
from app.errors import InvalidAdapter, InvalidRequest
from app.replica.lora.dora import BaseWeights, dora_scales, with_dora_scales
from app.replica.lora.manager import AdapterManager
from app.replica.lora.merge import merge_adapters
from app.replica.lora.peft_format import adapter_summary, read_adapter
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams
from tests.fixtures.adapters import SPECS_BY_NAME, make_peft_adapter, peft_model_with
from tests.fixtures.dora_adapters import DORA_SPECS, make_dora_set, peft_greedy_per_adapter

MAX_NEW = 6
PLAIN = ["qv-r2", "all-r4-rs"]  # plain LoRA adapters served beside the DoRA ones


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-tied"])  # qwen2: q/k/v biases (not rescaled)
def case(request, tiny_models, tmp_path_factory):
    model_dir = tiny_models[request.param]
    root = tmp_path_factory.mktemp(f"dora-{request.param}")
    adapters = make_dora_set(model_dir, root)
    for n in PLAIN:
        adapters[n] = make_peft_adapter(model_dir, root / n, **SPECS_BY_NAME[n].kwargs())
    return model_dir, adapters


def peft_dora_factors(peft_model, name: str) -> dict[tuple[int, str], torch.Tensor]:
    """PEFT's own m / ||W + s*B@A|| (its DoraLinearLayer's norm) for every module of adapter `name`."""
    out = {}
    for mname, mod in peft_model.named_modules():
        mags = getattr(mod, "lora_magnitude_vector", None)
        if mags is not None and name in mags:
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", mname)
            dora = mags[name]
            lora_w = dora.get_lora_weight(mod.lora_A[name], mod.lora_B[name])
            norm = dora.get_weight_norm(mod.get_base_layer().weight, lora_w, mod.scaling[name])
            out[(int(m[1]), m[2])] = (dora.weight / norm).detach()
    return out


def test_read_and_factors_match_peft(case):
    model_dir, adapters = case
    mc, base = ModelConfig.from_folder(model_dir), BaseWeights(model_dir)
    dora = {n: p for n, p in adapters.items() if n.startswith("dora")}
    peft = peft_model_with(model_dir, dora)
    for spec in DORA_SPECS:
        lw = read_adapter(dora[spec.name], mc)
        assert lw.is_dora and set(lw.magnitude) == set(lw.tensors) and lw.dora_scale is None
        assert lw.nbytes() == 4 * sum(a.numel() + b.numel() for a, b in lw.tensors.values()) + 4 * sum(
            m.numel() for m in lw.magnitude.values()
        )
        want = peft_dora_factors(peft, spec.name)
        got = dora_scales(lw, base)
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=f"{spec.name} {key}")
        assert any(float((f - 1).abs().max()) > 0.05 for f in got.values())  # far from a plain LoRA
    assert adapter_summary(dora["dora-qv-r2"])["use_dora"] is True
    assert adapter_summary(adapters["qv-r2"])["use_dora"] is False


def test_mixed_batch_matches_peft(case):
    """DoRA adapters of four ranks (two with rslora), plain LoRA adapters and the base model in one batch."""
    from loraland import LLMKernel

    model_dir, adapters = case
    tok = __import__("transformers").AutoTokenizer.from_pretrained(model_dir)
    words = "the quick brown fox jumps over lazy dog hello world ray serve adapters blocks".split()
    gen = torch.Generator().manual_seed(0)
    names = [*adapters, None]
    prompts, ids = [], []
    for i in range(2 * len(names)):
        n = int(torch.randint(2, 14, (1,), generator=gen))
        text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=gen))
        prompts.append(tok.encode(text, add_special_tokens=False))
        ids.append(names[i % len(names)])
    refs = peft_greedy_per_adapter(model_dir, adapters, list(zip(prompts, ids)), MAX_NEW)
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=128, max_adapters=8) as k:
        for name, path in adapters.items():
            k.load_adapter(name, path)
        outs = k.complete(prompts, ids, max_tokens=MAX_NEW, ignore_eos=True)
        pools = k.adapter_manager.pools.values()
        assert {p.signature.dora for p in pools} == {True, False}  # DoRA and plain LoRA pools, one batch
    assert [o.token_ids for o in outs] == refs
    base = [r for r, a in zip(refs, ids) if a is None]
    assert any(r not in base for r, a in zip(refs, ids) if a is not None and a.startswith("dora"))


# ---------------------------------------------------------------------------- manager and pools (no engine)
def test_pool_rescales_dora_rows_only(case):
    """LoraBatch.apply on the fused q/k/v output: DoRA rows get f * (base - bias) + bias + f*s*delta (the
    reference DoRA linear), plain rows base + delta, base rows nothing; with the base bias in `out`."""
    model_dir, adapters = case
    mc, base = ModelConfig.from_folder(model_dir), BaseWeights(model_dir)
    m = AdapterManager(
        mc, max_adapters=4, max_cpu_adapters=None, dtype=torch.float32, device=torch.device("cpu"),
        base_weights=base,
    )  # fmt: skip
    try:
        lws = {n: read_adapter(adapters[n], mc, name=n) for n in ("dora-attn-r4", "dora-all-r8-rs", "qv-r2")}
        for n, lw in lws.items():
            m.register(n, 1, lambda lw=lw: lw, lw)
        order = [None, "dora-attn-r4", "qv-r2", "dora-all-r8-rs", "dora-attn-r4"]
        seqs = [Sequence(i, [1], SamplingParams(), adapter=n and f"{n}@1") for i, n in enumerate(order)]
        assert all(m.admit(s) for s in seqs)
        seqs.sort(key=m.sort_key)
        counts = [2, 3, 1, 2, 2]
        batch = m.lora_batch(list(zip(seqs, counts)))
        shapes = mc.linear_shapes()
        cols, c = {}, 0
        for mod in ("q_proj", "k_proj", "v_proj"):
            cols[mod] = (c, c + shapes[mod][1])
            c += shapes[mod][1]
        x = torch.randn(sum(counts), mc.hidden_size, generator=torch.Generator().manual_seed(0))
        for layer in range(mc.num_layers):
            Ws = {mod: base.weight(layer, mod) for mod in cols}
            bs = {mod: base.bias(layer, mod) for mod in cols}
            out = torch.cat([x @ Ws[mod].T + (0 if bs[mod] is None else bs[mod]) for mod in cols], 1)
            want = out.clone()
            batch.apply(layer, "qkv", x, out)
            t = 0
            for s, n in zip(seqs, counts):
                lw = lws[s.adapter.split("@")[0]] if s.adapter else None
                for mod, (c0, c1) in cols.items():
                    if lw is None or (layer, mod) not in lw.tensors:
                        continue
                    xs = x[t : t + n]
                    if lw.is_dora:
                        a, b = lw.tensors[(layer, mod)]
                        mag = lw.magnitude[(layer, mod)]
                        want[t : t + n, c0:c1] = R.dora_linear_ref(xs, Ws[mod], bs[mod], a, b, lw.scale, mag)
                    else:
                        want[t : t + n, c0:c1] += xs @ lw.delta(layer, mod).T
                t += n
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        assert sorted(p.signature.dora for p in m.pools.values()) == [False, True, True]
        # resident bytes: a DoRA slot holds A, B and one factor vector per module
        e = m.entries["dora-attn-r4@1"]
        assert e.slot[0].nbytes_per_slot() == e.weights.nbytes()
    finally:
        m.close()


def test_dora_refusals(case, tmp_path):
    model_dir, adapters = case
    mc = ModelConfig.from_folder(model_dir)
    good = adapters["dora-qv-r2"]
    lw = read_adapter(good, mc)
    with pytest.raises(InvalidAdapter, match="base_weights"):  # a manager that cannot compute the factors
        with_dora_scales(lw, None)
    plain = read_adapter(adapters["qv-r2"], mc)
    with pytest.raises(InvalidRequest, match="DoRA"):
        merge_adapters([(with_dora_scales(lw, BaseWeights(model_dir)), 0.5), (plain, 0.5)], "m")

    from safetensors.torch import load_file, save_file

    def variant(name: str, edit_tensors=None, **config) -> object:
        out = tmp_path / name
        out.mkdir()
        cfg = json.loads((good / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
        t = load_file(good / "adapter_model.safetensors")
        if edit_tensors:
            edit_tensors(t)
        save_file(t, out / "adapter_model.safetensors", metadata={"format": "pt"})
        return out

    def drop_one(t):
        t.pop(next(k for k in sorted(t) if "magnitude" in k))

    def widen(t):
        k = next(k for k in sorted(t) if "magnitude" in k)
        t[k] = torch.ones(t[k].numel() + 1)

    def nan(t):
        t[next(k for k in sorted(t) if "magnitude" in k)][0] = float("nan")

    cases = {
        "missing": (variant("missing", drop_one), "lora_magnitude_vector"),
        "stray": (variant("stray", use_dora=False), "use_dora"),
        "shape": (variant("shape", widen), "shape"),
        "nan": (variant("nan", nan), "finite"),
    }
    for folder, msg in cases.values():
        with pytest.raises(InvalidAdapter, match=msg):
            read_adapter(folder, mc)

    # a PeftModel's state_dict form (the adapter name inside every key) reads the same
    def old_keys(t):
        for k in list(t):
            named = k + ".default.weight" if "magnitude" in k else k.replace(".weight", ".default.weight")
            t[named] = t.pop(k)

    torch.testing.assert_close(read_adapter(variant("old", old_keys), mc).magnitude, lw.magnitude)
