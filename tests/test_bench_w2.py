"""Workload W2's pure parts (load_tests/serving/bench_w2.py): the request mix and the arguments for vLLM's client."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path

import pytest

from load_tests.serving.bench_w2 import (
    ALL7,
    MIXES,
    QV,
    W2Config,
    adapter_mix,
    client_argv,
    make_requests,
    p8,
    popularity_order,
    summarize,
    sustained,
    write_dataset,
)


@pytest.fixture(scope="module")
def ranked() -> list[str]:
    return popularity_order([n for n, _, _ in adapter_mix()])


def test_adapter_mix_is_1000_named_adapters_of_three_ranks_and_target_sets():
    mix = adapter_mix()
    assert len(mix) == 1000 == len({n for n, _, _ in mix})
    assert {r for _, r, _ in mix} == {8, 16, 64}
    assert Counter(t for _, _, t in mix) == Counter(
        {QV: 600, ALL7: 150, ("q_proj", "k_proj", "v_proj", "o_proj"): 250}
    )
    assert sum(n for _, _, n in MIXES) == 1000
    assert mix[0][0] == "w2r8qv0" and mix[-1][0] == "w2r64all29"


def test_popularity_order_is_a_seeded_permutation_mixing_ranks(ranked):
    names = [n for n, _, _ in adapter_mix()]
    assert sorted(ranked) == sorted(names) and ranked != names
    assert ranked == popularity_order(names) and ranked != popularity_order(names, seed=1)
    hot = {n for n, _, _ in adapter_mix() if n in set(ranked[:50])}
    ranks = {r for n, r, _ in adapter_mix() if n in hot}
    assert ranks == {8, 16, 64}


def test_lengths_follow_the_w2_distributions(ranked):
    reqs = make_requests(W2Config(5000), ranked)
    p = [r.prompt_len for r in reqs]
    o = [r.output_len for r in reqs]
    assert min(p) >= 16 and max(p) <= 1024 and 185 <= statistics.median(p) <= 215
    # log-normal: the log of the unclipped middle is symmetric around log(200) with sigma 0.8
    logs = [math.log(x) for x in p if 16 < x < 1024]
    assert abs(statistics.stdev(logs) - 0.8) < 0.06
    assert sum(x == 1024 for x in p) > 0  # the tail is long enough to reach the clip
    assert min(o) >= 16 and max(o) <= 512 and abs(statistics.mean(o) - 264) < 8
    assert make_requests(W2Config(5000), ranked) == reqs  # seeded
    assert make_requests(W2Config(5000, seed=1), ranked) != reqs


def test_adapter_picks_are_zipf_over_the_ranking(ranked):
    n = 20000
    counts = Counter(r.adapter for r in make_requests(W2Config(n), ranked))
    h = sum(1 / k for k in range(1, 1001))
    for k in (1, 2, 10):
        expected = n / (k * h)
        assert abs(counts[ranked[k - 1]] - expected) < 4 * math.sqrt(expected), k
    assert counts[ranked[0]] > 5 * counts[ranked[9]] > 0
    assert len(counts) > 500  # the long tail is touched


def test_dataset_and_client_arguments_keep_request_order(tmp_path: Path, ranked):
    reqs = make_requests(W2Config(12), ranked)
    ds = write_dataset(reqs, tmp_path / "d.jsonl")
    rows = [json.loads(line) for line in ds.read_text().splitlines()]
    assert [len(r["prompt"].split()) for r in rows] == [r.prompt_len for r in reqs]
    words = [w for r in rows for w in r["prompt"].split(" ")]  # the bench vocabulary: one token per word
    assert all(w.startswith("w") and 3 <= int(w[1:]) < 32000 for w in words)
    assert [r["output_tokens"] for r in rows] == [r.output_len for r in reqs]

    argv = client_argv("http://127.0.0.1:8000", Path("/m"), ds, reqs, 0.5, tmp_path, "x.json")

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--dataset-name") == "custom" and value("--dataset-path") == str(ds)
    assert value("--num-prompts") == "12" and value("--custom-output-len") == "-1"
    assert {"--disable-shuffle", "--skip-chat-template", "--ignore-eos", "--save-detailed"} <= set(argv)
    assert (
        value("--request-rate") == "0.5" and value("--burstiness") == "1.0" and value("--temperature") == "0"
    )
    assert value("--base-url") == "http://127.0.0.1:8000" and value("--endpoint") == "/v1/completions"
    assert value("--lora-assignment") == "round-robin"
    i = argv.index("--lora-modules") + 1
    assert argv[i : i + 12] == [r.adapter for r in reqs]  # request k gets module k
    assert not argv[i + 12].startswith("w2r")
    assert value("--tokenizer") == "/m" and value("--model") == "base"
    assert "inf" in client_argv("u", Path("/m"), ds, reqs, math.inf, tmp_path, "x.json")


def test_base_only_requests_name_no_lora_modules(tmp_path: Path):
    """--adapters 0 (the real-model rows of issue 32): every request on the base model, the same lengths as with
    adapters, and the client is given no --lora-modules (vLLM would send them as model names)."""
    reqs = make_requests(W2Config(10), [])
    assert {r.adapter for r in reqs} == {"base"}
    ds = write_dataset(reqs, tmp_path / "d.jsonl")
    argv = client_argv("u", Path("/m"), ds, reqs, 1.0, tmp_path, "x.json")
    assert "--lora-modules" not in argv and "--lora-assignment" not in argv
    assert argv[argv.index("--model") + 1] == "base"


def test_sustained_means_late_requests_do_not_wait_longer():
    assert sustained([0.2, 0.3, 0.25, 0.4, 0.3, 0.2, 0.35, 0.3, 0.28])
    assert not sustained([0.2 + 2.0 * i for i in range(30)])
    assert sustained([5.0])


def _raw(n: int, tok_s: float, p99: float, ttfts: list[float]) -> dict:
    return {
        "num_prompts": n,
        "completed": n,
        "failed": 0,
        "duration": 10.0,
        "output_throughput": tok_s,
        "total_token_throughput": 2 * tok_s,
        "median_ttft_ms": 100.0,
        "p99_ttft_ms": p99,
        "median_tpot_ms": 50.0,
        "p99_tpot_ms": 80.0,
        "p99_e2el_ms": 9000.0,
        "total_output_tokens": 900,
        "ttfts": ttfts,
        "errors": [""] * len(ttfts),
    }


def _runs(*specs: tuple[str, float, float, float, bool]) -> list[dict]:
    """(server, rate, tok/s, p99 TTFT ms, queue flat) -> summaries; a growing queue's TTFTs climb 1 s a request."""
    return [
        summarize(
            _raw(9, tok_s, p99, [0.1 + (0 if flat else i) for i in range(9)]),
            rate,
            server,
            round(9 * tok_s / rate),
        )
        for server, rate, tok_s, p99, flat in specs
    ]


def test_a_server_that_delivers_too_little_of_the_offered_load_does_not_sustain_it():
    raw = _raw(9, 100, 300, [0.1] * 9)  # flat TTFTs: it admitted everything, and decode slowed down instead
    ok, slow = summarize(raw, 1.0, "ours", 9 * 110), summarize(raw, 1.0, "ours", 9 * 200)
    assert ok["offered_tok_s"] == 110 and ok["sustained"] and ok["ttft_flat"]
    assert (
        slow["offered_tok_s"] == 200 and slow["ttft_flat"] and not slow["keeps_up"] and not slow["sustained"]
    )


def test_p8_compares_at_the_highest_rate_vllm_sustains():
    runs = _runs(
        ("vllm", 0.5, 100, 500, True),
        ("vllm", 1.0, 150, 800, True),
        ("vllm", 2.0, 160, 9000, False),
        ("ours", 0.5, 100, 300, True),
        ("ours", 1.0, 300, 200, True),
        ("ours", 2.0, 320, 300, True),
    )
    assert [r["sustained"] for r in runs] == [True, True, False, True, True, True]
    assert p8(runs) == {
        "rate": 1.0,
        "vllm_sustained": True,
        "tok_s_ratio": 2.0,
        "ttft_p99_ratio": 0.25,
        "top_rate": 2.0,
        "top_tok_s_ratio": 2.0,
        "top_ttft_p99_ratio": 300 / 9000,
    }
    assert p8([r for r in runs if r["server"] == "ours"]) is None


def test_summary_rows_for_bench_all(tmp_path: Path):
    from load_tests.serving.bench_w2 import summary_rows

    assert summary_rows(tmp_path) == []
    runs = _runs(
        ("vllm", 0.5, 100, 500, True),
        ("vllm", 2.0, 160, 9000, False),
        ("ours", 0.5, 250, 200, True),
        ("ours", 2.0, 320, 300, True),
    )
    (tmp_path / "w2.json").write_text(json.dumps({"runs": runs, "p8": p8(runs)}))
    rows = summary_rows(tmp_path)
    assert [r[0] for r in rows] == [
        "W2 over HTTP at 0.5 req/s",
        "W2 over HTTP at 2 req/s",
        "P8 W2 ours / vLLM at 0.5 req/s",
        "W2 ours / vLLM at the top rate, 2 req/s",
    ]
    assert "vllm 160 tok/s, p99 TTFT 9.0 s (not sustained)" in rows[1][1]
    assert rows[2][1] == "tok/s 2.50x, p99 TTFT 0.40x"
