"""The banded PNG encoder (engine/png_bands.py, decision 0053): lossless at every size (bands of
one row, images of one pixel or one column, band edges anywhere), one valid zlib stream whatever
the band count (Adler-32 combined across bands), the same bytes for any band count, and
Pillow's adaptive filtering: within a few per mille of Pillow's bytes at the same level."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from instgenie.engine.png_bands import _adler_combine, encode_png


def _image(h: int, w: int, seed: int, smooth: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if not smooth:
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 3 + yy, yy * 2, (xx + yy) // 2], axis=-1)
    return ((base + rng.normal(0, 2, base.shape)) % 256).astype(np.uint8)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, out = 8, []
    while at < len(data):
        n = int.from_bytes(data[at : at + 4], "big")
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + n]
        assert int.from_bytes(data[at + 8 + n : at + 12 + n], "big") == zlib.crc32(kind + body)
        out.append((kind, body))
        at += 12 + n
    return out


@pytest.mark.parametrize("h, w", [(1, 1), (1, 1000), (1000, 1), (3, 5), (129, 67), (256, 256)])
@pytest.mark.parametrize("smooth", [True, False])
@pytest.mark.parametrize("bands", [None, 1, 2, 7, 10_000])
def test_lossless_at_every_size_and_band_count(h, w, smooth, bands) -> None:
    rgb = _image(h, w, h * w, smooth)
    data = encode_png(rgb, 1, zlib.Z_RLE, bands=bands)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), rgb)
    kinds = [k for k, _ in _chunks(data)]
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]
    # one zlib stream: zlib itself checks the header and the combined Adler-32
    raw = zlib.decompress(dict(_chunks(data))[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    assert set(raw[:: 1 + 3 * w]) <= {0, 1, 2, 4}  # each row's filter type


def test_the_band_count_does_not_change_the_filtered_rows() -> None:
    rgb = _image(200, 90, 1, True)
    raws = {zlib.decompress(dict(_chunks(encode_png(rgb, 6, bands=b)))[b"IDAT"])
            for b in (1, 3, 8, 200)}  # fmt: skip
    assert len(raws) == 1


@pytest.mark.parametrize("smooth", [True, False])
def test_bytes_are_pillows_within_a_few_per_mille(smooth: bool) -> None:
    rgb = _image(512, 512, 3, smooth)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG", compress_level=1, compress_type=zlib.Z_RLE)
    ours = encode_png(rgb, 1, zlib.Z_RLE)
    assert abs(len(ours) - len(buf.getvalue())) <= 0.005 * len(buf.getvalue())


def test_adler_combine_is_zlibs() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.bytes(100_003), rng.bytes(65_521 * 3 + 7)
    assert _adler_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)
    assert _adler_combine(1, zlib.adler32(b), len(b)) == zlib.adler32(b)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((4, 4), np.uint8),
        np.zeros((4, 4, 4), np.uint8),
        np.zeros((0, 4, 3), np.uint8),
        np.zeros((4, 4, 3), np.float32),
    ],
)
def test_rejects_what_is_not_rgb8(bad) -> None:
    with pytest.raises(ValueError):
        encode_png(bad, 1)
