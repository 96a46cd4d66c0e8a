"""The benchmark suite's arithmetic: bench_cold's windows, headline's one table from the stages' JSON files.

bench_serving results come from the real tool run against the small OpenAI-shaped server of
tests/test_bench_serving.py, so the table is checked against the schema the tool really writes.
"""

from __future__ import annotations

import json
import math

import pytest

from load_tests import headline
from load_tests.serving import bench_cold, bench_serving
from load_tests.serving.bench_cold import Window, change_pct, load_times, window_stats
from tests.test_bench_serving import FakeOpenAI


def test_window_stats_itl_and_tpot_by_window():
    # Stream 1 decodes steadily every 0.1 s from t=0; stream 2 stalls 0.5 s inside the cold window.
    s1 = [i * 0.1 for i in range(11)]  # 0.0 .. 1.0
    s2 = [2.0, 2.1, 2.6, 2.7]
    s3 = [5.0]  # one token: no gaps, no TPOT
    wins = [Window("quiet", 0.0, 1.0), Window("cold_burst", 2.05, 2.65)]
    st = window_stats([s1, s2, s3], wins)
    q, c = st["quiet"], st["cold_burst"]
    assert q["seconds"] == pytest.approx(1.0) and c["seconds"] == pytest.approx(0.6)
    # quiet: s1's 10 gaps (each ends inside [0, 1]); TPOT of s1 = 0.1 s
    assert q["itl_ms"]["count"] == 10 and q["itl_ms"]["p50"] == pytest.approx(100.0)
    assert q["tpot_ms"]["count"] == 1 and q["tpot_ms"]["p50"] == pytest.approx(100.0)
    # cold: gaps ending at 2.1 (0.1 s) and 2.6 (0.5 s); s2's TPOT = 0.7 / 3 s
    assert c["itl_ms"]["count"] == 2 and c["itl_ms"]["max"] == pytest.approx(500.0)
    assert c["tpot_ms"]["p50"] == pytest.approx(700.0 / 3)


def test_change_pct_and_missing_windows():
    st = {"warm_burst": {"tpot_ms": {"p99": 200.0}}, "cold_burst": {"tpot_ms": {"p99": 230.0}}}
    assert change_pct(st, "warm_burst", "cold_burst") == pytest.approx(15.0)
    assert change_pct(st, "quiet", "cold_burst") is None
    assert change_pct({"warm_burst": {"tpot_ms": {"p99": 0.0}}}, "warm_burst", "cold_burst") is None


def test_load_times_read_from_the_replica_log(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text(
        "(ServeReplica pid=1) INFO loaded adapter cold3@1 from s3://b/cold3 in 0.04s\n"
        "noise\nloaded adapter qv1@2 from /store/qv1 in 1.50s\n"
    )
    assert load_times(log) == {"cold3@1": 0.04, "qv1@2": 1.5}
    assert load_times(tmp_path / "absent.log") == {}


def _cold_result() -> dict:
    streams = [[0.0, 0.1, 0.2, 0.3], [3.0, 3.1, 3.3, 3.4], [6.0, 6.1, 6.4, 6.5]]
    wins = [Window("quiet", 0.0, 0.3), Window("warm_burst", 3.0, 3.4), Window("cold_burst", 6.0, 6.5)]
    st = window_stats(streams, wins)
    probes = [
        {"adapter": f"cold{i}", "cold_ttft_ms": 100.0 + 10 * i, "warm_ttft_ms": 90.0} for i in range(1, 4)
    ]
    return {
        "config": {"rank": 24, "adapter_mb": 6.9, "burst": 10},
        "first_of_shape": {"adapter": "cold0", "ttft_ms": 300.0},
        "p5": {
            "probes": probes,
            "extra_ttft_ms": {"count": 3, "max": 40.0},
            "base_ttft_ms_median": 80.0,
            "replica_load_s": {"cold1@1": 0.02},
        },
        "interference": {
            "windows": st,
            "background_requests": 12,
            "background_failed": 0,
            "tpot_p99_cold_vs_warm_pct": change_pct(st, "warm_burst", "cold_burst"),
            "tpot_p99_cold_vs_quiet_pct": change_pct(st, "quiet", "cold_burst"),
            "itl_p99_cold_vs_warm_pct": change_pct(st, "warm_burst", "cold_burst", "itl_ms"),
        },
    }


def test_cold_report_lines():
    r = _cold_result()
    # TPOT warm = 0.4/3 s, cold = 0.5/3 s: +25%
    assert r["interference"]["tpot_p99_cold_vs_warm_pct"] == pytest.approx(25.0)
    text = bench_cold.report(r)
    assert "median 30.0 ms, max 40.0 ms over 3 adapters" in text
    assert "+25.0%" in text and "0 failed" in text


@pytest.fixture(scope="module")
def server():
    s = FakeOpenAI()
    yield s
    s.close()


def _serving(server, path, *args: str) -> dict:
    argv = ["--base-url", server.url, "--api-key", "secret", "--model", "base", "--num-requests", "6"]
    argv += [
        "--concurrency",
        "3",
        "--output-len",
        "4",
        "--prompt-len",
        "8",
        "--no-progress",
        "--out",
        str(path),
    ]
    assert bench_serving.main([*argv, *args]) == 0
    return json.loads(path.read_text())


def test_one_table_from_the_stages_json(server, tmp_path):
    out = tmp_path
    (out / "engine.json").write_text(
        json.dumps({"threads": 2, "rows": [{"dtype": "float32", "ours_tok_s": 120.0, "hf_tok_s": 80.0}]})
    )
    tok = {"base": 100.0, "qv": 98.0, "all7": 90.0, "peft_qv": 25.0, "distinct5": 99.0, "distinct1000": 97.0}
    (out / "lora.json").write_text(
        json.dumps({"threads": 2, "adapters": 3, "tok_s": tok, "p6_pools": 1.0, "p6_rss": 1.05})
    )
    srv = _serving(
        server, out / "serving.json", "--adapter-prefix", "a", "--num-adapters", "1,3", "--baseline"
    )
    vb = _serving(server, out / "vllm_base.json", "--popularity", "base")
    vl = _serving(
        server, out / "vllm_lora.json", "--adapter-prefix", "a", "--num-adapters", "3", "--baseline"
    )
    (out / "vllm.json").write_text(json.dumps({"dtype": "float32", "cpus": "0-1", "venv": "/v"}))
    (out / "cold.json").write_text(json.dumps(_cold_result()))

    rows = {name: (result, target) for name, result, target in headline.summary_rows(out)}
    assert rows["engine vs HF generate, float32"][0] == "120.0 vs 80.0 tok/s = 1.50x"
    assert rows["P1 3 q,v r16 adapters / base"] == ("98.0 / 100.0 = 0.980", ">= 0.97")
    assert rows["P2 ours / HF+PEFT mixed batch"][0].endswith("= 3.92x")
    assert rows["P4 1000 vs 5 distinct adapters"][0].endswith("2.0% drop")

    tps = {r["num_adapters"]: r["summary"]["output_tokens_per_s"] for r in srv["runs"]}
    vtps = vl["runs"][-1]["summary"]["output_tokens_per_s"]
    vbase = vb["runs"][0]["summary"]["output_tokens_per_s"]
    assert [r["popularity"] for r in srv["runs"]] == ["base", "uniform", "uniform"]
    assert rows["HTTP tok/s by number of adapters"][0] == f"1: {tps[1]:.1f}, 3: {tps[3]:.1f}"
    assert rows["P7 HTTP / engine-direct, q,v adapters"][0].endswith(f"= {tps[3] / 98.0:.2f}")
    assert rows["P3 ours / vLLM, both with adapters"] == (f"{tps[3] / vtps:.2f}x", ">= 5x")
    assert rows["ours with adapters / vLLM base only"][0] == f"{tps[3] / vbase:.2f}"
    seed = rows["seed: HTTP, 3 adapters uniform vs base, 64 conc."][0]
    change = srv["comparisons"][-1]["output_tokens_per_s_change_pct"]
    assert f"({change:+.1f}%)" in seed and math.isfinite(change)
    assert rows["P5 cold (S3) - warm TTFT, 6.9 MB adapter"][0] == "median 30.0 ms, max 40.0 ms (3 adapters)"
    assert rows["p99 TPOT while 10 cold loads run"][0].startswith("+25.0% vs the same burst warm")
    assert "vLLM CPU float32, cores 0-1, HTTP, tok/s" in rows

    headline.print_summary(headline.summary_rows(out))


def test_table_with_only_some_stages(tmp_path):
    assert headline.summary_rows(tmp_path) == []
    (tmp_path / "cold.json").write_text(json.dumps(_cold_result()))
    names = [r[0] for r in headline.summary_rows(tmp_path)]
    assert names == ["P5 cold (S3) - warm TTFT, 6.9 MB adapter", "p99 TPOT while 10 cold loads run"]


def test_unknown_stage_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        headline.main(["--only", "engine,warp"])
    assert e.value.code == 2 and "warp" in capsys.readouterr().err
