"""Numbers from a run's records: throughput, latency percentiles, per-adapter counts, errors by kind."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type here: engine benchmarks use the percentiles without httpx
    from load_tests.harness.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default):
    position (n-1)*q/100 in the sorted values. None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} must be within 0..100")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_or_nan(values: list[float], q: float) -> float:
    """percentile, with NaN for no values (for tables and ratios that must not stop on an empty phase)."""
    v = percentile(values, q)
    return float("nan") if v is None else v


def distribution(values: list[float], scale: float = 1000.0) -> dict:
    """mean/min/max/p50/p90/p99 of values (seconds) in ms, or all None when there are none."""
    keys = ["mean", "min", "max"] + [f"p{q}" for q in PERCENTILES]
    if not values:
        return dict.fromkeys(keys) | {"count": 0}
    out = {
        "count": len(values),
        "mean": sum(values) / len(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
    }
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) * scale
    return out


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """The summary of one run; latencies in ms, throughputs per second of wall time."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    dur = duration if duration > 0 else float("nan")
    errors = Counter(r.error_kind for r in records if not r.ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "requests_per_s": len(ok) / dur,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / dur,
        "input_tokens_per_s": in_tokens / dur,
        # ignore_eos asks for exactly max_tokens; a server that stops early is measured on less work.
        "length_mismatches": sum(1 for r in ok if r.output_tokens != r.max_tokens),
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itls]),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None]),
        "errors": dict(sorted(errors.items())),
    }


def per_adapter(records: list[RequestRecord]) -> dict[str, dict]:
    """model name → requests, completed, failed, output tokens, mean end-to-end ms."""
    out: dict[str, dict] = {}
    for r in records:
        a = out.setdefault(
            r.model, {"requests": 0, "completed": 0, "failed": 0, "output_tokens": 0, "_e2e": []}
        )
        a["requests"] += 1
        if r.ok:
            a["completed"] += 1
            a["output_tokens"] += r.output_tokens
            a["_e2e"].append(r.e2e)
        else:
            a["failed"] += 1
    for a in out.values():
        e = a.pop("_e2e")
        a["e2e_ms_mean"] = sum(e) / len(e) * 1000 if e else None
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["requests"], kv[0])))


def compare(base: dict, other: dict) -> dict:
    """How `other` (e.g. 200 adapters) differs from `base` (the base model only), as the seed reports it."""

    def rel(key: str) -> float | None:
        b, o = base[key], other[key]
        return (o / b - 1.0) * 100 if b else None

    def diff(group: str, q: str) -> float | None:
        b, o = base[group][q], other[group][q]
        return None if b is None or o is None else o - b

    return {
        "output_tokens_per_s_change_pct": rel("output_tokens_per_s"),
        "requests_per_s_change_pct": rel("requests_per_s"),
        "e2e_p99_change_ms": diff("e2e_ms", "p99"),
        "ttft_p99_change_ms": diff("ttft_ms", "p99"),
        "tpot_p99_change_ms": diff("tpot_ms", "p99"),
    }
