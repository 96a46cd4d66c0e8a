"""AdapterManager's registry (retirement of merges with their components, host re-reads) and the device pools'
per-step plan, on synthetic adapters: no model files, no engine."""

from __future__ import annotations

import pytest
import torch

from app.config.model_config import ModelConfig
from app.errors import InvalidAdapter
from app.replica.lora.manager import AdapterManager
from app.replica.lora.merge import merge_adapters
from app.replica.lora.weights import LoraWeights
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams

CFG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
)


def lora(name: str, rank: int, modules: tuple[str, ...], seed: int, scale: float = 0.5) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    shapes = CFG.linear_shapes()
    tensors = {
        (layer, m): (
            torch.randn(rank, shapes[m][0], generator=g),
            torch.randn(shapes[m][1], rank, generator=g),
        )
        for layer in range(CFG.num_layers)
        for m in modules
    }
    return LoraWeights(
        name=name,
        rank=rank,
        alpha=scale * rank,
        use_rslora=False,
        scale=scale,
        target_modules=frozenset(modules),
        layers=tuple(range(CFG.num_layers)),
        tensors=tensors,
    )


class Loader:
    """A loader that counts its calls (a re-read from disk/S3/Hub in production)."""

    def __init__(self, weights: LoraWeights):
        self.weights, self.calls = weights, 0

    def __call__(self) -> LoraWeights:
        self.calls += 1
        return self.weights


@pytest.fixture
def manager():
    m = AdapterManager(
        CFG, max_adapters=4, max_cpu_adapters=None, dtype=torch.float32, device=torch.device("cpu")
    )
    yield m
    m.close()


def add(m: AdapterManager, name: str, lw: LoraWeights, version: int = 1, parts: tuple[str, ...] = ()):
    return m.register(name, version, Loader(lw), lw, parts=parts)


def merged(m: AdapterManager, keys: tuple[str, ...], weights: tuple[float, ...]):
    name = "+".join(f"{k}*{w:g}" for k, w in zip(keys, weights))
    lw = merge_adapters([(m.weights_of(k), w) for k, w in zip(keys, weights)], name)
    return add(m, name, lw, parts=keys)


def test_merge_retires_when_a_component_is_unloaded(manager):
    m = manager
    add(m, "a", lora("a", 2, ("q_proj",), 1))
    add(m, "b", lora("b", 4, ("q_proj", "v_proj"), 2))
    e = merged(m, ("a@1", "b@1"), (0.7, 0.3))
    assert m.resolve(e.name) == e.key and not e.retired and e.parts == ("a@1", "b@1")
    m.submitted(e.key)  # a running request keeps the retired merge until it finishes
    m.unload("a")
    assert e.retired and m.resolve(e.name) is None and e.name not in m.names()
    assert m.resolve("b") == "b@1" and not m.entries["b@1"].retired
    assert e.key in m.entries
    m.finished(Sequence(0, [1], SamplingParams(), adapter=e.key))
    assert e.key not in m.entries
    # a merge built from a component that is already gone is refused, not registered alive
    with pytest.raises(KeyError):
        merged(m, ("a@1", "b@1"), (0.5, 0.5))


def test_merge_retires_when_a_component_gets_a_new_version(manager):
    m = manager
    add(m, "a", lora("a", 2, ("q_proj",), 1))
    add(m, "b", lora("b", 2, ("v_proj",), 2))
    e = merged(m, ("a@1", "b@1"), (1.0, 1.0))
    m.set_pinned(e.name, True)
    add(m, "b", lora("b", 2, ("v_proj",), 3), version=2)
    assert e.retired and not e.pinned and m.resolve(e.name) is None
    assert m.resolve("a") == "a@1" and m.resolve("b") == "b@2"
    again = merged(m, ("a@1", "b@2"), (1.0, 1.0))
    assert not again.retired and m.resolve(again.name) == again.key


def test_weights_of_rereads_after_host_eviction():
    m = AdapterManager(
        CFG, max_adapters=2, max_cpu_adapters=1, dtype=torch.float32, device=torch.device("cpu")
    )
    try:
        a, b = lora("a", 2, ("q_proj",), 1), lora("b", 2, ("q_proj",), 2)
        ea, eb = add(m, "a", a), add(m, "b", b)
        assert ea.weights is None and eb.weights is b  # one host slot: registering b evicted a
        assert m.weights_of("a@1") is a and ea.loader.calls == 1
        assert m.weights_of("b@1") is b and eb.loader.calls == 0
        with pytest.raises(KeyError):
            m.weights_of("nope@1")
    finally:
        m.close()


def test_host_copies_are_evicted_least_recently_used_not_in_load_order():
    """Admitting a request touches its adapter's host copy: a hot adapter loaded first outlives newer, colder
    ones (the placement simulator's model of a replica assumes LRU; load order made real hit rates ~8% lower)."""
    m = AdapterManager(
        CFG, max_adapters=4, max_cpu_adapters=2, dtype=torch.float32, device=torch.device("cpu")
    )
    try:
        ea, _ = add(m, "a", lora("a", 2, ("q_proj",), 1)), add(m, "b", lora("b", 2, ("q_proj",), 2))
        seq = Sequence(1, [1, 2, 3], SamplingParams(max_tokens=1), adapter="a@1")
        assert m.admit(seq)  # a is used after b was loaded
        m.release(seq)
        add(m, "c", lora("c", 2, ("q_proj",), 3))
        assert list(m.host_lru) == ["a@1", "c@1"] and ea.weights is not None
    finally:
        m.close()


def test_lora_batch_applies_every_adapter_delta(manager):
    """Mixed ranks and targets in one step: the fused q/k/v output of each token gets its own adapter's delta."""
    m = manager
    adapters = {
        "a": lora("a", 2, ("q_proj", "v_proj"), 1),
        "b": lora("b", 4, ("q_proj", "k_proj", "v_proj"), 2, scale=2.0),
        "c": lora("c", 2, ("q_proj", "v_proj"), 3),  # same signature as a: same pool
    }
    for name, lw in adapters.items():
        add(m, name, lw)
    seqs = [Sequence(i, [1], SamplingParams(), adapter=None if n is None else f"{n}@1") for i, n in
            enumerate([None, "a", "b", "c", "a"])]  # fmt: skip
    assert all(m.admit(s) for s in seqs)
    seqs.sort(key=m.sort_key)
    counts = [3, 2, 1, 4, 2]
    batch = m.lora_batch(list(zip(seqs, counts)))
    shapes = CFG.linear_shapes()
    q, kv = shapes["q_proj"][1], shapes["k_proj"][1]
    x = torch.randn(sum(counts), CFG.hidden_size)
    for layer in range(CFG.num_layers):
        out = torch.zeros(x.shape[0], q + 2 * kv)
        batch.apply(layer, "qkv", x, out)
        want, t = torch.zeros_like(out), 0
        for s, n in zip(seqs, counts):
            lw = adapters[s.adapter.split("@")[0]] if s.adapter else None
            for mod, c0, c1 in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
                if lw is not None and (layer, mod) in lw.tensors:
                    want[t : t + n, c0:c1] = x[t : t + n] @ lw.delta(layer, mod).T
            t += n
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert len(m.pools) == 2 and m.free_slots() == 1


class FakeBase:
    """BaseWeights' interface over random tensors: W [out, in] per (layer, module), no biases."""

    def __init__(self):
        g, shapes = torch.Generator().manual_seed(99), CFG.linear_shapes()
        self.W = {
            (lay, m): torch.randn(o, i, generator=g)
            for lay in range(CFG.num_layers)
            for m, (i, o) in shapes.items()
        }
        self.reads = 0

    def weight(self, layer, module):
        self.reads += 1
        return self.W[(layer, module)]

    def bias(self, layer, module):
        return None


def dora(name: str, seed: int) -> LoraWeights:
    lw = lora(name, 2, ("q_proj", "v_proj"), seed)
    g = torch.Generator().manual_seed(seed + 1)
    lw.magnitude = {k: torch.rand(b.shape[0], generator=g) + 0.5 for k, (_, b) in lw.tensors.items()}
    return lw


def test_dora_factors_are_computed_off_the_engine_thread_and_refused_without_base():
    base = FakeBase()
    m = AdapterManager(
        CFG,
        max_adapters=2,
        max_cpu_adapters=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
        base_weights=base,
    )
    try:
        da, pb = dora("d", 5), lora("p", 2, ("q_proj", "v_proj"), 6)
        e = add(m, "d", da)
        assert (
            e.weights.dora_scale is not None and da.dora_scale is None
        )  # prepared on register, input untouched
        key = (0, "q_proj")
        a, b = da.tensors[key]
        want = da.magnitude[key] / torch.linalg.norm(base.W[key] + da.scale * b @ a, dim=1)
        torch.testing.assert_close(e.weights.dora_scale[key], want)
        add(m, "p", pb)  # one host slot: the DoRA adapter's weights are dropped from the host
        assert e.weights is None
        seq = Sequence(0, [1], SamplingParams(), adapter="d@1")
        reads = base.reads
        assert not m.admit(seq)  # a background re-read ...
        e.loading.result()
        m.poll()
        assert e.weights.dora_scale is not None and base.reads > reads  # ... computed the factors again
        assert m.admit(seq) and e.slot[0].signature.dora
    finally:
        m.close()
    plain = AdapterManager(
        CFG, max_adapters=2, max_cpu_adapters=None, dtype=torch.float32, device=torch.device("cpu")
    )
    try:
        with pytest.raises(InvalidAdapter, match="base_weights"):
            add(plain, "d", dora("d", 5))
    finally:
        plain.close()
