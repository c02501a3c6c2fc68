"""The training pool: `count` scenes of the procedural dataset's train split rendered once (in
parallel over the machine's cores) and held as arrays, with their captions and masks.

    images    (N, S, S, 3) uint8
    masks     (N, 3, S, S) bool: masks.KINDS in order (a kind that does not fit a scene is its
              garment mask instead)
    captions  N strings
    partners  (N,) int: the index of the image's twin (None in a pool made without twins)

Scene i is write.entry(seed, i): the pool is a prefix of the dataset of that seed. Eval-split
scenes (held-out colour x pattern combinations) are skipped, so the models never see them.
With twins, each scene is followed by its edit (write.edited_of: the same scene, its garment
re-coloured to another train-split colour x pattern, with its own caption and the same masks):
images 2j and 2j + 1 are partners. Training shows a model one twin's unmasked pixels and asks
for the other's caption (train.Batches): an edit's situation, where the garment outside the
mask contradicts the prompt.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from instgenie.dataset import masks as mask_kinds
from instgenie.dataset.render import render as render_scene
from instgenie.dataset.write import edited_of, entry


@dataclass(frozen=True)
class Pool:
    images: np.ndarray
    masks: np.ndarray
    captions: list[str]
    partners: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.captions)


def _render(args: tuple[int, int, int, bool]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """[(caption, image, masks)] of scene `index`, its twin after it; [] for an eval scene."""
    seed, index, size, twins = args
    meta, image, made = entry(seed, index, size)
    if meta["split"] != "train":
        return []
    garment = made.get("garment")
    if garment is None:
        return []
    stack = np.stack([made.get(k, garment) for k in mask_kinds.KINDS])
    out = [(meta["caption"], image, stack)]
    if twins:
        out.append((meta["edit"]["prompt"], render_scene(edited_of(meta), size)[0], stack))
    return out


def render(
    count: int, size: int, seed: int, workers: int | None = None, twins: bool = True
) -> Pool:
    """`count` train-split scenes (scanning as many dataset indices as that takes), each
    followed by its twin when `twins` (2 x count images)."""
    workers = workers or os.cpu_count() or 1
    images, stacks, captions = [], [], []
    start, done = 0, 0
    with ProcessPoolExecutor(workers) if workers > 1 else _Inline() as ex:
        while done < count:
            # eval scenes are about a fifth: ask for a quarter more than still missing
            n = max(workers, int((count - done) * 1.3))
            jobs = [(seed, i, size, twins) for i in range(start, start + n)]
            start += n
            for out in ex.map(_render, jobs, chunksize=max(1, n // (4 * workers))):
                if out and done < count:
                    done += 1
                    for caption, image, stack in out:
                        captions.append(caption)
                        images.append(image)
                        stacks.append(stack)
    partners = np.arange(len(captions)) ^ 1 if twins else None
    return Pool(np.stack(images), np.stack(stacks), captions, partners)


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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part.npz")
    extra = {} if pool.partners is None else {"partners": pool.partners}
    np.savez(tmp, images=pool.images, masks=pool.masks, **extra)
    path.with_suffix(".json").write_text(json.dumps(pool.captions))
    tmp.replace(path)


def load(path: Path) -> Pool:
    data = np.load(path)
    captions = json.loads(path.with_suffix(".json").read_text())
    partners = data["partners"] if "partners" in data.files else None
    return Pool(data["images"], data["masks"], captions, partners)
