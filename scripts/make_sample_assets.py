"""Regenerate the bundled sample template and mask (instgenie/assets/sample*.png).

A 256x256 drawn "product photo" (backdrop, figure, shirt) and a mask over the shirt, so that the
demo edits a region the way a virtual try-on request does (mask ratio about 0.15).

    python scripts/make_sample_assets.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

ASSETS = Path(__file__).resolve().parents[1] / "instgenie" / "assets"
SIZE = 256


def main() -> None:
    y = np.linspace(0, 1, SIZE)[:, None, None]
    backdrop = (np.array([236, 228, 214]) * (1 - 0.25 * y)).repeat(SIZE, axis=1)
    img = Image.fromarray(backdrop.astype(np.uint8), "RGB")
    d = ImageDraw.Draw(img)
    d.ellipse([103, 28, 153, 84], fill=(224, 186, 160))  # head
    d.rectangle([120, 80, 136, 96], fill=(214, 176, 150))  # neck
    shirt = [
        (78, 98),
        (178, 98),
        (196, 170),
        (172, 176),
        (168, 212),
        (88, 212),
        (84, 176),
        (60, 170),
    ]
    d.polygon(shirt, fill=(46, 84, 140))  # shirt
    d.rectangle([92, 212, 164, 256], fill=(60, 60, 70))  # trousers
    img = img.filter(ImageFilter.GaussianBlur(0.8))
    mask = Image.new("L", (SIZE, SIZE), 0)
    ImageDraw.Draw(mask).polygon(shirt, fill=255)
    img.save(ASSETS / "sample.png")
    mask.save(ASSETS / "sample_mask.png")
    ratio = (np.asarray(mask) >= 128).mean()
    print(f"wrote {ASSETS}/sample.png and sample_mask.png (mask ratio {ratio:.3f})")


if __name__ == "__main__":
    main()
