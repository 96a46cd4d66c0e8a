"""PNG plots of bench_serving results: latency CDFs and throughput against the number of adapters."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install matplotlib (or drop --plot-dir)") from None
    matplotlib.use("Agg")  # files only; no display here
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_latency_cdf(runs: list[dict], path: Path) -> Path:
    """One panel per metric (TTFT, TPOT, end-to-end), one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(
        axes,
        [("ttft", "time to first token"), ("tpot", "time per output token"), ("e2e", "end-to-end latency")],
        strict=True,
    ):
        for run in runs:
            _cdf(
                ax,
                [r[f"{key}_ms"] for r in run["requests"] if r["ok"] and r[f"{key}_ms"] is not None],
                run["label"],
            )
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput_vs_adapters(runs: list[dict], path: Path, baseline: dict | None = None) -> Path:
    """Output tokens/s and p99 end-to-end latency against the number of adapters in the sweep."""
    plt = _pyplot()
    pts = sorted((r["num_adapters"], r["summary"]) for r in runs)
    ns = [n for n, _ in pts]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ns, [s["output_tokens_per_s"] for _, s in pts], "o-", color="tab:blue", label="output tok/s")
    ax.set_xlabel("number of adapters")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    if len(ns) > 2 and max(ns) / max(min(ns), 1) >= 50:
        ax.set_xscale("symlog", linthresh=1)
    ax2 = ax.twinx()
    ax2.plot(
        ns, [s["e2e_ms"]["p99"] or float("nan") for _, s in pts], "s--", color="tab:red", label="p99 e2e"
    )
    ax2.set_ylabel("p99 end-to-end latency (ms)", color="tab:red")
    if baseline is not None:
        ax.axhline(baseline["output_tokens_per_s"], color="tab:blue", ls=":", label="base model tok/s")
        if baseline["e2e_ms"]["p99"] is not None:
            ax2.axhline(baseline["e2e_ms"]["p99"], color="tab:red", ls=":", label="base model p99")
    # From zero: a few percent of run-to-run noise must not look like a trend.
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower left")
    ax.set_title("throughput vs number of adapters")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
