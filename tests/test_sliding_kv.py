"""Gemma 3's sliding-window KV memory (app/replica/kv_layout.py, kv_blocks.py): the sliding layers' blocks go
back to the pool once wholly behind the window, the global layers keep every block. On a tiny random Gemma 3
(window 8, blocks of 4, two global and four sliding layers: KV groups of two layers) with prompts and
generations several windows long: fp32 greedy tokens identical to transformers + PEFT with adapters mixed in one
batch, chunked prefill, preemption and prefix-cache hits; the blocks each group holds, measured per sequence
while it decodes; and a KV budget that fits the sequences only because the sliding blocks are freed."""

from __future__ import annotations

import random

import pytest

from app.replica.kv_blocks import BlockTables
from app.replica.kv_cache import BlockAllocator
from app.replica.kv_layout import KVLayout
from app.replica.sequence import Sequence
from app.sampling_params import SamplingParams
from loraland import LLMKernel
from tests.fixtures.adapters import make_peft_adapter, peft_model_with
from tests.fixtures.family_models import COMMON, FAMILY_MODELS, build_hf_model
from tests.hf_oracle import hf_greedy

WINDOW, BS = 8, 4
S, F = "sliding_attention", "full_attention"
BOUND = -(-WINDOW // BS) + 1  # a sliding group's blocks per decoding sequence: the window's, plus one partial


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma-swa")
    cls_name, arch, overrides = FAMILY_MODELS["gemma3"]
    cfg = (
        COMMON
        | overrides
        | {"num_hidden_layers": 6, "sliding_window": WINDOW, "layer_types": [S, S, F, S, S, F]}
    )
    model_dir = build_hf_model(root / "model", cls_name, arch, cfg, 0.0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {
        "all-r8": make_peft_adapter(
            model_dir, root / "all-r8", r=8, alpha=16, target_modules=targets, seed=1
        ),
        "attn-r4": make_peft_adapter(
            model_dir, root / "attn-r4", r=4, alpha=8, target_modules=targets[:4], seed=2
        ),
    }
    return model_dir, adapters, peft_model_with(model_dir, adapters)


def _requests(n, seed, lo, hi):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [(None, "all-r8", "attn-r4")[i % 3] for i in range(n)]


def _refs(peft, prompts, ids, max_new):
    return [hf_greedy(peft, p, max_new, adapter_names=[a or "__base__"]) for p, a in zip(prompts, ids)]


def _kernel(model_dir, adapters, **kw):
    k = LLMKernel(model_dir, dtype="float32", block_size=BS, max_num_batched_tokens=16, max_adapters=4, **kw)
    for name, path in adapters.items():
        k.load_adapter(name, path)
    return k


def test_layout_groups_gemma_layers_and_sizes_the_pool():
    lay = KVLayout.of((WINDOW, WINDOW, None, WINDOW, WINDOW, None))
    assert lay.windows == (None, WINDOW, WINDOW) and lay.width == 2
    assert lay.layer_group == (1, 1, 0, 2, 2, 0) and lay.layer_slot == (0, 1, 0, 0, 1, 1)
    assert lay.pool_blocks(10, 6) == 30  # the memory of 10 blocks of all six layers
    gemma_270m = KVLayout.of(tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18)))
    assert gemma_270m.windows == (None,) + (512,) * 5 and gemma_270m.width == 3
    one = KVLayout.of((None,) * 4)  # no sliding layer: one group, one tensor per layer, as before groups
    assert one.windows == (None,) and one.width == 4 and one.pool_blocks(10, 4) == 10


def test_sliding_blocks_are_freed_and_a_prefix_is_reused_only_with_its_window():
    """Pure Python: one sequence grows token by token; then the same prompt reuses the cached prefix, including
    sliding blocks freed earlier (kept in the prefix cache until evicted)."""
    lay = KVLayout.of((WINDOW, None))
    alloc = BlockAllocator(64, BS, True)
    bt = BlockTables(alloc, lay, BS)
    seq = Sequence(0, list(range(1, 41)), SamplingParams(max_tokens=4))
    bt.reset(seq)
    while seq.num_computed < seq.num_tokens:
        assert bt.grow(seq, 1)
        seq.num_computed += 1
        bt.commit(seq)
        g, s = seq.tables
        assert len([b for b in g if b >= 0]) == -(-seq.num_computed // BS)
        assert len([b for b in s if b >= 0]) <= BOUND
        assert all(b >= 0 for b in s[lay.first_needed(1, seq.num_computed, BS) :])
    assert alloc.num_used == 10 + 2  # 10 global blocks; the sliding group's last two (positions 33-39)
    again = Sequence(1, list(range(1, 41)), SamplingParams(max_tokens=4))
    bt.reset(again)
    bt.reuse_prefix(again)  # 39 tokens may be reused: 9 full blocks
    assert again.num_computed == 36
    assert again.tables[0] == seq.tables[0][:9]
    # its first query (position 36) reads positions 29-35: sliding blocks 7 (freed by seq, still cached) and 8
    s = again.tables[1]
    assert s[:7] == [-1] * 7 and len(s) == 9 and s[7] >= 0 and s[8] == seq.tables[1][8]
    assert (alloc.queries, alloc.hits) == (9, 9)
    bt.reset(seq)
    bt.reset(again)
    assert alloc.num_used == 0


@pytest.mark.parametrize("policy", ["fcfs", "vtc"])
def test_scheduler_under_pressure_loses_nothing_and_frees_every_group(policy):
    """Pure Python: eight long sequences in a pool that holds three of them: preemption by recompute, every
    sequence finishes with all its tokens, every block comes back; each group holds what its kind allows."""
    from app.replica.fairness import make_policy
    from app.replica.scheduler import Scheduler, SchedulerConfig

    lay = KVLayout.of((WINDOW, WINDOW, None, WINDOW, WINDOW, None))
    alloc = BlockAllocator(3 * 31, BS, True)
    s = Scheduler(SchedulerConfig(8, 16, BS), alloc, policy=make_policy(policy), layout=lay)
    seqs = [Sequence(i, [3 + i] * 48, SamplingParams(max_tokens=52), arrival=float(i)) for i in range(8)]
    for q in seqs:
        s.add(q)
    while s.has_work():
        b = s.schedule()
        s.commit(b)
        for it in b.items:
            held = [len([x for x in t if x >= 0]) for t in it.seq.tables]
            assert held[0] == -(-it.seq.num_computed // BS) and max(held[1:]) <= BOUND + 16 // BS
            if it.samples:
                it.seq.output_ids.append(7)
                if len(it.seq.output_ids) == 52:
                    s.finish(it.seq, "length")
    assert s.num_preemptions > 0 and all(len(q.output_ids) == 52 for q in seqs)
    assert alloc.num_used == 0


def test_a_request_is_refused_only_when_it_cannot_fit_alone():
    from app.errors import InvalidRequest
    from app.replica.engine_config import EngineConfig, check_request

    lay = KVLayout.of((WINDOW, None))
    cfg = EngineConfig(max_model_len=512, num_kv_blocks=60, block_size=BS, max_num_batched_tokens=16)
    # 200 tokens: 50 global blocks + a sliding window and one chunk (7); 120 blocks of one layer in the pool
    check_request([5] * 100, SamplingParams(max_tokens=100), cfg, 300, lay)
    with pytest.raises(InvalidRequest, match="needs 127 KV blocks but the cache has 120"):
        check_request([5] * 100, SamplingParams(max_tokens=380), cfg, 300, lay)
    with pytest.raises(
        InvalidRequest, match="needs 50 KV blocks but the cache has 20"
    ):  # no layout: as before
        check_request([5] * 100, SamplingParams(max_tokens=100), EngineConfig(512, 20, BS), 300)


def test_long_sequences_match_hf_with_chunks_preemption_and_prefix_hits(gemma):
    model_dir, adapters, peft = gemma
    prompts, ids = _requests(6, 11, 30, 70)
    refs = _refs(peft, prompts, ids, 40)
    # pool: 30 blocks of six layers = 90 blocks of two; six sequences of up to 110 tokens need ~34 each
    with _kernel(model_dir, adapters, num_kv_blocks=30) as k:
        first = k.complete(prompts, ids, max_tokens=40, ignore_eos=True)
        assert k.engine.scheduler.num_preemptions > 0
        # a conversation goes on: a prompt that extends an earlier one and its answer reuses the global blocks
        # and the sliding window before its end (greedy: the answer's continuation is the rest of it)
        alone = k.complete(prompts[:1], ids[:1], max_tokens=40, ignore_eos=True)
        hits = k.engine.allocator.hits
        again = k.complete([prompts[0] + refs[0][:30]], ids[:1], max_tokens=10, ignore_eos=True)
        # every full block before its end
        assert k.engine.allocator.hits - hits == (len(prompts[0]) + 29) // BS
        assert k.engine.allocator.num_used == 0  # every block back in the pool (or the prefix cache)
    assert [o.token_ids for o in first] == refs
    assert alone[0].token_ids == refs[0] and again[0].token_ids == refs[0][30:]


def test_sliding_blocks_stay_bounded_and_freeing_lets_every_sequence_run_at_once(gemma):
    """Four sequences of 100 tokens: without freeing each holds 3 groups x 25 blocks (300 for the four); the pool
    has 138. All four decode together, no preemption, and a decoding sequence's sliding groups never hold more
    than BOUND blocks while its global group grows to 25."""
    model_dir, adapters, peft = gemma
    prompts, ids = _requests(4, 5, 48, 48)
    refs = _refs(peft, prompts, ids, 52)
    seen = []  # (tokens so far, global blocks held, [sliding blocks held], sequences running, pool used)

    with _kernel(model_dir, adapters, num_kv_blocks=46) as k:
        pool = k.engine.allocator.num_blocks
        assert pool == 138 and 4 * 3 * 25 > pool
        sched, alloc = k.engine.scheduler, k.engine.allocator

        def measure(seq):
            if seq.output_ids:  # a decode step: this step's block is allocated, nothing freed yet
                held = [len([b for b in t if b >= 0]) for t in seq.tables]
                seen.append((seq.num_tokens, held[0], held[1:], len(sched.running), alloc.num_used))

        k.set_fault_hook(measure)
        outs = k.complete(prompts, ids, max_tokens=52, ignore_eos=True)
        assert sched.num_preemptions == 0
    assert [o.token_ids for o in outs] == refs
    assert max(r for *_, r, _ in seen) == 4  # all four decoding at once
    for n, glob, sliding, _, _ in seen:
        assert glob == -(-n // BS)
        assert len(sliding) == 2 and max(sliding) <= BOUND
    assert max(g for _, g, *_ in seen) == 25
    assert max(u for *_, u in seen) <= pool
