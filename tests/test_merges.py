"""PEFT's merge types (add_weighted_adapter) as virtual adapters: the grammar, the merged deltas against PEFT's,
and greedy tokens identical to PEFT with its merged adapter loaded, for every type in one mixed batch.

DARE's masks: PEFT draws them from torch's global RNG inside its merge loop (after it has initialised the new
adapter, which also draws). The oracle seeds torch's global RNG with the merge's seed at the first call of
PEFT's per-module merge function (a wrapper around LoraModel's method, PEFT's code unchanged); ours draws
from a torch.Generator with that seed in the same order, so the masks are the same."""

from __future__ import annotations

import re

import pytest
import torch

from app.config.model_config import ModelConfig
from app.errors import InvalidRequest
from app.merge_methods import MergeMethod
from app.names import merge_id, parse_model, resolved
from app.replica.lora.merge import merge_adapters
from app.replica.lora.peft_format import read_adapter
from tests.fixtures.adapters import SPECS_BY_NAME, AdapterSpec, make_peft_adapter, peft_model_with
from tests.hf_oracle import hf_greedy

MAX_NEW = 6
# Same rank (PEFT's entrywise kinds require it), different targets; the first without rslora (PEFT's merged
# config copies its flag), the last with rslora, a negative weight.
SPECS = [
    AdapterSpec("ma", r=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"], seed=31, std=0.08),
    AdapterSpec("mb", r=8, alpha=8, target_modules=list(SPECS_BY_NAME["all-r32"].target_modules), seed=32),
    AdapterSpec(
        "mc", r=8, alpha=12, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], use_rslora=True,
        seed=33, std=0.07,
    ),
]  # fmt: skip
TERMS = [("ma", 0.7), ("mb", 0.5), ("mc", -0.4)]
# (kind, our options, PEFT's keyword arguments)
CASES = [
    ("cat", {}, {}),
    ("linear", {}, {}),
    ("svd", {}, {}),
    ("ties", {"density": 0.5}, {"density": 0.5}),
    ("ties_svd", {"density": 0.6, "svd_rank": 6}, {"density": 0.6, "svd_rank": 6}),
    ("dare_linear", {"density": 0.5, "seed": 7}, {"density": 0.5}),
    ("dare_ties", {"density": 0.6, "seed": 3}, {"density": 0.6}),
    ("dare_linear_svd", {"density": 0.7, "seed": 5}, {"density": 0.7}),
    ("dare_ties_svd", {"density": 0.5, "seed": 0, "majority_sign_method": "frequency"},
     {"density": 0.5, "majority_sign_method": "frequency"}),
    ("magnitude_prune", {"density": 0.3}, {"density": 0.3}),
    ("magnitude_prune_svd", {"density": 0.5, "svd_clamp": 0.99}, {"density": 0.5, "svd_clamp": 0.99}),
]  # fmt: skip


def case_id(kind: str, opts: dict) -> str:
    return merge_id(TERMS, kind, **opts)


@pytest.fixture(scope="module")
def merge_case(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("merge-adapters")
    adapters = {s.name: make_peft_adapter(llama_dir, root / s.name, **s.kwargs()) for s in SPECS}
    return llama_dir, adapters


def peft_merged(model_dir, adapters, monkeypatch):
    """PEFT with the three adapters and one merged adapter per case, named peft_name(i) (PEFT's names hold
    no '.')."""
    from peft.tuners.lora.model import LoraModel

    peft = peft_model_with(model_dir, adapters)
    seed: dict = {}
    for fn in (
        "_generalized_task_arithmetic_weighted_adapter",
        "_svd_generalized_task_arithmetic_weighted_adapter",
    ):
        orig = getattr(LoraModel, fn)

        def wrapped(self, *a, _orig=orig, **k):
            if seed.get("pending") is not None:  # the first module of this merge: seed the global RNG once
                torch.manual_seed(seed.pop("pending"))
            return _orig(self, *a, **k)

        monkeypatch.setattr(LoraModel, fn, wrapped)
    names, weights = [n for n, _ in TERMS], [w for _, w in TERMS]
    for i, (kind, opts, kw) in enumerate(CASES):
        seed["pending"] = opts.get("seed", 0)
        peft.add_weighted_adapter(names, weights, peft_name(i), combination_type=kind, **kw)
    return peft


def peft_name(i: int) -> str:
    return f"merge{i}"


def peft_deltas(peft_model, adapter: str) -> dict[tuple[int, str], torch.Tensor]:
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLayer) and adapter in mod.lora_A:
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", name)
            out[(int(m[1]), m[2])] = mod.get_delta_weight(adapter).detach()
    return out


def test_every_merge_type_matches_peft(merge_case, monkeypatch):
    """Merged deltas equal PEFT's, and greedy tokens equal PEFT's with its merged adapter, every merge type in
    one batch beside its components."""
    from loraland import LLMKernel

    model_dir, adapters = merge_case
    peft = peft_merged(model_dir, adapters, monkeypatch)
    mc = ModelConfig.from_folder(model_dir)
    lws = {n: read_adapter(p, mc, name=n) for n, p in adapters.items()}
    for i, (kind, opts, _) in enumerate(CASES):
        aid = case_id(kind, opts)
        method = parse_model(aid).method(0)
        merged = merge_adapters([(lws[n], w) for n, w in TERMS], aid, method=method)
        want = peft_deltas(peft, peft_name(i))
        assert set(merged.tensors) == set(want), aid
        rank = 3 * 8 if kind == "cat" else opts.get("svd_rank", 8)
        assert merged.rank == rank and merged.scale == 1.0
        for key, d in want.items():
            torch.testing.assert_close(merged.delta(*key), d, atol=2e-5, rtol=1e-4, msg=f"{aid} {key}")

    tok = __import__("transformers").AutoTokenizer.from_pretrained(model_dir)
    texts = ["the quick brown fox", "hello world, this is"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    ids = [case_id(kind, opts) for kind, opts, _ in CASES] + ["ma", None]
    peft_ids = [peft_name(i) for i in range(len(CASES))] + ["ma", "__base__"]
    jobs = [(p, a) for a in ids for p in prompts]
    refs = [hf_greedy(peft, p, MAX_NEW, adapter_names=[a]) for a in peft_ids for p in prompts]
    with LLMKernel(model_dir, dtype="float32", num_kv_blocks=256, max_adapters=16) as k:
        for name, path in adapters.items():
            k.load_adapter(name, path)
        outs = k.complete([p for p, _ in jobs], [a for _, a in jobs], max_tokens=MAX_NEW, ignore_eos=True)
        assert [o.token_ids for o in outs] == refs
        # built once, cached under its canonical name with the terms' versions, retired with a component
        comp, m = k.composition, k.adapter_manager
        (key,) = comp.lookup(ids[3])
        assert key.startswith("ties(ma@1*0.7+mb@1*0.5+mc@1*-0.4;density=0.5)")
        k.unload_adapter("mc")
        assert m.entries.get(key) is None or m.entries[key].retired
    distinct = {tuple(r) for r in refs[: len(CASES) * len(prompts) : len(prompts)]}
    assert len(distinct) > len(CASES) // 2  # the merge types really differ


def test_dare_seed_and_refusals(merge_case, tmp_path):
    model_dir, adapters = merge_case
    mc = ModelConfig.from_folder(model_dir)
    terms = [(read_adapter(adapters[n], mc, name=n), w) for n, w in TERMS]
    dare = MergeMethod("dare_ties", density=0.5, majority_sign_method="total", seed=1)
    one, two = merge_adapters(terms, "x", method=dare), merge_adapters(terms, "x", method=dare)
    other = merge_adapters(terms, "x", method=MergeMethod(**{**dare.__dict__, "seed": 2}))
    assert all(
        torch.equal(one.tensors[k][0], two.tensors[k][0]) for k in one.tensors
    )  # a re-read is the same
    assert any(not torch.equal(one.tensors[k][0], other.tensors[k][0]) for k in one.tensors)
    # one term: PEFT merges linearly, w * delta exactly
    single = merge_adapters(
        terms[:1], "s", method=MergeMethod("ties", density=0.5, majority_sign_method="total")
    )
    torch.testing.assert_close(single.delta(0, "q_proj"), 0.7 * terms[0][0].delta(0, "q_proj"))
    # entrywise kinds need one rank, and no rank/alpha patterns
    other_rank = read_adapter(
        make_peft_adapter(model_dir, tmp_path / "r4", **SPECS_BY_NAME["qv-r2"].kwargs()), mc
    )
    with pytest.raises(InvalidRequest, match="same rank"):
        merge_adapters([terms[0], (other_rank, 1.0)], "x", method=MergeMethod("linear"))
    svd = merge_adapters([terms[0], (other_rank, 1.0)], "x", method=MergeMethod("svd"))
    assert svd.rank == 8
    pattern = read_adapter(
        make_peft_adapter(model_dir, tmp_path / "p", **SPECS_BY_NAME["pattern-r6"].kwargs()), mc
    )
    with pytest.raises(InvalidRequest, match="rank_pattern"):
        merge_adapters([terms[0], (pattern, 1.0)], "x", method=MergeMethod("magnitude_prune", density=0.5))
    with pytest.raises(InvalidRequest, match="max_lora_rank"):
        merge_adapters(terms, "x", method=MergeMethod("svd", svd_rank=8), max_rank=4)


@pytest.mark.parametrize(
    "text,canonical",
    [
        ("ties(a*0.7+b*0.3;density=0.5)", "ties(a*0.7+b*0.3;density=0.5)"),
        ("ties( a*0.7 + b@2*0.3 ; density = 0.5 ; majority_sign_method=total)", "ties(a*0.7+b@2*0.3;density=0.5)"),
        ("dare_ties(a*1+b*1;seed=4;density=0.25;majority_sign_method=frequency)|c",
         "dare_ties(a*1+b*1;density=0.25;majority_sign_method=frequency;seed=4)|c"),
        ("svd(a*0.5+b*-1;svd_rank=4;svd_clamp=0.9)", "svd(a*0.5+b*-1;svd_rank=4;svd_clamp=0.9)"),
        ("cat(a*0.7+b*0.3)", "a*0.7+b*0.3"),
        ("linear(a*0.5)", "linear(a*0.5)"),
    ],
)  # fmt: skip
def test_grammar_round_trips(text, canonical):
    spec = parse_model(text, ("base",))
    assert (
        spec.canonical() == canonical and parse_model(canonical) == spec and spec.kind in ("merge", "chain")
    )
    pinned = resolved(spec, {t.ref: 3 for t in spec.terms()})
    assert parse_model(pinned.canonical()).methods == spec.methods


@pytest.mark.parametrize(
    "text,message",
    [
        ("ties(a*0.7+b*0.3)", "needs a density"),
        ("blend(a*0.7+b*0.3)", "unknown merge type 'blend'"),
        ("svd(a+b;density=0.5)", "option 'density=0.5' of a svd merge"),
        ("ties(a+b;density=1.5)", r"must be a number in \(0, 1\]"),
        ("ties(a+b;density=0.5;density=0.4)", "once each"),
        ("svd(a+b;svd_rank=0)", "positive integer"),
        ("dare_linear(a+b;density=0.5;seed=-1)", "non-negative integer"),
        ("ties(a+b;density=0.5;majority_sign_method=max)", "total or frequency"),
        ("ties(a+b;density=0.5", "KIND"),
        ("ties(a*0.5+a*0.5;density=0.5)", "twice"),
    ],
)
def test_grammar_refusals_name_the_problem(text, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        parse_model(text)
    assert e.value.param == "model"


def test_merge_id_from_python():
    assert merge_id([("a", 0.7), ("b", 0.3)], "ties", density=0.5) == "ties(a*0.7+b*0.3;density=0.5)"
    assert merge_id([("a", 0.7), ("b", 0.3)]) == "a*0.7+b*0.3"
    with pytest.raises(InvalidRequest, match="density"):
        merge_id([("a", 1.0), ("b", 1.0)], "dare_linear")
