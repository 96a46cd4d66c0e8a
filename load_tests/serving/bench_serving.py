"""Load-test any OpenAI-compatible server (LoRA-Land, vLLM, LoRAX) through /v1/completions: TTFT, TPOT,
throughput, errors, per adapter; sweeps over the number of adapters and a base-model baseline.
Run: ./run bench serving [--help]. Method and results: load_tests/serving/RESULTS.md."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

from load_tests.harness import client as cl
from load_tests.harness import report, stats
from load_tests.harness.workload import (
    Popularity,
    RequestSpec,
    build_workload,
    parse_length,
    parse_popularity,
)

SCHEMA_VERSION = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m load_tests.serving.bench_serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = ap.add_argument_group("server")
    s.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="OpenAI API root, with /v1 (default %(default)s)",
    )
    s.add_argument("--model", required=True, help="the base model's name on the server (its `model` field)")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per request before it counts as a timeout (default %(default)s)",
    )
    w = ap.add_argument_group("workload")
    w.add_argument("--adapters", default=None, help="comma-separated adapter names")
    w.add_argument(
        "--adapter-prefix", default=None, help="adapters are PREFIX0 .. PREFIX{N-1} (with --num-adapters)"
    )
    w.add_argument(
        "--num-adapters",
        default=None,
        help="how many adapters (the first N); a comma list such as 1,10,100,200 sweeps, one run each",
    )
    w.add_argument(
        "--popularity",
        default=None,
        help="uniform | zipf:ALPHA | distinct | identical | base (default: uniform with adapters, else base)",
    )
    w.add_argument(
        "--baseline", action="store_true", help="also run the base model alone first and report the change"
    )
    w.add_argument("--num-requests", type=int, default=64, help="requests per run (default %(default)s)")
    w.add_argument(
        "--prompt-len",
        default="128",
        help="prompt tokens: N | N:uniform[:R] | N:normal:SD | N:exp (default %(default)s)",
    )
    w.add_argument(
        "--output-len", default="64", help="output tokens, same forms as --prompt-len (default %(default)s)"
    )
    w.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="text = N words 'w123 ...' (N bench tokens); ids = a list of token ids (default %(default)s)",
    )
    w.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds prompts, lengths, adapter choice, arrivals (default %(default)s)",
    )
    w.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature sent (default %(default)s)"
    )
    w.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    w.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream (SSE) so TTFT/TPOT are measured (default on); --no-stream times whole answers only",
    )
    lo = ap.add_argument_group("load")
    lo.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight at once (default 64 without --rate; with --rate, a cap)",
    )
    lo.add_argument(
        "--rate", type=float, default=None, help="Poisson arrivals at RATE requests/s (open loop)"
    )
    lo.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="short untimed requests on the base model before the runs (default %(default)s)",
    )
    lo.add_argument(
        "--warmup-runs",
        type=int,
        default=0,
        help="untimed passes of each run's whole workload (same shapes and adapters, other prompts) before "
        "it is measured: for servers that compile per shape (vLLM CPU) or to measure warm adapters "
        "(default %(default)s)",
    )
    lo.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measured passes of each run, interleaved (base, A, B, base, A, B, ...) so that a drift in the "
        "machine's speed hits every run alike; a run's numbers pool its passes' requests and wall times "
        "(default %(default)s)",
    )
    o = ap.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    o.add_argument(
        "--plot-dir",
        type=Path,
        default=None,
        help="write latency_cdf.png (and throughput_vs_adapters.png) here",
    )
    o.add_argument("--label", default=None, help="prefix for run labels, e.g. the server's name")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    try:
        a.prompt_dist, a.output_dist = parse_length(a.prompt_len), parse_length(a.output_len)
        a.pop = parse_popularity(a.popularity or ("uniform" if (a.adapters or a.adapter_prefix) else "base"))
        a.extra = json.loads(a.extra_body) if a.extra_body else {}
        if not isinstance(a.extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        a.sweep = _sweep(a)
    except (ValueError, json.JSONDecodeError) as e:
        ap.error(str(e))
    if (
        a.num_requests < 1
        or a.repeats < 1
        or (a.concurrency is not None and a.concurrency < 1)
        or (a.rate is not None and a.rate <= 0)
    ):
        ap.error("--num-requests, --repeats and --concurrency must be at least 1 and --rate positive")
    if a.rate is None and a.concurrency is None:
        a.concurrency = 64
    return a


def _sweep(a: argparse.Namespace) -> list[tuple[int, list[str]]]:
    """(number of adapters, their names) per run; [(0, [])] for the base model."""
    if a.pop.kind == "base":
        return [(0, [])]
    counts = [int(x) for x in a.num_adapters.split(",")] if a.num_adapters else None
    if a.adapters:
        names = [x for x in a.adapters.split(",") if x]
        counts = counts or [len(names)]
        if max(counts) > len(names):
            raise ValueError(
                f"--num-adapters {max(counts)} is more than the {len(names)} names in --adapters"
            )
        return [(n, names[:n]) for n in counts]
    if a.adapter_prefix is None or counts is None:
        raise ValueError(f"popularity {a.pop} needs --adapters, or --adapter-prefix with --num-adapters")
    if min(counts) < 1:
        raise ValueError("--num-adapters must be at least 1")
    return [(n, [f"{a.adapter_prefix}{i}" for i in range(n)]) for n in counts]


async def _one_pass(a, cfg: cl.ClientConfig, label: str, specs: list[RequestSpec]) -> tuple[list, float]:
    from tqdm import tqdm

    bar = tqdm(total=len(specs), desc=label, unit="req", file=sys.stderr, disable=a.no_progress, leave=True)
    failed = 0

    def done(rec: cl.RequestRecord) -> None:
        nonlocal failed
        failed += not rec.ok
        bar.update(1)
        if failed:
            bar.set_postfix(errors=failed)

    try:
        return await cl.run_requests(cfg, specs, a.concurrency, done)
    finally:
        bar.close()


def _run_result(label: str, pop: str, n_adapters: int, passes: list[tuple[list, float]]) -> dict:
    """One run's numbers from its measured passes: requests pooled, wall times summed."""
    records = [r for recs, _ in passes for r in recs]
    return {
        "label": label,
        "popularity": pop,
        "num_adapters": n_adapters,
        "passes": len(passes),
        "pass_tokens_per_s": [stats.summarize(recs, d)["output_tokens_per_s"] for recs, d in passes],
        "summary": stats.summarize(records, sum(d for _, d in passes)),
        "per_adapter": stats.per_adapter(records),
        "requests": [report.record_json(r) for r in records],
    }


async def _warmup(a, cfg: cl.ClientConfig) -> None:
    if a.warmup <= 0:
        return
    specs = build_workload(
        base=a.model,
        adapters=[],
        popularity=parse_popularity("base"),
        num_requests=a.warmup,
        prompt_len=parse_length("8"),
        output_len=parse_length("2"),
        prompt_format=a.prompt_format,
        seed=a.seed + 1,
    )
    records, _ = await cl.run_requests(cfg, specs, a.concurrency)
    bad = [r for r in records if not r.ok]
    if bad:
        print(
            f"bench_serving: warning: warm-up request failed ({bad[0].error_kind}: {bad[0].error_detail})",
            file=sys.stderr,
        )


def _specs(a: argparse.Namespace, names: list[str], pop: Popularity, salt: str) -> list[RequestSpec]:
    return build_workload(
        base=a.model,
        adapters=names,
        popularity=pop,
        num_requests=a.num_requests,
        prompt_len=a.prompt_dist,
        output_len=a.output_dist,
        prompt_format=a.prompt_format,
        rate=a.rate,
        seed=a.seed,
        prompt_salt=salt,
    )


async def run(a: argparse.Namespace) -> dict:
    cfg = cl.ClientConfig(a.base_url, a.api_key, a.stream, a.timeout, a.temperature, a.extra)
    listed = await cl.probe(cfg)
    await _warmup(a, cfg)
    prefix = f"{a.label} " if a.label else ""
    plan = [(0, [], parse_popularity("base"))] if a.baseline and a.pop.kind != "base" else []
    plan += [(n, names, a.pop) for n, names in a.sweep]
    labels = [prefix + ("base model" if pop.kind == "base" else f"{n} adapters {pop}") for n, _, pop in plan]
    for n, _, pop in plan:
        if pop.kind == "distinct" and a.num_requests > n:
            print(
                f"bench_serving: note: {a.num_requests} requests over {n} adapters: distinct repeats adapters",
                file=sys.stderr,
            )
    # Every pass gets its own prompts (same lengths, same adapter choices): a server's prefix cache must not
    # turn a later pass into cache hits on an earlier one's prompts.
    passes: list[list[tuple[list, float]]] = [[] for _ in plan]
    for i, ((_, names, pop), label) in enumerate(zip(plan, labels)):
        for k in range(a.warmup_runs):
            await _one_pass(a, cfg, f"{label} (warm-up {k + 1})", _specs(a, names, pop, f"-warm{i}-{k}"))
    for r in range(a.repeats):
        for i, ((_, names, pop), label) in enumerate(zip(plan, labels)):
            tag = f" (pass {r + 1}/{a.repeats})" if a.repeats > 1 else ""
            salt = f"-run{i}" if r == 0 else f"-run{i}-pass{r}"
            passes[i].append(await _one_pass(a, cfg, label + tag, _specs(a, names, pop, salt)))
    runs = [_run_result(label, str(pop), n, ps) for (n, _, pop), label, ps in zip(plan, labels, passes)]
    base = runs[0] if a.baseline and a.pop.kind != "base" else None
    config = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(a).items()
        if k not in ("prompt_dist", "output_dist", "pop", "extra", "sweep", "api_key")
    }
    return {
        "tool": "load_tests.serving.bench_serving",
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": config | {"api_key": "***" if a.api_key else None},
        "server_models_listed": len(listed),
        "runs": runs,
        "baseline": base["label"] if base else None,
        "comparisons": [
            {"run": r["label"], "vs": base["label"]} | stats.compare(base["summary"], r["summary"])
            for r in runs[1:]
        ]
        if base
        else [],
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        result = asyncio.run(run(a))
    except cl.ServerUnreachable as e:
        print(f"bench_serving: {e}", file=sys.stderr)
        return 2
    report.print_table(result)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    if a.plot_dir:
        for p in report.write_plots(result, a.plot_dir):
            print(f"wrote {p}")
    dead = [r["label"] for r in result["runs"] if r["summary"]["completed"] == 0]
    if dead:
        errs = result["runs"][[r["label"] for r in result["runs"]].index(dead[0])]["summary"]["errors"]
        print(f"bench_serving: every request of run {dead[0]!r} failed: {errs}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
