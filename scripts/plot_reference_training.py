"""Loss curves of the reference models' training runs (docs/benchmarks/data/reference/
FAMILY-N.json, one per `train-reference` run, N in order) as one PNG: VAE (and decoder
fine-tune) and backbone phases, backbone runs chained on one step axis.

    python scripts/plot_reference_training.py docs/benchmarks/reference-training.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "data" / "reference"


def main(out: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(10, 6))
    for col, family in enumerate(("sdxl-inpaint", "flux-fill")):
        runs = sorted(DATA.glob(f"{family}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        offset = 0
        for path in runs:
            r = json.loads(path.read_text())
            if r["vae"]["curve"]:
                s, loss, _ = zip(*r["vae"]["curve"], strict=True)
                axes[0, col].plot(s, loss, label=f"run {path.stem.rsplit('-', 1)[1]}")
            if r["vae"].get("decoder", {}).get("curve"):  # decoder fine-tunes (+ colour L1)
                s, loss, _ = zip(*r["vae"]["decoder"]["curve"], strict=True)
                label = f"run {path.stem.rsplit('-', 1)[1]}: decoder alone, + 8x8-mean L1"
                axes[0, col].plot(s, loss, label=label)
            if r["backbone"]["curve"]:
                s, loss, _ = zip(*r["backbone"]["curve"], strict=True)
                label = f"run {path.stem.rsplit('-', 1)[1]} (batch {r['config']['batch']})"
                axes[1, col].plot([offset + x for x in s], loss, label=label)
                offset += r["backbone"]["steps"]
        axes[0, col].set_title(f"{family}:ref VAE (L1 + 0.5 grad L1 + KL)", fontsize=10)
        obj = "min-SNR-5 eps MSE" if family == "sdxl-inpaint" else "flow-matching MSE"
        axes[1, col].set_title(f"{family}:ref backbone + text ({obj})", fontsize=10)
        axes[1, col].set_xlabel("step")
        for ax in axes[:, col]:
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    axes[1, 0].set_ylim(0.05, 0.15)
    axes[1, 1].set_ylim(1.1, 1.5)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/reference-training.png")
