"""The training pool: `count` scenes of the procedural dataset's train split rendered once (in
parallel over the machine's cores) and held as arrays, with their captions and masks.

    images    (N, S, S, 3) uint8
    masks     (N, 3, S, S) bool: masks.KINDS in order (a kind that does not fit a scene is its
              garment mask instead)
    captions  N strings

Scene i is write.entry(seed, i): the pool is a prefix of the dataset of that seed. Eval-split
scenes (held-out colour x pattern combinations) are skipped, so the models never see them.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from instgenie.dataset import masks as mask_kinds
from instgenie.dataset.write import entry


@dataclass(frozen=True)
class Pool:
    images: np.ndarray
    masks: np.ndarray
    captions: list[str]

    def __len__(self) -> int:
        return len(self.captions)


def _render(args: tuple[int, int, int]) -> tuple[str, str, np.ndarray, np.ndarray] | None:
    seed, index, size = args
    meta, image, made = entry(seed, index, size)
    if meta["split"] != "train":
        return None
    garment = made.get("garment")
    if garment is None:
        return None
    stack = np.stack([made.get(k, garment) for k in mask_kinds.KINDS])
    return meta["caption"], meta["id"], image, stack


def render(count: int, size: int, seed: int, workers: int | None = None) -> Pool:
    """`count` train-split scenes (scanning as many dataset indices as that takes)."""
    workers = workers or os.cpu_count() or 1
    images, stacks, captions = [], [], []
    start = 0
    with ProcessPoolExecutor(workers) if workers > 1 else _Inline() as ex:
        while len(captions) < count:
            # eval scenes are about a fifth: ask for a quarter more than still missing
            n = max(workers, int((count - len(captions)) * 1.3))
            jobs = [(seed, i, size) for i in range(start, start + n)]
            start += n
            for out in ex.map(_render, jobs, chunksize=max(1, n // (4 * workers))):
                if out is not None and len(captions) < count:
                    captions.append(out[0])
                    images.append(out[2])
                    stacks.append(out[3])
    return Pool(np.stack(images), np.stack(stacks), captions)


class _Inline:
    """ProcessPoolExecutor's map in this process (one worker: no pool to start)."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn, items, chunksize: int = 1):  # noqa: ANN001, ANN201
        return map(fn, items)


def save(pool: Pool, path: Path) -> None:
    """One .npz (uncompressed) plus its captions as JSON beside it; written whole or not at all."""
    tmp = path.with_name(path.name + ".part.npz")
    np.savez(tmp, images=pool.images, masks=pool.masks)
    path.with_suffix(".json").write_text(json.dumps(pool.captions))
    tmp.replace(path)


def load(path: Path) -> Pool:
    data = np.load(path)
    captions = json.loads(path.with_suffix(".json").read_text())
    return Pool(data["images"], data["masks"], captions)
