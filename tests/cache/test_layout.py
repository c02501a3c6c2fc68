"""TemplateLayout: the body of every disk file and DRAM segment (step-major, aligned, dense),
its views, and its strict JSON form."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from instgenie.cache.layout import TemplateLayout
from tests.cache.test_disk import LAYOUT


# ---- the layout (the body of every file and segment) --------------------------------------------
def slabs(lay: TemplateLayout) -> list[tuple[int, int]]:
    """(offset, nbytes) of every slab, in buffer order."""
    out = []
    for s in range(lay.num_steps):
        for b in range(lay.num_blocks):
            off, shape = lay.slab(s, b)
            out.append((off, torch.Size(shape).numel() * lay.torch_dtype.itemsize))
            if lay.fp8_scales:
                off, shape = lay.scale_slab(s, b)
                out.append((off, torch.Size(shape).numel() * 4))
        off, shape = lay.latents_slab(s)
        itemsize = torch.empty(0, dtype=getattr(torch, lay.latent_dtype)).element_size()
        out.append((off, torch.Size(shape).numel() * itemsize))
    return out


layouts = st.builds(
    TemplateLayout,
    num_steps=st.integers(1, 6),
    rows=st.integers(1, 2),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    block_shapes=st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=5
    ).map(tuple),  # fmt: skip
    latent_shape=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
    latent_dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
) | st.builds(
    lambda n, shapes: TemplateLayout(n, 2, "float8_e4m3fn", shapes, (4, 3), fp8_scales=True),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(1, 50), st.integers(1, 50)), min_size=1, max_size=3).map(tuple),
)


@settings(max_examples=150, deadline=None)
@given(lay=layouts)
def test_layout_is_step_major_aligned_and_dense(lay: TemplateLayout) -> None:
    parts = slabs(lay)
    assert all(off % 256 == 0 for off, _ in parts)
    assert parts == sorted(parts)  # step-major, blocks in id order, latents last in each step
    for (a, n), (b, _) in zip(parts, parts[1:], strict=False):
        assert a + n <= b < a + n + 256  # no overlap, only alignment padding between slabs
    assert parts[-1][0] + parts[-1][1] <= lay.nbytes < parts[-1][0] + parts[-1][1] + 256
    assert lay.nbytes == lay.step_nbytes * lay.num_steps
    assert TemplateLayout.from_json(lay.to_json()) == lay


def test_layout_views_share_memory() -> None:
    buf = torch.zeros(LAYOUT.nbytes, dtype=torch.uint8)
    v = LAYOUT.block_view(buf, 2, 1)
    assert v.shape == (2, 30, 40) and v.dtype == torch.bfloat16
    v.fill_(1.0)
    off, _ = LAYOUT.slab(2, 1)
    assert int(buf[off + 1]) == 0x3F and v.data_ptr() == buf.data_ptr() + off
    raw = bytearray(LAYOUT.nbytes)
    LAYOUT.latents_view(memoryview(raw), 0)[0, 0, 0, 0] = 2.0
    assert raw[LAYOUT.latents_slab(0)[0] + 3] == 0x40
    with pytest.raises(IndexError):
        LAYOUT.slab(3, 0)
    with pytest.raises(IndexError):
        LAYOUT.slab(0, 2)
    with pytest.raises(ValueError):  # no fp8 scales in a bf16 layout
        LAYOUT.scale_slab(0, 0)
    with pytest.raises(ValueError):  # the buffer is too small
        LAYOUT.block_view(buf[:100], 0, 0)


def test_layout_from_meta() -> None:
    from instgenie.cache.store import TemplateMeta

    meta = TemplateMeta(num_steps=4, num_rows=2, latent_shape=(1, 4, 8, 8),
                        block_shapes={1: (10, 8), 0: (20, 8)})  # fmt: skip
    lay = TemplateLayout.from_meta(meta, "float8_e4m3fn")
    assert lay.block_shapes == ((20, 8), (10, 8)) and lay.fp8_scales
    meta.block_shapes = {0: (1, 1), 2: (1, 1)}
    with pytest.raises(ValueError):
        TemplateLayout.from_meta(meta, "bfloat16")


GOOD = LAYOUT.to_dict()
BAD = [
    {"num_steps": -1},
    {"num_steps": 0},
    {"num_steps": True},
    {"num_steps": 3.0},
    {"num_steps": "3"},
    {"rows": 3},
    {"dtype": "int8"},
    {"dtype": "complex64"},
    {"latent_dtype": "float8_e4m3fn"},
    {"block_shapes": []},
    {"block_shapes": [[1, 2, 3]]},
    {"block_shapes": [[0, 4]]},
    {"block_shapes": [[-4, 4]]},
    {"block_shapes": [[2**40, 4]]},
    {"block_shapes": [[2**31, 2**31]], "num_steps": 10_000},  # 2^62 * ... bytes: overflow
    {"block_shapes": "[[1, 2]]"},
    {"latent_shape": []},
    {"latent_shape": [1, -1]},
    {"fp8_scales": True},  # needs the fp8 dtype
    {"fp8_scales": 1},
    {"version": 2},
    {"extra": 1},
]


@pytest.mark.parametrize("patch", BAD, ids=[str(b)[:40] for b in BAD])
def test_layout_json_is_strict(patch: dict) -> None:
    with pytest.raises(ValueError):
        TemplateLayout.from_json(json.dumps(GOOD | patch))


@pytest.mark.parametrize("text", ["", "nul", "[]", "{}", b"\xff\xfe", '{"version": 1}'])
def test_layout_json_garbage(text: str | bytes) -> None:
    with pytest.raises(ValueError):
        TemplateLayout.from_json(text)
    missing = dict(GOOD)
    del missing["rows"]
    with pytest.raises(ValueError):
        TemplateLayout.from_dict(missing)
