"""PNG encode time and size per ExecConfig.png_compression setting (decision 0040): 1024² RGB
images of four kinds — a generated edit (docs/demo-edit.png's after, sdxl-inpaint:ref, bicubic
to the side: smooth), a procedural scene (a rendering with its grain), the same with
sensor-like noise (σ = 6, a photograph's texture), and uniform noise (a random-weight model's
output, the worst case) — each encoded `--repeat` times by imageio.encode_image; the median
time; plus "fast-pillow", the "fast" level by Pillow on one core (what "fast" was before the
banded encoder, decision 0053). Prints a Markdown table and writes JSON.

    python bench/png_encode.py --out docs/benchmarks/data/png-encode.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instgenie.dataset.render import render  # noqa: E402
from instgenie.dataset.write import entry, scene_of  # noqa: E402
from instgenie.engine import png_bands  # noqa: E402
from instgenie.engine.imageio import PNG_SETTINGS, encode_image  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def images(side: int) -> dict[str, np.ndarray]:
    demo = Image.open(ROOT / "docs" / "demo-edit.png").convert("RGB")
    third = demo.width // 3  # before | mask | after
    edit = demo.crop((2 * third, 0, demo.width, demo.height))
    edit = np.asarray(edit.resize((side, side), Image.Resampling.BICUBIC))
    scene = render(scene_of(entry(0, 0, 64)[0]), side)[0]
    rng = np.random.default_rng(0)
    noisy = np.clip(scene + rng.normal(0, 6, scene.shape), 0, 255).astype(np.uint8)
    return {"generated edit": edit, "scene": scene, "scene + noise": noisy,
            "uniform noise": rng.integers(0, 256, scene.shape, dtype=np.uint8)}  # fmt: skip


def encode(img: Image.Image, name: str) -> bytes:
    if name != "fast-pillow":
        return encode_image(img, "png", png_compression=name)
    level, strategy = PNG_SETTINGS["fast"]
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=level, compress_type=strategy)
    return buf.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for kind, array in images(args.side).items():
        img = Image.fromarray(array)
        for name in [*PNG_SETTINGS, "fast-pillow"]:
            times, data = [], b""
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                data = encode(img, name)
                times.append(time.perf_counter() - t0)
            level, strategy = PNG_SETTINGS[name.removesuffix("-pillow")]
            rows.append({"image": kind, "setting": name, "level": level,
                         "strategy": "rle" if strategy == zlib.Z_RLE else "default",
                         "ms": round(1000 * statistics.median(times), 1),
                         "kib": round(len(data) / 1024, 1)})  # fmt: skip
    print("| image | setting (zlib level, strategy) | encode ms | KiB |")
    print("|---|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['image']} | {r['setting']} ({r['level']}, {r['strategy']}) | {r['ms']} "
            f"| {r['kib']} |"
        )
    if args.out is not None:
        record = {"side": args.side, "repeat": args.repeat, "rows": rows,
                  "cpu": platform.processor() or platform.machine(), "pillow": PIL.__version__,
                  "cores": os.cpu_count(), "band_threads": png_bands.THREADS,
                  "python": platform.python_version()}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
