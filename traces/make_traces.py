"""Regenerate the synthetic files in traces/ (seeded: the output is the same every time).

    python traces/make_traces.py

They are stand-ins, labelled as such: the paper (Fig. 3) gives the mean mask ratio of its
production trace (0.11) and of the public trace (0.19) and plots their histograms, but publishes
no numbers per bin, and neither trace is available here.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BINS = np.linspace(0.0, 1.0, 21)  # 0.05 wide


def beta_histogram(mean: float, k: float, name: str, source: str) -> None:
    """Bin weights of Beta(mean*k, (1-mean)*k), from a fine sum of its density (2e6 points)."""
    a, b = mean * k, (1 - mean) * k
    x = np.linspace(0, 1, 2_000_001)[1:-1]
    log_pdf = (a - 1) * np.log(x) + (b - 1) * np.log1p(-x)
    pdf = np.exp(log_pdf - log_pdf.max())
    pairs = zip(BINS[:-1], BINS[1:], strict=True)
    weights = [float(pdf[(x >= lo) & (x < hi)].sum()) for lo, hi in pairs]
    total = sum(weights)
    doc = {
        "description": f"SYNTHETIC mask-ratio histogram: Beta({a:.3g}, {b:.3g}), mean {mean} "
        f"as {source} in the paper's Fig. 3 (which publishes no per-bin numbers)",
        "bin_edges": [round(float(e), 4) for e in BINS],
        "weights": [round(w / total, 6) for w in weights],
    }
    (HERE / name).write_text(json.dumps(doc, indent=1) + "\n")


def bursty_trace(name: str, seed: int = 0) -> None:
    """A two-state Markov-modulated Poisson process over 120 s: 20 s calm phases at 0.5 req/s,
    10 s bursts at 3 req/s (mean ~1.3 req/s); mask ratios left to --mask-ratios."""
    rng = np.random.default_rng(seed)
    t, rows = 0.0, []
    phases = [(20.0, 0.5), (10.0, 3.0)] * 4
    start = 0.0
    for length, rate in phases:
        t = start
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= start + length:
                break
            rows.append(round(t, 3))
        start += length
    with open(HERE / name, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["at_s", "template"])
        for at in rows:
            w.writerow([at, int(rng.integers(4))])


if __name__ == "__main__":
    beta_histogram(0.19, 5.0, "mask_ratios_mean019.json", "the public trace")
    beta_histogram(0.11, 5.0, "mask_ratios_mean011.json", "the paper's production trace")
    bursty_trace("bursty_arrivals.csv")
