"""Write the procedural editing dataset (`instgenie dataset`): scenes rendered to PNG with their
masks, and one JSON line per scene saying what it shows and how to edit it.

    OUT/manifest.json       what was generated: count, size, seed, vocabularies, held-out combos
    OUT/metadata.jsonl      per scene: id, split, caption, labels, masks [{file, kind, ratio}],
                            edit {prompt, labels}: a prompt naming another garment colour and
                            pattern (held-out combinations for the eval split), for editing
                            benchmarks and the classifier of the edited region
    OUT/images/ID.png       the scene (RGB)
    OUT/masks/ID-KIND.png   its masks (L: 255 = edit)

Scene i of seed s depends on (s, i) only: any prefix of a larger dataset is the smaller one.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
from PIL import Image

from instgenie.dataset import masks, scenes, vocab
from instgenie.dataset.render import render

FORMAT_VERSION = 1


def scene_seed(seed: int, index: int) -> int:
    """The seed of scene `index` of a dataset generated with `seed`."""
    return (seed * 1_000_003 + index) & 0x7FFFFFFF


def edit_target(scene: scenes.Scene, rng: random.Random) -> scenes.Scene:
    """The scene with its garment re-coloured: another colour x pattern of the same split (a
    held-out combination for an eval scene), the rest unchanged."""
    pool = [(c, p) for c in vocab.COLOURS for p in vocab.PATTERNS
            if (c, p) != (scene.colour, scene.pattern)
            and vocab.held_out(c, p) == (scene.split == "eval")]  # fmt: skip
    colour, pattern = rng.choice(pool)
    accent = "black" if colour in ("white", "yellow", "pink") else "white"
    return dataclasses.replace(scene, colour=colour, pattern=pattern, accent=accent)


def scene_of(meta: dict) -> scenes.Scene:
    """The scene of an entry's metadata line."""
    d = meta["scene"]
    return scenes.Scene(**{**d, "light": scenes.Light(**d["light"])})


def edited_of(meta: dict) -> scenes.Scene:
    """The scene an entry's edit prompt describes: its garment re-coloured as edit_target did."""
    want = meta["edit"]["labels"]
    accent = "black" if want["colour"] in ("white", "yellow", "pink") else "white"
    return dataclasses.replace(scene_of(meta), colour=want["colour"], pattern=want["pattern"],
                               accent=accent)  # fmt: skip


def entry(seed: int, index: int, size: int) -> tuple[dict, np.ndarray, dict[str, np.ndarray]]:
    """(metadata line, image, masks by kind) of scene `index`."""
    s_seed = scene_seed(seed, index)
    rng = random.Random(s_seed)
    scene = scenes.sample(rng, s_seed)
    image, labels = render(scene, size)
    mask_rng = np.random.default_rng(s_seed)
    made = {}
    for kind in masks.KINDS:
        try:
            made[kind] = masks.make(kind, labels, mask_rng)
        except masks.MaskError:
            continue  # e.g. a garment too large for a rectangle under HI: that kind is left out
    target = edit_target(scene, rng)
    sid = f"{index:06d}"
    meta = {
        "id": sid,
        "split": scene.split,
        "caption": scenes.caption(scene),
        "labels": scenes.labels(scene),
        "masks": [
            {"file": f"masks/{sid}-{k}.png", "kind": k, "ratio": round(float(m.mean()), 4)}
            for k, m in made.items()
        ],  # fmt: skip
        "edit": {"prompt": scenes.caption(target), "labels": scenes.labels(target)},
        "image": f"images/{sid}.png",
        "scene": dataclasses.asdict(scene),
    }
    return meta, image, made


def write(out: Path, count: int, size: int = 256, seed: int = 0, overwrite: bool = False) -> dict:
    """Generate `count` scenes into `out`; returns the manifest."""
    if count < 1 or size < 32:
        raise ValueError(f"count must be >= 1 and size >= 32, got {count} and {size}")
    meta_path = out / "metadata.jsonl"
    if meta_path.exists() and not overwrite:
        raise FileExistsError(f"{meta_path} exists: --overwrite (overwrite=True) replaces it")
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(exist_ok=True)
    splits = {"train": 0, "eval": 0}
    tmp = meta_path.with_suffix(".jsonl.part")
    with open(tmp, "w") as f:
        for i in range(count):
            meta, image, made = entry(seed, i, size)
            Image.fromarray(image).save(out / meta["image"], optimize=False)
            for m, (_, mask) in zip(meta["masks"], made.items(), strict=True):
                Image.fromarray(mask.astype(np.uint8) * 255).save(out / m["file"])
            f.write(json.dumps(meta) + "\n")
            splits[meta["split"]] += 1
    tmp.replace(meta_path)  # the metadata appears whole, after every file it names
    manifest = {
        "format": FORMAT_VERSION, "count": count, "size": size, "seed": seed, "splits": splits,
        "colours": vocab.COLOURS, "patterns": vocab.PATTERNS, "garments": vocab.GARMENTS,
        "walls": vocab.WALLS, "textures": vocab.TEXTURES, "objects": vocab.OBJECTS,
        "held_out": [[c, p] for c in vocab.COLOURS for p in vocab.PATTERNS
                     if vocab.held_out(c, p)],
        "mask_kinds": masks.KINDS, "mask_ratio_bounds": [masks.LO, masks.HI],
    }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
