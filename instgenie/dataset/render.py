"""Draw a `Scene` (scenes.py): an RGB image and a label map of what each pixel shows.

Shapes are drawn at twice the size and reduced (box filter) for smooth edges; the label map is
drawn at the same doubled size and reduced by taking one pixel in four (no mixed labels). Units:
pixels; the scene's geometry is in fractions of the side. Deterministic in the scene (its seed
drives the texture and the noise).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from instgenie.dataset import vocab
from instgenie.dataset.scenes import Scene

#: label map values
WALL, FLOOR, OBJECT, SKIN, LEGS, GARMENT = range(6)
REGIONS = {"wall": WALL, "floor": FLOOR, "object": OBJECT, "skin": SKIN, "legs": LEGS,
           "garment": GARMENT}  # fmt: skip
SUPERSAMPLE = 2
FLOOR_Y = 0.9  # the floor's top edge, fraction of the side


def render(scene: Scene, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(image (size, size, 3) uint8, labels (size, size) uint8 of REGIONS values)."""
    S = size * SUPERSAMPLE
    rng = np.random.default_rng(scene.seed)
    img = Image.fromarray(_wall(scene, S, rng))
    lab = Image.new("L", (S, S), WALL)
    d, dl = ImageDraw.Draw(img), ImageDraw.Draw(lab)
    fy = int(FLOOR_Y * S)
    d.rectangle([0, fy, S, S], fill=vocab.FLOOR)
    for x in range(0, S, max(4, S // 9)):
        d.line([x, fy, x - S // 20, S], fill=_shade(vocab.FLOOR, 0.8), width=max(1, S // 256))
    dl.rectangle([0, fy, S, S], fill=FLOOR)
    if scene.obj is not None:
        _object(scene, S, d, dl)
    garment = _figure(scene, S, d, dl)
    _fill_garment(scene, S, img, lab, garment)
    image = np.asarray(img.resize((size, size), Image.Resampling.BOX), dtype=np.float64)
    image = _light(image, scene) + rng.normal(0.0, scene.noise, image.shape)
    labels = np.asarray(lab)[::SUPERSAMPLE, ::SUPERSAMPLE].copy()
    return np.clip(np.rint(image), 0, 255).astype(np.uint8), labels


def _shade(rgb: tuple[int, int, int], f: float) -> tuple[int, int, int]:
    return tuple(int(max(0, min(255, round(c * f)))) for c in rgb)  # type: ignore[return-value]


def _wall(s: Scene, S: int, rng: np.random.Generator) -> np.ndarray:
    base = np.array(vocab.WALLS[s.wall], dtype=np.float64)
    wall = np.broadcast_to(base, (S, S, 3)).copy()
    if s.texture == "brick":
        h = max(4, S // 16)
        y, x = np.mgrid[0:S, 0:S]
        row = y // h
        mortar = (y % h < max(1, h // 6)) | (((x + (row % 2) * h) % (2 * h)) < max(1, h // 6))
        tone = 0.9 + 0.1 * rng.random((S // h + 1, S // h + 2))[row, (x + (row % 2) * h) // (2 * h)]
        wall *= tone[..., None]
        wall[mortar] = base * 1.15
    elif s.texture == "panelled":
        w = max(6, S // 7)
        x = np.arange(S)
        wall[:, (x % w) < max(1, w // 14)] = base * 0.75
    elif s.texture == "speckled":
        wall += rng.normal(0.0, 14.0, (S, S, 1))
    return np.clip(wall, 0, 255).astype(np.uint8)


def _object(s: Scene, S: int, d: ImageDraw.ImageDraw, dl: ImageDraw.ImageDraw) -> None:
    cx = (0.15 if s.obj_side == "left" else 0.85) * S
    colour = vocab.COLOURS[s.obj_colour]
    fy = FLOOR_Y * S
    shapes: list[tuple[str, list, tuple[int, int, int]]]
    if s.obj == "plant":
        leaf = (40, 120, 45)
        shapes = [("poly", [(cx - 0.06 * S, fy - 0.12 * S), (cx + 0.06 * S, fy - 0.12 * S),
                            (cx + 0.045 * S, fy), (cx - 0.045 * S, fy)], (140, 80, 45)),
                  ("ellipse", [cx - 0.1 * S, fy - 0.34 * S, cx + 0.1 * S, fy - 0.11 * S], leaf),
                  ("ellipse", [cx - 0.05 * S, fy - 0.42 * S, cx + 0.07 * S, fy - 0.2 * S],
                   _shade(leaf, 1.2))]  # fmt: skip
    elif s.obj == "lamp":
        shapes = [("rect", [cx - 0.008 * S, fy - 0.5 * S, cx + 0.008 * S, fy], (50, 50, 50)),
                  ("rect", [cx - 0.05 * S, fy - 0.015 * S, cx + 0.05 * S, fy], (50, 50, 50)),
                  ("poly", [(cx - 0.04 * S, fy - 0.62 * S), (cx + 0.04 * S, fy - 0.62 * S),
                            (cx + 0.08 * S, fy - 0.5 * S), (cx - 0.08 * S, fy - 0.5 * S)],
                   colour)]  # fmt: skip
    elif s.obj == "chair":
        shapes = [("rect", [cx - 0.08 * S, fy - 0.24 * S, cx + 0.08 * S, fy - 0.2 * S], colour),
                  ("rect", [cx - 0.08 * S, fy - 0.45 * S, cx - 0.06 * S, fy], colour),
                  ("rect", [cx + 0.06 * S, fy - 0.24 * S, cx + 0.08 * S, fy], colour),
                  ("rect", [cx - 0.08 * S, fy - 0.45 * S, cx + 0.02 * S, fy - 0.42 * S],
                   colour)]  # fmt: skip
    else:  # picture frame, on the wall
        shapes = [
            ("rect", [cx - 0.1 * S, 0.12 * S, cx + 0.1 * S, 0.36 * S], (90, 60, 35)),
            ("rect", [cx - 0.08 * S, 0.14 * S, cx + 0.08 * S, 0.34 * S], colour),
        ]
    for kind, xy, fill in shapes:
        for draw, value in ((d, fill), (dl, OBJECT)):
            if kind == "poly":
                draw.polygon(xy, fill=value)
            elif kind == "ellipse":
                draw.ellipse(xy, fill=value)
            else:
                draw.rectangle(xy, fill=value)


def _figure(s: Scene, S: int, d: ImageDraw.ImageDraw, dl: ImageDraw.ImageDraw) -> Image.Image:
    """Draws the figure (skin, legs; the garment's area is left to _fill_garment) and returns
    the garment's shape as a mode "1" image."""
    u = s.height * S
    cx, top = s.x * S, FLOOR_Y * S + 0.02 * S - u
    skin, legs = vocab.SKIN[s.skin], vocab.TROUSERS[s.trousers]

    def y(f: float) -> float:
        return top + f * u

    def limb(draw, x0, y0, x1, y1, width, value) -> None:
        draw.line([x0, y0, x1, y1], fill=value, width=max(1, int(width * u)))
        r = width * u / 2
        for px, py in ((x0, y0), (x1, y1)):
            draw.ellipse([px - r, py - r, px + r, py + r], fill=value)

    for side in (-1, 1):  # legs and feet
        x0 = cx + side * 0.05 * u
        for draw, value in ((d, legs), (dl, LEGS)):
            draw.rectangle([x0 - 0.04 * u, y(0.5), x0 + 0.04 * u, y(0.97)], fill=value)
        d.ellipse([x0 - 0.05 * u, y(0.95), x0 + 0.05 * u, y(1.0)], fill=(30, 25, 25))
        dl.ellipse([x0 - 0.05 * u, y(0.95), x0 + 0.05 * u, y(1.0)], fill=LEGS)
    for side in (-1, 1):  # arms (skin), under the garment's sleeves
        for draw, value in ((d, skin), (dl, SKIN)):
            limb(draw, cx + side * 0.12 * u, y(0.22), cx + side * 0.17 * u, y(0.5), 0.055, value)
    for draw, value in ((d, skin), (dl, SKIN)):  # neck and head
        draw.rectangle([cx - 0.025 * u, y(0.12), cx + 0.025 * u, y(0.21)], fill=value)
        draw.ellipse([cx - 0.07 * u, y(0.01), cx + 0.07 * u, y(0.16)], fill=value)
    d.chord([cx - 0.072 * u, y(0.0), cx + 0.072 * u, y(0.1)], 180, 360, fill=(45, 30, 20))

    shape = Image.new("1", (S, S), 0)
    g = ImageDraw.Draw(shape)
    half = 0.09 if s.garment == "tank top" else 0.125
    hem = {"dress": 0.5, "jacket": 0.56}.get(s.garment, 0.5)
    g.polygon([(cx - half * u, y(0.2)), (cx + half * u, y(0.2)), (cx + 0.1 * u, y(hem)),
               (cx - 0.1 * u, y(hem))], fill=1)  # fmt: skip
    if s.garment == "dress":
        g.polygon([(cx - 0.1 * u, y(0.48)), (cx + 0.1 * u, y(0.48)), (cx + 0.17 * u, y(0.78)),
                   (cx - 0.17 * u, y(0.78))], fill=1)  # fmt: skip
    sleeve = {"t-shirt": 0.32, "long-sleeved shirt": 0.47, "jacket": 0.48}.get(s.garment)
    if sleeve is not None:
        for side in (-1, 1):
            f = (sleeve - 0.22) / 0.28  # how far down the arm
            x1 = cx + side * (0.12 + 0.05 * f) * u
            limb(g, cx + side * 0.12 * u, y(0.22), x1, y(sleeve), 0.07, 1)
    return shape


def _fill_garment(s: Scene, S: int, img: Image.Image, lab: Image.Image, shape: Image.Image) -> None:
    base = vocab.COLOURS[s.colour]
    accent = vocab.COLOURS[s.accent]
    p = max(4, int(s.pattern_scale * S))
    cloth = Image.new("RGB", (S, S), base)
    c = ImageDraw.Draw(cloth)
    # the accent always covers well under half the garment, so that its colour is the base's
    # (a white shirt with black stripes is not a black one with white stripes)
    if s.pattern == "striped":
        for y0 in range(0, S, p):
            c.rectangle([0, y0, S, y0 + max(1, p // 3) - 1], fill=accent)
    elif s.pattern == "checked":  # a grid of accent lines (windowpane)
        w = max(1, p // 4)
        for t0 in range(0, S, p):
            c.rectangle([0, t0, S, t0 + w - 1], fill=accent)
            c.rectangle([t0, 0, t0 + w - 1, S], fill=accent)
    elif s.pattern == "dotted":
        r = max(1, p // 5)
        for y0 in range(p // 2, S, p):
            for x0 in range((y0 // p) % 2 * p // 2 + p // 2, S, p):
                c.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=accent)
    if s.garment == "jacket":  # a closed zip down the front
        cx = s.x * S
        c.line([cx, 0, cx, S], fill=_shade(base, 0.55), width=max(1, S // 200))
    img.paste(cloth, (0, 0), shape)
    lab.paste(GARMENT, (0, 0), shape)


def _light(image: np.ndarray, s: Scene) -> np.ndarray:
    n = image.shape[0]
    a = math.radians(s.light.angle)
    y, x = np.mgrid[0:n, 0:n] / max(1, n - 1) - 0.5
    t = (x * math.cos(a) + y * math.sin(a)) / math.sqrt(0.5) * 0.5 + 0.5  # 0..1 across
    return image * (s.light.low + (s.light.high - s.light.low) * t)[..., None]
