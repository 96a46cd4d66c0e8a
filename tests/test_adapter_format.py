"""PEFT adapters: read_adapter reproduces PEFT's own deltas, refusals name the field, merges equal PEFT's cat."""

from __future__ import annotations

import hashlib
import json
import math
import shutil

import pytest
import torch

from app.config.model_config import ModelConfig
from app.errors import InvalidAdapter, InvalidRequest
from app.replica.lora.merge import merge_adapters
from app.replica.lora.peft_format import adapter_summary, read_adapter
from tests.fixtures.adapters import (
    ADAPTER_SPECS,
    CORRUPT_KINDS,
    SPECS_BY_NAME,
    make_adapter_set,
    peft_model_with,
    with_adapter_name,
    write_corrupt_adapter,
)

MODULE_RE = r"layers\.(\d+)\.\w+\.(\w+)$"


@pytest.fixture(scope="module")
def adapter_sets(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {kind: make_adapter_set(path, root / kind) for kind, path in tiny_models.items()}


@pytest.fixture(scope="module")
def llama_adapters(adapter_sets):
    return adapter_sets["llama-gqa"]


@pytest.fixture(scope="module")
def llama(llama_dir) -> ModelConfig:
    return ModelConfig.from_folder(llama_dir)


def peft_deltas(peft_model, adapter: str) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> PEFT's get_delta_weight for every LoRA layer that carries `adapter`."""
    import re

    from peft.tuners.lora import LoraLayer

    out = {}
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLayer) and adapter in mod.lora_A:
            m = re.search(MODULE_RE, name)
            out[(int(m[1]), m[2])] = mod.get_delta_weight(adapter).detach()
    return out


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa-rope3", "qwen2-tied"])
def test_read_adapter_reproduces_peft_deltas(kind, tiny_models, adapter_sets):
    model = ModelConfig.from_folder(tiny_models[kind])
    peft_model = peft_model_with(tiny_models[kind], adapter_sets[kind])
    for spec in ADAPTER_SPECS:
        lw = read_adapter(adapter_sets[kind][spec.name], model)
        ref = peft_deltas(peft_model, spec.name)
        assert set(lw.tensors) == set(ref), spec.name
        for key, want in ref.items():
            torch.testing.assert_close(lw.delta(*key), want, atol=1e-6, rtol=1e-5, msg=f"{spec.name} {key}")
        assert lw.name == spec.name and lw.alpha == spec.alpha and lw.use_rslora == spec.use_rslora
        assert all(a.dtype == torch.float32 and b.dtype == torch.float32 for a, b in lw.tensors.values())
        assert lw.nbytes() == 4 * sum(a.numel() + b.numel() for a, b in lw.tensors.values())
        if not spec.rank_pattern and not spec.alpha_pattern:
            assert lw.scale == pytest.approx(spec.alpha / (math.sqrt(spec.r) if spec.use_rslora else spec.r))
            assert lw.rank == spec.r and all(lw.module_rank(m) == spec.r for m in lw.target_modules)


def test_targets_layers_and_patterns(llama, llama_adapters):
    regex = read_adapter(llama_adapters["regex-r3"], llama)
    assert regex.target_modules == {"q_proj", "o_proj", "down_proj"} and regex.layers == (0, 1)
    l1 = read_adapter(llama_adapters["l1-r12"], llama)
    assert l1.layers == (1,) and len(l1.target_modules) == 7
    pat = read_adapter(llama_adapters["pattern-r6"], llama)
    # rank_pattern: up_proj 10; v_proj 6 in layer 0 but 2 in layer 1 -> zero-padded to 6; alpha_pattern folded.
    assert (pat.module_rank("q_proj"), pat.module_rank("v_proj"), pat.module_rank("up_proj")) == (6, 6, 10)
    assert pat.module_rank("k_proj") == 0 and pat.scale == 1.0 and pat.rank == 10
    a, b = pat.tensors[(1, "v_proj")]
    assert a[2:].abs().sum() == 0 and b[:, 2:].abs().sum() == 0


def test_fixture_adapters_change_greedy_outputs(llama_dir, llama_adapters):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    peft_model = peft_model_with(llama_dir, llama_adapters)
    names = ["__base__"] + [s.name for s in ADAPTER_SPECS]
    gens = []
    for prompt in ["the quick brown fox", "hello world, this is"]:  # one prompt per call: no padding needed
        ids = tok(prompt, return_tensors="pt")["input_ids"].repeat(len(names), 1)
        with torch.no_grad():
            out = peft_model.generate(
                ids, adapter_names=names, max_new_tokens=6, do_sample=False, pad_token_id=0
            )
        gens.append(out[:, ids.shape[1] :])
    gen = torch.stack(gens, 1)  # [adapter, prompt, token]
    for i, name in enumerate(names[1:], start=1):
        assert not torch.equal(gen[i], gen[0]), f"{name} greedy outputs equal the base model's"


def test_adapter_name_inside_keys_is_accepted(llama, llama_adapters, tmp_path):
    plain = read_adapter(llama_adapters["attn-r8"], llama)
    named = read_adapter(with_adapter_name(llama_adapters["attn-r8"], tmp_path / "named"), llama, name="x")
    assert named.name == "x" and set(named.tensors) == set(plain.tensors)
    for key, (a, b) in plain.tensors.items():
        assert torch.equal(named.tensors[key][0], a) and torch.equal(named.tensors[key][1], b)


@pytest.mark.parametrize("kind", sorted(CORRUPT_KINDS))
def test_refusals_name_the_field(llama, kind, llama_adapters, tmp_path):
    bad = write_corrupt_adapter(llama_adapters["qv-r2"], tmp_path / kind, kind)
    with pytest.raises(InvalidAdapter) as err:
        read_adapter(bad, llama)
    assert CORRUPT_KINDS[kind] in str(err.value), str(err.value)
    assert str(bad) in str(err.value)
    assert not (bad / "UNPICKLED").exists()


def test_pickle_is_never_opened_even_beside_safetensors(llama, llama_adapters, tmp_path):
    trap = write_corrupt_adapter(llama_adapters["qv-r2"], tmp_path / "trap", "bin_only")
    both = shutil.copytree(llama_adapters["qv-r2"], tmp_path / "both")
    shutil.copy(trap / "adapter_model.bin", both / "adapter_model.bin")
    assert read_adapter(both, llama).rank == 2
    with pytest.raises(InvalidAdapter, match="adapter_model.bin"):
        adapter_summary(trap)
    assert not (both / "UNPICKLED").exists() and not (trap / "UNPICKLED").exists()


def test_limits_rank_bytes_and_layers(llama, llama_adapters, tmp_path):
    with pytest.raises(InvalidAdapter, match="r=64 .*max_lora_rank=32"):
        read_adapter(llama_adapters["qv-r64-rs"], llama, max_rank=32)
    size = (llama_adapters["qv-r2"] / "adapter_model.safetensors").stat().st_size
    with pytest.raises(InvalidAdapter, match="limit"):
        read_adapter(llama_adapters["qv-r2"], llama, max_bytes=size - 1)
    assert read_adapter(llama_adapters["qv-r2"], llama, max_bytes=size).rank == 2
    bad = shutil.copytree(llama_adapters["l1-r12"], tmp_path / "l5")
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "layers_to_transform": [5]}))
    with pytest.raises(InvalidAdapter, match="layers_to_transform"):
        read_adapter(bad, llama)
    # an adapter for the 3-layer model does not fit the 2-layer one
    three = llama_adapters["qv-r2"].parent.parent / "llama-mqa-rope3" / "attn-r8"
    with pytest.raises(InvalidAdapter, match="shape|layers"):
        read_adapter(three, llama)


def test_summary(llama_adapters):
    for spec in ADAPTER_SPECS:
        folder = llama_adapters[spec.name]
        s = adapter_summary(folder)
        files = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in s["files"]}
        assert s["files"] == files and set(files) == {"adapter_config.json", "adapter_model.safetensors"}
        assert s["size"] == sum((folder / n).stat().st_size for n in files)
        assert (s["alpha"], s["use_rslora"]) == (spec.alpha, spec.use_rslora)
        assert s["rank"] == max([spec.r, *spec.rank_pattern.values()])
        assert s["base_model_name_or_path"] and s["peft_type"] == "LORA"
    assert adapter_summary(llama_adapters["regex-r3"])["target_modules"] == ["down_proj", "o_proj", "q_proj"]
    assert adapter_summary(llama_adapters["l1-r12"])["layers"] == [1]


def _add_deltas(model_dir, deltas: dict[tuple[int, str], torch.Tensor]):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for (layer, module), d in deltas.items():
            block = base.model.layers[layer]
            lin = getattr(block.self_attn if hasattr(block.self_attn, module) else block.mlp, module)
            lin.weight += d
    return base


def test_merge_equals_peft_cat(llama, llama_dir, llama_adapters):
    names, weights = ["qv-r2", "mlp-r16-rs", "l1-r12", "all-r4-rs"], [0.7, 0.3, -0.5, 0.25]
    terms = [(read_adapter(llama_adapters[n], llama), w) for n, w in zip(names, weights, strict=True)]
    merged = merge_adapters(terms, "mix")
    assert merged.scale == 1.0 and merged.name == "mix" and merged.source.startswith("merge:qv-r2*0.7")
    assert merged.module_rank("q_proj") == 2 + 12 + 4 and merged.module_rank("gate_proj") == 16 + 12 + 4
    for key in merged.tensors:  # our semantics: exactly sum_i w_i * delta_i
        want = sum(w * lw.delta(*key) for lw, w in terms if key in lw.tensors)
        torch.testing.assert_close(merged.delta(*key), want, atol=1e-6, rtol=1e-5)

    peft_model = peft_model_with(llama_dir, {n: llama_adapters[n] for n in names})
    peft_model.add_weighted_adapter(names, weights, "cat", combination_type="cat")
    ref = peft_deltas(peft_model, "cat")
    assert set(merged.tensors) <= set(ref)
    for key, want in ref.items():
        got = merged.delta(*key) if key in merged.tensors else torch.zeros_like(want)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=str(key))

    peft_model.set_adapter("cat")
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = _add_deltas(llama_dir, {k: merged.delta(*k) for k in merged.tensors})(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_merge_peft_rslora_mixed_with_plain(llama, llama_dir, llama_adapters):
    """A cat merge of an rsLoRA adapter and a plain one equals PEFT's (>= 0.22); PEFT before 0.22 copied
    use_rslora from the first adapter, its merge then sqrt(R) times ours."""
    import peft
    from packaging.version import Version

    names, weights = ["all-r4-rs", "attn-r8"], [0.5, 1.5]
    merged = merge_adapters(
        [(read_adapter(llama_adapters[n], llama), w) for n, w in zip(names, weights, strict=True)], "m"
    )
    peft_model = peft_model_with(llama_dir, {n: llama_adapters[n] for n in names})
    peft_model.add_weighted_adapter(names, weights, "cat", combination_type="cat")
    quirk = math.sqrt(sum(SPECS_BY_NAME[n].r for n in names)) if Version(peft.__version__) < Version("0.22") else 1.0
    for key, want in peft_deltas(peft_model, "cat").items():
        torch.testing.assert_close(quirk * merged.delta(*key), want, atol=1e-5, rtol=1e-5)


def test_merge_mixed_target_forms_and_bad_input(llama, llama_adapters):
    regex, pat = (
        read_adapter(llama_adapters["regex-r3"], llama),
        read_adapter(llama_adapters["pattern-r6"], llama),
    )
    merged = merge_adapters([(regex, 1.0), (pat, 2.0)], "rp", max_rank=64)
    assert merged.target_modules == regex.target_modules | pat.target_modules
    torch.testing.assert_close(
        merged.delta(0, "q_proj"), regex.delta(0, "q_proj") + 2 * pat.delta(0, "q_proj")
    )
    with pytest.raises(InvalidRequest, match="max_lora_rank"):
        merge_adapters([(regex, 1.0), (pat, 2.0)], "rp", max_rank=8)
    with pytest.raises(InvalidRequest, match="finite"):
        merge_adapters([(regex, float("nan"))], "x")
    with pytest.raises(InvalidRequest):
        merge_adapters([], "x")
