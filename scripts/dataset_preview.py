"""Write a preview grid of the procedural editing dataset: scenes on the top row, the same
scenes with one of their masks (red) on the bottom. Used for docs/dataset-preview.png.

    python scripts/dataset_preview.py --out docs/dataset-preview.png
"""

from __future__ import annotations

import argparse

import numpy as np
from PIL import Image

from instgenie.dataset.write import entry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=6)
    ap.add_argument("--size", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    top, bottom = [], []
    for i in range(args.count):
        meta, image, masks = entry(args.seed, i, args.size)
        kind = list(masks)[i % len(masks)]
        shown = image.astype(np.float64)
        m = masks[kind]
        shown[m] = 0.45 * shown[m] + 0.55 * np.array([230.0, 30.0, 30.0])
        top.append(image)
        bottom.append(shown.astype(np.uint8))
        print(f"{meta['id']} [{meta['split']}] {meta['caption']} | mask: {kind}")
    grid = np.concatenate([np.concatenate(top, 1), np.concatenate(bottom, 1)], 0)
    Image.fromarray(grid).save(args.out, optimize=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
