"""The run's plot (PNG, matplotlib's Agg backend): latency CDF per policy and the ideal fleet, and
p50/p95/p99 bars."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot(latencies: dict[str, np.ndarray], summaries: dict[str, dict], title: str,
         path: Path) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    for name, lat in latencies.items():
        if len(lat):
            xs = np.sort(lat) / 1e3
            a.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    a.set_xscale("log")
    a.set_xlabel("latency, s (log)")
    a.set_ylabel("fraction of requests")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    names = list(summaries)
    x = np.arange(len(names))
    for k, q in enumerate(("p50", "p95", "p99")):
        vals = [summaries[n]["latency_ms"].get(q, np.nan) / 1e3 for n in names]
        b.bar(x + (k - 1) * 0.27, vals, 0.27, label=q)
    b.set_xticks(x, names, fontsize=8)
    b.set_yscale("log")
    b.set_ylabel("latency, s (log)")
    b.legend(fontsize=8)
    b.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
