"""A small classifier of an image region's garment: its colour, pattern and kind (vocab.py), for
measuring whether an edit painted what its prompt asked (issue 27's prompt adherence).

Features (`features`) are hand-made and cheap, so the classifier trains in seconds on CPU from
rendered scenes and needs no model stack: a hue x saturation x value histogram of the region's
pixels (colour; the pattern's white or black accent shows as low saturation or low value), the
share of accent-like pixels, the region's gradient energy along x and y and its autocorrelation
at a few lags inside its bounding box, how its off-colour pixels fill rows and columns
(pattern), and the region's shape (its extent relative to the figure's: kind). One multinomial
logistic regression per target (scikit-learn) is fitted on standardised features; the weights
are plain numbers in JSON (no pickle), and prediction is numpy only. Training renders are
augmented (blur, noise, brightness) so that the classifier also reads a generated image, which
is softer than a rendering; most are read inside a mask, as an edit's region is.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from instgenie.dataset import masks, scenes, vocab
from instgenie.dataset.render import GARMENT, render

#: the committed weights (`instgenie train-classifier --out instgenie/dataset/classifier.json`,
#: defaults: 3,000 scenes at 256 px, seed 0, 60 % read inside a mask)
DEFAULT_WEIGHTS = Path(__file__).with_name("classifier.json")
TARGETS = {"colour": tuple(vocab.COLOURS), "pattern": vocab.PATTERNS, "garment": vocab.GARMENTS}
FEATURES_VERSION = 2
HUE_BINS, SAT_BINS, VAL_BINS = 12, 3, 3
LAGS = (2, 3, 4, 6, 8)  # autocorrelation lags, fraction of the region's height / 64


def features(image: np.ndarray, region: np.ndarray) -> np.ndarray:
    """The feature vector of `region` (bool, H x W) of `image` (H x W x 3 uint8)."""
    if region.shape != image.shape[:2] or not region.any():
        raise ValueError("the region must be a non-empty mask of the image's size")
    hsv = np.asarray(Image.fromarray(image).convert("HSV"), dtype=np.float64) / 255.0
    h, s, v = (hsv[..., i][region] for i in range(3))
    hist, _ = np.histogramdd(
        np.stack([h, s, v], 1), bins=(HUE_BINS, SAT_BINS, VAL_BINS), range=((0, 1),) * 3
    )
    hist = hist.ravel() / len(h)
    accent_like = ((s < 0.2) & (v > 0.75)) | (v < 0.2)
    accent = np.array([((s < 0.2) & (v > 0.75)).mean(), (v < 0.2).mean()])
    # the base colour: the median RGB of the other pixels (all of them when the region is
    # all accent-like: a white or black garment), and its chromaticity
    rgb = image[region].astype(np.float64) / 255.0
    base = np.median(rgb[~accent_like] if (~accent_like).sum() >= 8 else rgb, axis=0)
    chroma = base / (base.sum() + 1e-6)
    ys, xs = np.nonzero(region)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    grey = image[y0:y1, x0:x1].astype(np.float64).mean(-1)
    inside = region[y0:y1, x0:x1]
    grey = np.where(inside, grey, grey[inside].mean())
    grey = (grey - grey[inside].mean()) / (grey[inside].std() + 1.0)
    gy = float(np.abs(np.diff(grey, axis=0)).mean())
    gx = float(np.abs(np.diff(grey, axis=1)).mean())
    n = region.shape[0]
    acf = []
    for lag in LAGS:
        k = max(1, round(lag * n / 256))
        acf.append(float((grey[k:] * grey[:-k]).mean()) if grey.shape[0] > k else 0.0)
        acf.append(float((grey[:, k:] * grey[:, :-k]).mean()) if grey.shape[1] > k else 0.0)
    shape = np.array([(y1 - y0) / n, (x1 - x0) / n, region.mean() / max(1e-9, inside.mean())])
    return np.concatenate([hist, accent, base, chroma, [gy, gx, gy - gx], acf, shape,
                           [inside.mean()], _profiles(image, region, y0, y1, x0, x1)])  # fmt: skip


def _profiles(image: np.ndarray, region: np.ndarray, y0: int, y1: int, x0: int,
              x1: int) -> np.ndarray:  # fmt: skip
    """How the region's off-colour pixels (far from its median colour: a pattern's accent) lie
    in rows and in columns: stripes fill whole rows, a check fills rows and columns, dots fill
    neither. Per row (and per column) with enough region pixels, the share of off-colour
    pixels; the features are the shares' quantiles and spread, and the off-colour share."""
    rgb = image[y0:y1, x0:x1].astype(np.float64) / 255.0
    inside = region[y0:y1, x0:x1]
    median = np.median(rgb[inside], axis=0)
    off = (np.linalg.norm(rgb - median, axis=-1) / np.sqrt(3) > 0.18) & inside
    out = [float(off.sum() / inside.sum())]
    for axis in (1, 0):  # rows, then columns
        count = inside.sum(axis=axis)
        share = off.sum(axis=axis)[count >= 3] / count[count >= 3]
        if share.size == 0:
            share = np.zeros(1)
        out += [float(np.quantile(share, 0.5)), float(np.quantile(share, 0.9)),
                float(share.std())]  # fmt: skip
    return np.array(out)


@dataclass(frozen=True)
class RegionClassifier:
    """Fitted weights: per target, coef (classes x features) and intercept; the features' mean
    and scale for standardising."""

    mean: np.ndarray
    scale: np.ndarray
    weights: dict[str, tuple[tuple[str, ...], np.ndarray, np.ndarray]]  # classes, coef, icpt

    def predict(self, image: np.ndarray, region: np.ndarray) -> dict[str, str]:
        z = (features(image, region) - self.mean) / self.scale
        return {t: classes[int(np.argmax(coef @ z + icpt))]
                for t, (classes, coef, icpt) in self.weights.items()}  # fmt: skip

    def save(self, path: str | Path) -> None:
        data = {"features_version": FEATURES_VERSION, "mean": self.mean.tolist(),
                "scale": self.scale.tolist(),
                "targets": {t: {"classes": list(c), "coef": w.tolist(), "intercept": b.tolist()}
                            for t, (c, w, b) in self.weights.items()}}  # fmt: skip
        Path(path).write_text(json.dumps(data) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RegionClassifier:
        data = json.loads(Path(path).read_text())
        if data.get("features_version") != FEATURES_VERSION:
            raise ValueError(f"{path}: features version {data.get('features_version')}, "
                             f"this code computes {FEATURES_VERSION}: train it again")  # fmt: skip
        weights = {t: (tuple(d["classes"]), np.array(d["coef"]), np.array(d["intercept"]))
                   for t, d in data["targets"].items()}  # fmt: skip
        return cls(np.array(data["mean"]), np.array(data["scale"]), weights)


def _augment(image: np.ndarray, rng: random.Random) -> np.ndarray:
    img = Image.fromarray(image)
    radius = rng.choice((0.0, 0.0, 0.6, 1.0, 1.5))
    if radius:
        img = img.filter(ImageFilter.GaussianBlur(radius))
    out = np.asarray(img, dtype=np.float64) * rng.uniform(0.85, 1.15)
    out += np.random.default_rng(rng.randrange(1 << 30)).normal(0, rng.uniform(0, 8), out.shape)
    return np.clip(out, 0, 255).astype(np.uint8)


def samples(count: int, size: int, seed: int, split: str | None = None, augment: bool = True,
            partial: float = 0.0):  # fmt: skip
    """(features, labels) of `count` rendered scenes of `split` ("train", "eval", None: both),
    the region being each scene's garment, or with probability `partial` the garment inside a
    mask of a random kind (masks.py), as an edit's region is read."""
    rng = random.Random(seed)
    X, Y = [], []
    i = 0
    while len(X) < count:
        scene = scenes.sample(random.Random(seed * 7919 + i), seed * 7919 + i)
        i += 1
        if split is not None and scene.split != split:
            continue
        image, labels = render(scene, size)
        region = labels == GARMENT
        if rng.random() < partial:
            try:
                made = masks.make(rng.choice(masks.KINDS), labels,
                                  np.random.default_rng(seed * 7919 + i))  # fmt: skip
            except masks.MaskError:
                continue
            if (region & made).sum() >= max(16, region.sum() // 8):
                region = region & made
        if augment:
            image = _augment(image, rng)
        X.append(features(image, region))
        Y.append({t: getattr(scene, t) for t in TARGETS})
    return np.array(X), Y


def train(count: int = 2000, size: int = 128, seed: int = 0,
          partial: float = 0.6) -> RegionClassifier:  # fmt: skip
    """Fit on `count` augmented renders of both splits (the classifier judges held-out
    colour x pattern combinations too: each colour and each pattern is learnt on its own), a
    share `partial` of them read inside a mask as edits are."""
    from sklearn.linear_model import LogisticRegression

    X, Y = samples(count, size, seed, partial=partial)
    mean, scale = X.mean(0), X.std(0) + 1e-6
    Z = (X - mean) / scale
    weights = {}
    for t, classes in TARGETS.items():
        y = np.array([classes.index(row[t]) for row in Y])
        model = LogisticRegression(C=1.0, max_iter=2000).fit(Z, y)
        coef = np.zeros((len(classes), Z.shape[1]))
        icpt = np.full(len(classes), -1e9)  # a class never seen in training is never predicted
        coef[model.classes_], icpt[model.classes_] = model.coef_, model.intercept_
        weights[t] = (classes, coef, icpt)
    return RegionClassifier(mean, scale, weights)


def accuracy(clf: RegionClassifier, count: int, size: int, seed: int,
             split: str | None = None) -> dict[str, float]:  # fmt: skip
    """Per-target accuracy on `count` fresh augmented renders (another seed than training's)."""
    X, Y = samples(count, size, seed, split)
    hits = dict.fromkeys(TARGETS, 0)
    for x, y in zip(X, Y, strict=True):
        z = (x - clf.mean) / clf.scale
        for t, (classes, coef, icpt) in clf.weights.items():
            hits[t] += classes[int(np.argmax(coef @ z + icpt))] == y[t]
    return {t: h / len(Y) for t, h in hits.items()}
