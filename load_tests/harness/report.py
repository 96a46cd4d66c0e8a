"""The human and machine outputs of bench_serving: per-request JSON rows, the printed table, the plots."""

from __future__ import annotations

import sys
from pathlib import Path

from load_tests.harness.client import RequestRecord


def record_json(r: RequestRecord) -> dict:
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    return {
        "index": r.index,
        "model": r.model,
        "prompt_len": r.prompt_len,
        "max_tokens": r.max_tokens,
        "ok": r.ok,
        "error_kind": r.error_kind,
        "error_detail": r.error_detail,
        "start_s": r.start,
        "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot),
        "e2e_ms": ms(r.e2e),
        "output_tokens": r.output_tokens,
        "tokens_source": r.tokens_source,
    }


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _pair(s: dict, group: str) -> str:
    return f"{_fmt(s[group]['p50'])}/{_fmt(s[group]['p99'])}"


def print_table(result: dict, file=None) -> None:
    file = file or sys.stdout
    hdr = (
        f"{'run':28} {'ok/req':>8} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p99':>15} {'TPOT p50/p99':>14} "
        f"{'E2E p50/p99 ms':>16}  errors"
    )
    print(hdr, file=file)
    for r in result["runs"]:
        s = r["summary"]
        errs = ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "-"
        print(
            f"{r['label'][:28]:28} {s['completed']:>4}/{s['requests']:<3} {s['requests_per_s']:7.2f} "
            f"{s['output_tokens_per_s']:10.1f} {_pair(s, 'ttft_ms'):>15} {_pair(s, 'tpot_ms'):>14} {_pair(s, 'e2e_ms'):>16}  {errs}",
            file=file,
        )
    for c in result["comparisons"]:
        print(
            f"{c['run']} vs {c['vs']}: output tok/s {_fmt(c['output_tokens_per_s_change_pct'], '+.1f')}%, "
            f"p99 e2e {_fmt(c['e2e_p99_change_ms'], '+.1f')} ms, p99 TTFT {_fmt(c['ttft_p99_change_ms'], '+.1f')} ms, "
            f"p99 TPOT {_fmt(c['tpot_p99_change_ms'], '+.2f')} ms",
            file=file,
        )


def write_plots(result: dict, plot_dir: Path) -> list[Path]:
    from load_tests.harness import plots

    plot_dir.mkdir(parents=True, exist_ok=True)
    out = [plots.plot_latency_cdf(result["runs"], plot_dir / "latency_cdf.png")]
    swept = [r for r in result["runs"] if r["popularity"] != "base"]
    if len({r["num_adapters"] for r in swept}) > 1:
        base = next((r["summary"] for r in result["runs"] if r["popularity"] == "base"), None)
        out.append(plots.plot_throughput_vs_adapters(swept, plot_dir / "throughput_vs_adapters.png", base))
    return out
