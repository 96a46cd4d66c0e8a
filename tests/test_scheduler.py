"""Scheduler and block allocator, pure Python: no tensors, no model. Every scheduling test runs under both
admission policies: with one tenant (these tests' requests have none) VTC admits in arrival order, as FCFS does.
Fairness between tenants is tests/test_fairness.py's."""

import pytest

from app.replica.fairness import make_policy
from app.replica.kv_cache import BlockAllocator
from app.replica.scheduler import Scheduler, SchedulerConfig
from app.replica.sequence import Sequence, Status
from app.sampling_params import SamplingParams


def seq(i, n_prompt, max_tokens=4, adapter=None):
    return Sequence(
        i,
        list(range(1, n_prompt + 1)),
        SamplingParams(max_tokens=max_tokens),
        arrival=float(i),
        adapter=adapter,
    )


def run_step(s: Scheduler, token=7):
    b = s.schedule()
    s.commit(b)
    for it in b.items:
        if it.samples:
            it.seq.output_ids.append(token)
            if len(it.seq.output_ids) >= it.seq.params.max_tokens:
                s.finish(it.seq, "length")
    return b


def make(num_blocks=64, bs=4, max_batch=8, budget=32, caching=True, policy="fcfs", **hooks):
    alloc = BlockAllocator(num_blocks, bs, caching)
    return Scheduler(
        SchedulerConfig(max_batch, budget, bs), alloc, policy=make_policy(policy), **hooks
    ), alloc


policies = pytest.mark.parametrize("policy", ["fcfs", "vtc"])


@policies
def test_budget_and_batch_size_respected(policy):
    s, _ = make(max_batch=3, budget=10, policy=policy)
    for i in range(6):
        s.add(seq(i, 8))
    b = s.schedule()
    assert b.num_tokens <= 10
    assert len(s.running) <= 3
    # chunked prefill: first sequence gets 8, the second the remaining 2 of the budget
    assert [(it.seq.seq_id, it.num_tokens) for it in b.items] == [(0, 8), (1, 2)]
    s.commit(b)
    for _ in range(50):
        b = run_step(s)
        assert b.num_tokens <= 10 and len(s.running) <= 3
    assert not s.has_work()


@policies
def test_preemption_takes_newest_and_nothing_is_lost(policy):
    s, alloc = make(num_blocks=6, bs=4, max_batch=8, budget=64, policy=policy)
    seqs = [seq(i, 7, max_tokens=6) for i in range(3)]
    for x in seqs:
        s.add(x)
    preempted = []
    for _ in range(100):
        b = run_step(s)
        preempted += [p.seq_id for p in b.preempted]
        if not s.has_work():
            break
    assert preempted and preempted[0] == 2  # the newest goes first
    assert all(x.status is Status.FINISHED and len(x.output_ids) == 6 for x in seqs)
    assert alloc.num_used == 0


@policies
def test_no_starvation_oldest_finishes_first_under_pressure(policy):
    s, _ = make(num_blocks=8, bs=4, max_batch=4, budget=16, policy=policy)
    seqs = [seq(i, 6, max_tokens=5) for i in range(10)]
    for x in seqs:
        s.add(x)
    order = []
    for _ in range(500):
        run_step(s)
        order += [x.seq_id for x in seqs if x.is_finished and x.seq_id not in order]
        if not s.has_work():
            break
    assert sorted(order) == list(range(10))
    assert order[0] == 0 and order.index(0) < order.index(9)


@policies
def test_abort_frees_blocks(policy):
    s, alloc = make(policy=policy)
    a, b = seq(0, 10), seq(1, 10)
    s.add(a)
    s.add(b)
    run_step(s)
    assert alloc.num_used > 0
    s.abort(a)
    s.abort(b)
    assert alloc.num_used == 0 and a.finish_reason == "abort" and not s.has_work()


@policies
def test_prefix_cache_hits_only_same_adapter(policy):
    s, alloc = make(bs=4, policy=policy)
    first = seq(0, 13, max_tokens=1)
    s.add(first)
    while s.has_work():
        run_step(s)
    same = seq(1, 13, max_tokens=1)
    other = seq(2, 13, max_tokens=1, adapter="sql@1")
    s.add(same)
    b = s.schedule()
    assert b.items[0].start == 12  # three full blocks reused, the last token recomputed
    s.add(other)
    b2 = s.schedule()
    assert [it.start for it in b2.items if it.seq is other] == [0]


@policies
def test_admit_hook_skips_cold_adapter_without_blocking_queue(policy):
    ready = {"hot"}
    released = []
    s, _ = make(
        admit=lambda q: q.adapter in ready or q.adapter is None, release=released.append, policy=policy
    )
    cold, hot = seq(0, 5), seq(1, 5)
    cold.adapter, hot.adapter = "cold", "hot"
    s.add(cold)
    s.add(hot)
    b = s.schedule()
    assert [it.seq for it in b.items] == [hot] and cold in s.waiting
    ready.add("cold")
    s.commit(b)
    b = s.schedule()
    assert cold in [it.seq for it in b.items]


def test_token_range_reads_prompt_and_output_without_joining():
    s = seq(0, 5)
    s.output_ids = [100, 101, 102]
    for start in range(8):
        for stop in range(start, 9):
            assert s.token_range(start, stop) == s.all_ids[start:stop]
