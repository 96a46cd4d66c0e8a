"""PNG plots of the placement simulator's rows: one bar panel per metric, grouped by zipf alpha, plus per-replica loads."""

from __future__ import annotations

from pathlib import Path

from load_tests.harness.plots import _pyplot

PANELS = [
    ("hit_rate", "adapter-hit rate"),
    ("load_max_over_mean", "max / mean replica load"),
    ("cold_loads_per_s", "cold loads per second"),
    ("queue_delay_ms_p99", "p99 queueing delay (ms)"),
]


def plot(rows: list[dict], path: Path) -> Path:
    plt = _pyplot()
    alphas = sorted({r["alpha"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["alpha"], r["policy"]): r for r in rows}
    fig, grid = plt.subplots(2, 3, figsize=(16, 8.5))
    axes = list(grid.flat)
    axes[-1].axis("off")  # five panels on a 2 x 3 grid
    width = 0.8 / max(1, len(policies))
    for ax, (key, title) in zip(axes, PANELS):
        for j, p in enumerate(policies):
            xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(alphas))]
            ys = [by[(a, p)][key] if (a, p) in by else 0.0 for a in alphas]
            ax.bar(xs, ys, width, label=p)
        ax.set_xticks(range(len(alphas)), [f"α={a}" for a in alphas])
        ax.set_title(title)
        if key == "cold_loads_per_s":
            ax.set_yscale("log")  # oblivious policies load ~100x more: a linear axis hides the rest
    axes[0].legend(fontsize=8)
    # Per-replica load at the middle alpha, sorted: shows where imbalance sits, not just its maximum.
    ax, mid = axes[len(PANELS)], alphas[len(alphas) // 2]
    for p in policies:
        if (mid, p) in by:
            ax.plot(sorted(by[(mid, p)]["replica_loads"], reverse=True), label=p)
    ax.set_title(f"replica load, sorted (α={mid})")
    ax.set_xlabel("replica")
    ax.set_ylabel("time-averaged ongoing / max_ongoing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
