"""load_tests.serving.bench_serving against a small OpenAI-shaped server on 127.0.0.1 with known delays and faults.

The server (a raw asyncio HTTP/1.1 server in a thread) answers /v1/completions by the requested model's name:
err429 / err500 → that status; drop → one chunk then the connection closes mid-body; slow → no answer for
seconds; streamerr → an SSE error event; nodone → a clean end without [DONE]; nousage → no usage chunk;
short → half the requested tokens; anything else → max_tokens chunks, the first after FIRST s and each next
after GAP s.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from load_tests.harness import client as cl
from load_tests.harness import stats
from load_tests.harness.workload import (
    LengthDist,
    assign_models,
    build_workload,
    parse_length,
    parse_popularity,
    poisson_arrivals,
)
from load_tests.serving import bench_serving

FIRST, GAP = 0.08, 0.02
REPO = Path(__file__).resolve().parents[1]


class FakeOpenAI:
    def __init__(self, api_key: str = "secret"):
        self.api_key = api_key
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self.handle, "127.0.0.1", 0), self.loop
        ).result()
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def handle(self, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            lines = head.split("\r\n")
            method, path, _ = lines[0].split(" ")
            hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
            raw = await reader.readexactly(int(hdrs.get("content-length", 0)))
            if hdrs.get("authorization") != f"Bearer {self.api_key}":
                return await self.reply(w, 401, {"error": {"message": "bad key"}})
            if method == "GET" and path == "/v1/models":
                return await self.reply(w, 200, {"object": "list", "data": [{"id": "base"}]})
            body = json.loads(raw)
            self.bodies.append(body)
            self.auth.append(hdrs.get("authorization"))
            await self.complete(w, body)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def reply(self, w, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        w.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + data
        )
        await w.drain()

    async def complete(self, w, body: dict) -> None:
        model, n = body["model"], body["max_tokens"]
        if model in ("err429", "err500"):
            return await self.reply(w, int(model[3:]), {"error": {"message": model}})
        if model == "slow":
            await asyncio.sleep(5)
        if model == "short":
            n = max(1, n // 2)
        if not body.get("stream"):
            await asyncio.sleep(FIRST + GAP * (n - 1))
            return await self.reply(
                w,
                200,
                {
                    "choices": [{"text": " w5" * n, "index": 0}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n},
                },
            )
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n"
        )

        async def event(data: str) -> None:
            b = f"data: {data}\n\n".encode()
            w.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
            await w.drain()

        for i in range(n):
            await asyncio.sleep(FIRST if i == 0 else GAP)
            if model == "streamerr" and i == 1:
                return await event(json.dumps({"error": {"message": "engine died"}}))
            await event(json.dumps({"choices": [{"index": 0, "text": f" w{i + 3}", "finish_reason": None}]}))
            if model == "drop":
                return  # close without the terminating chunk: the client sees a broken body
        if body.get("stream_options", {}).get("include_usage") and model != "nousage":
            await event(json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}}))
        if model != "nodone":
            await event("[DONE]")
        w.write(b"0\r\n\r\n")
        await w.drain()


@pytest.fixture(scope="module")
def server():
    s = FakeOpenAI()
    yield s
    s.close()


def bench(server, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "r.json"
    rc = bench_serving.main(
        [
            "--base-url",
            server.url,
            "--model",
            "base",
            "--api-key",
            "secret",
            "--no-progress",
            "--warmup",
            "0",
            "--out",
            str(out),
            *args,
        ]
    )
    return rc, json.loads(out.read_text()) if out.exists() else {}


# ---- percentile maths ---------------------------------------------------------------------------------------


def test_percentile_hand_computed():
    assert stats.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert stats.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # pos 2.7 → 3 + 0.7
    assert stats.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert stats.percentile([40, 15, 50, 35, 20], 40) == pytest.approx(29.0)  # sorted; pos 1.6 → 20 + 0.6*15
    assert stats.percentile([7], 99) == 7
    assert stats.percentile([3, 1], 0) == 1 and stats.percentile([3, 1], 100) == 3
    assert stats.percentile([], 50) is None
    with pytest.raises(ValueError):
        stats.percentile([1], 101)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    for n in (2, 3, 10, 101):
        xs = [rng.random() for _ in range(n)]
        for q in (1, 50, 90, 99):
            assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summary_arithmetic_from_records():
    recs = []
    for i, (ttft, e2e, n) in enumerate([(0.1, 0.5, 5), (0.2, 1.0, 9), (0.3, 0.3, 1)]):
        r = cl.RequestRecord(
            i, f"a{i % 2}", prompt_len=10, max_tokens=9, ok=True, ttft=ttft, e2e=e2e, output_tokens=n
        )
        recs.append(r)
    recs.append(cl.RequestRecord(3, "a1", 10, 9, ok=False, error_kind="http_500", e2e=0.01))
    s = stats.summarize(recs, duration=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["output_tokens_per_s"] == pytest.approx(15 / 2.0)
    assert s["requests_per_s"] == pytest.approx(1.5)
    assert s["input_tokens_per_s"] == pytest.approx(30 / 2.0)
    assert s["tpot_ms"]["count"] == 2  # one token has no TPOT
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 100) / 2)  # (0.5-0.1)/4 and (1.0-0.2)/8
    assert s["e2e_ms"]["p50"] == pytest.approx(500)
    assert s["length_mismatches"] == 2
    assert s["errors"] == {"http_500": 1}
    pa = stats.per_adapter(recs)
    assert pa["a1"] == {
        "requests": 2,
        "completed": 1,
        "failed": 1,
        "output_tokens": 9,
        "e2e_ms_mean": pytest.approx(1000),
    }
    c = stats.compare(s, s | {"output_tokens_per_s": 7.5 * 0.97})
    assert c["output_tokens_per_s_change_pct"] == pytest.approx(-3.0) and c["e2e_p99_change_ms"] == 0


# ---- workload -----------------------------------------------------------------------------------------------


def test_popularity_distributions():
    names = [f"a{i}" for i in range(200)]
    rng = random.Random(0)
    assert len(set(assign_models(parse_popularity("distinct"), "B", names, 200, rng))) == 200
    assert set(assign_models(parse_popularity("identical"), "B", names, 50, rng)) == {"a0"}
    assert set(assign_models(parse_popularity("base"), "B", names, 50, rng)) == {"B"}
    uni = Counter(assign_models(parse_popularity("uniform"), "B", names, 20000, rng))
    assert len(uni) == 200 and max(uni.values()) < 3 * 100
    z = Counter(assign_models(parse_popularity("zipf:1.1"), "B", names, 20000, rng))
    h = sum(1 / k**1.1 for k in range(1, 201))
    assert z["a0"] / 20000 == pytest.approx(1 / h, rel=0.08)  # ~0.20 of all requests on the top adapter
    assert z["a0"] / z["a1"] == pytest.approx(2**1.1, rel=0.15)
    assert z["a0"] > 10 * uni["a0"]
    with pytest.raises(ValueError, match="needs adapters"):
        assign_models(parse_popularity("uniform"), "B", [], 3, rng)
    with pytest.raises(ValueError):
        parse_popularity("pareto")


def test_lengths_and_workload_are_seeded():
    assert parse_length("128") == LengthDist(128)
    rng = random.Random(0)
    u = [parse_length("100:uniform:10").sample(rng) for _ in range(2000)]
    assert min(u) >= 90 and max(u) <= 110 and abs(sum(u) / len(u) - 100) < 1.5
    e = [parse_length("50:exp").sample(rng) for _ in range(4000)]
    assert min(e) >= 1 and abs(sum(e) / len(e) - 50) < 4
    with pytest.raises(ValueError):
        parse_length("12:zipf")
    kw = dict(
        base="B",
        adapters=["x", "y"],
        num_requests=5,
        prompt_len=LengthDist(6),
        output_len=LengthDist(3),
        seed=4,
    )
    a = build_workload(popularity=parse_popularity("uniform"), **kw)
    b = build_workload(popularity=parse_popularity("base"), **kw)
    assert [s.prompt for s in a] == [s.prompt for s in b]  # popularity does not change the prompts
    c = build_workload(popularity=parse_popularity("base"), prompt_salt="-run1", **kw)
    assert [s.prompt_len for s in c] == [s.prompt_len for s in a] and c[0].prompt != a[0].prompt
    assert all(len(s.prompt.split()) == 6 and s.prompt.startswith("w") for s in a)
    ids = build_workload(popularity=parse_popularity("base"), prompt_format="ids", **kw)
    assert all(len(s.prompt) == 6 and all(3 <= t < 32000 for t in s.prompt) for s in ids)
    arr = poisson_arrivals(10.0, 4001, random.Random(0))
    assert arr[0] == 0 and arr[-1] / 4000 == pytest.approx(0.1, rel=0.06)


# ---- against the server -------------------------------------------------------------------------------------


def test_timings_tokens_and_request_body(server, tmp_path):
    n_before = len(server.bodies)
    rc, res = bench(
        server,
        tmp_path,
        "--adapters",
        "okA,okB",
        "--popularity",
        "uniform",
        "--num-requests",
        "8",
        "--concurrency",
        "4",
        "--prompt-len",
        "12",
        "--output-len",
        "6",
        "--prompt-format",
        "ids",
    )
    assert rc == 0
    s = res["runs"][0]["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"], s["length_mismatches"]) == (8, 0, 48, 0)
    assert s["output_tokens_per_s"] == pytest.approx(48 / s["duration_s"])
    assert s["requests_per_s"] == pytest.approx(8 / s["duration_s"])
    e2e = FIRST + 5 * GAP
    assert 2 * e2e - 0.005 <= s["duration_s"] < 2 * e2e + 0.25  # two waves of 4
    for r in res["runs"][0]["requests"]:
        assert FIRST * 1000 - 3 <= r["ttft_ms"] <= FIRST * 1000 + 60
        assert GAP * 1000 - 3 <= r["tpot_ms"] <= GAP * 1000 + 15
        assert e2e * 1000 - 3 <= r["e2e_ms"] <= e2e * 1000 + 100
        assert r["tokens_source"] == "usage"
    assert s["itl_ms"]["count"] == 8 * 5 and s["itl_ms"]["p50"] == pytest.approx(GAP * 1000, abs=10)
    bodies = server.bodies[n_before:]
    assert len(bodies) == 8 and set(server.auth[n_before:]) == {"Bearer secret"}
    for b in bodies:
        assert b["ignore_eos"] is True and b["max_tokens"] == 6 and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
        assert len(b["prompt"]) == 12 and all(isinstance(t, int) for t in b["prompt"])
    assert sum(a["requests"] for a in res["runs"][0]["per_adapter"].values()) == 8


def test_error_accounting_by_kind(server, tmp_path):
    models = "okC,err429,err500,drop,slow,streamerr,nodone,nousage,short"
    rc, res = bench(
        server,
        tmp_path,
        "--adapters",
        models,
        "--popularity",
        "distinct",
        "--num-requests",
        "18",
        "--concurrency",
        "18",
        "--output-len",
        "4",
        "--timeout",
        "0.6",
    )
    assert rc == 0
    s = res["runs"][0]["summary"]
    assert s["errors"] == {
        "http_429": 2,
        "http_500": 2,
        "connection": 2,
        "timeout": 2,
        "stream_error": 2,
        "incomplete_stream": 2,
    }
    assert (s["completed"], s["failed"]) == (6, 12)
    assert s["length_mismatches"] == 2  # "short" answered 2 of 4 tokens
    pa = res["runs"][0]["per_adapter"]
    assert pa["err429"] == {
        "requests": 2,
        "completed": 0,
        "failed": 2,
        "output_tokens": 0,
        "e2e_ms_mean": None,
    }
    by_model = {r["model"]: r for r in res["runs"][0]["requests"]}
    assert by_model["nousage"]["tokens_source"] == "chunks" and by_model["nousage"]["output_tokens"] == 4
    assert by_model["short"]["output_tokens"] == 2
    assert "err429" in by_model["err429"]["error_detail"]
    assert s["output_tokens"] == 4 + 4 + 2 + 4 + 4 + 2


def test_rate_mode_follows_poisson_schedule(server):
    specs = build_workload(
        base="base",
        adapters=[],
        popularity=parse_popularity("base"),
        num_requests=6,
        prompt_len=LengthDist(4),
        output_len=LengthDist(2),
        rate=20.0,
        seed=3,
    )
    cfg = cl.ClientConfig(server.url, "secret")
    recs, dur = asyncio.run(cl.run_requests(cfg, specs, None))
    assert all(r.ok for r in recs)
    for spec, r in zip(specs, recs, strict=True):
        assert spec.send_at - 0.002 <= r.start <= spec.send_at + 0.05
    assert dur >= specs[-1].send_at + FIRST + GAP - 0.005


def test_no_stream_times_whole_answers(server, tmp_path):
    rc, res = bench(server, tmp_path, "--num-requests", "3", "--output-len", "5", "--no-stream")
    assert rc == 0
    r = res["runs"][0]["requests"][0]
    assert r["ttft_ms"] is None and r["output_tokens"] == 5 and r["tokens_source"] == "usage"
    assert r["e2e_ms"] >= (FIRST + 4 * GAP) * 1000 - 3
    assert res["runs"][0]["popularity"] == "base" and res["runs"][0]["summary"]["ttft_ms"]["count"] == 0


def test_sweep_json_schema_and_plots(server, tmp_path, capsys):
    plots = tmp_path / "plots"
    rc, res = bench(
        server,
        tmp_path,
        "--adapter-prefix",
        "qv",
        "--num-adapters",
        "1,2,4",
        "--baseline",
        "--popularity",
        "zipf:1.1",
        "--num-requests",
        "8",
        "--concurrency",
        "8",
        "--output-len",
        "3",
        "--plot-dir",
        str(plots),
        "--label",
        "fake",
    )
    assert rc == 0
    assert res["tool"] == "load_tests.serving.bench_serving" and res["schema_version"] == 1
    assert res["config"]["api_key"] == "***" and res["config"]["concurrency"] == 8
    assert [r["num_adapters"] for r in res["runs"]] == [0, 1, 2, 4]
    assert res["baseline"] == "fake base model"
    assert [c["run"] for c in res["comparisons"]] == [
        "fake 1 adapters zipf:1.1",
        "fake 2 adapters zipf:1.1",
        "fake 4 adapters zipf:1.1",
    ]
    for c in res["comparisons"]:
        assert set(c) >= {"output_tokens_per_s_change_pct", "e2e_p99_change_ms", "ttft_p99_change_ms"}
    for run in res["runs"]:
        assert set(run) == {
            "label",
            "popularity",
            "num_adapters",
            "passes",
            "pass_tokens_per_s",
            "summary",
            "per_adapter",
            "requests",
        }
        assert set(run["summary"]) >= {
            "requests_per_s",
            "output_tokens_per_s",
            "ttft_ms",
            "tpot_ms",
            "e2e_ms",
            "errors",
            "duration_s",
        }
        assert set(run["summary"]["e2e_ms"]) == {"count", "mean", "min", "max", "p50", "p90", "p99"}
        assert set(run["per_adapter"]) <= {"base"} | {f"qv{i}" for i in range(run["num_adapters"])}
        assert len(run["requests"]) == 8
    assert set(res["runs"][3]["per_adapter"]) <= {"qv0", "qv1", "qv2", "qv3"}
    for name in ("latency_cdf.png", "throughput_vs_adapters.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    table = capsys.readouterr().out
    assert "fake 4 adapters zipf:1.1" in table and "vs fake base model" in table


def test_bad_api_key_and_unreachable_exit_nonzero(server, tmp_path, capsys):
    rc = bench_serving.main(
        ["--base-url", server.url, "--model", "base", "--api-key", "wrong", "--no-progress"]
    )
    assert rc == 2 and "refused the API key" in capsys.readouterr().err
    with socket.socket() as sk:  # a port nobody listens on
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "load_tests.serving.bench_serving",
            "--model",
            "m",
            "--base-url",
            f"http://127.0.0.1:{port}/v1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_serving: cannot reach") and str(port) in lines[0]


def test_all_failed_exits_1(server, tmp_path, capsys):
    rc, res = bench(server, tmp_path, "--adapters", "err500", "--num-requests", "2")
    assert rc == 1 and res["runs"][0]["summary"]["errors"] == {"http_500": 2}
    assert "every request" in capsys.readouterr().err


def test_bad_arguments_exit_2():
    for args in (
        ["--popularity", "zipf"],
        ["--popularity", "uniform"],
        ["--prompt-len", "x"],
        ["--adapters", "a,b", "--num-adapters", "3"],
    ):
        with pytest.raises(SystemExit) as e:
            bench_serving.parse_args(["--model", "m", *args])
        assert e.value.code == 2
    a = bench_serving.parse_args(["--model", "m", "--rate", "5"])
    assert a.concurrency is None and a.pop.kind == "base" and not math.isnan(a.rate)


def test_repeats_interleave_passes_and_pool_them(server, tmp_path):
    n0 = len(server.bodies)
    rc, res = bench(
        server, tmp_path, "--adapter-prefix", "a", "--num-adapters", "2", "--baseline", "--repeats", "2",
        "--num-requests", "4", "--concurrency", "4", "--output-len", "3",
    )  # fmt: skip
    assert rc == 0 and [r["passes"] for r in res["runs"]] == [2, 2]
    for run in res["runs"]:
        s = run["summary"]
        assert s["requests"] == 8 and s["completed"] == 8 and len(run["requests"]) == 8
        # pooled: all passes' tokens over the sum of their wall times, so between the passes' own rates
        rates = run["pass_tokens_per_s"]
        assert len(rates) == 2 and min(rates) - 1e-6 <= s["output_tokens_per_s"] <= max(rates) + 1e-6
        assert s["output_tokens_per_s"] == pytest.approx(8 * 3 / s["duration_s"])
    # interleaved (base, adapters, base, adapters), and each pass drew its own prompts
    bodies = server.bodies[n0:]
    assert [b["model"] == "base" for b in bodies[::4]] == [True, False, True, False]
    assert len({str(b["prompt"]) for b in bodies}) == 16
