"""Sparse convolutions (engine/masked/tiles.py, sparse_convs.py, conv_blocks.py), CPU, float64.

Replay exactness, ratio 1.0 and batch independence with sparse convs on are the invariants of
tests/engine/test_masked_exact.py, which runs with the default ExecConfig (sparse_convs "auto":
every ResNet and sampler of the UNet families is a hooked block there). Here: the tile forwards
against the stock modules (borders, odd sizes, every kind), the statistics' storage, the cache
layout and key, and the FLOP count of a masked step at m = 0.2.
"""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers.models.downsampling import Downsample2D
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.upsampling import Upsample2D
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from instgenie.config import ExecConfig, LimitsConfig
from instgenie.engine.costspec import family_blocks
from instgenie.engine.fused_norms import fuse_group_norms
from instgenie.engine.masked import sparse_convs as sc
from instgenie.engine.masked.conv_layout import decode_stats, encode_stats
from instgenie.engine.masked.tiles import build_tiles
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from instgenie.scheduler.pricing import conv_row_macs
from tests.conftest import make_image, make_mask, png_bytes

F64 = torch.float64


def _rows(out: torch.Tensor) -> torch.Tensor:
    return out.permute(0, 2, 3, 1).reshape(-1, out.shape[1])


def _scatter(tiles: torch.Tensor, ts, R: int, hw: tuple[int, int]) -> torch.Tensor:
    out = torch.full((R * hw[0] * hw[1], tiles.shape[1]), float("nan"), dtype=tiles.dtype)
    sc.scatter_tiles(out, tiles, ts)
    return out


def _rows_masks(R: int, L: int, seed: int) -> list[tuple[int, torch.Tensor]]:
    """Row 0: a random scattered subset (every border touched at this density); row 1: nothing
    but the four corners; row 2 (if any): every token."""
    g = torch.Generator().manual_seed(seed)
    side = int(L**0.5)
    rows = [(0, torch.randperm(L, generator=g)[: max(1, L // 7)].sort().values)]
    if R > 1:
        rows.append((1, torch.tensor(sorted({0, side - 1, L - side, L - 1}))))
    if R > 2:
        rows.append((2, torch.arange(L)))
    return rows


@pytest.mark.parametrize("hw", [(16, 16), (13, 18), (40, 36), (5, 7)])
@pytest.mark.parametrize("fused", [False, True])
def test_resnet_tiles_equal_the_stock_forward(hw: tuple[int, int], fused: bool) -> None:
    torch.manual_seed(0)
    block = ResnetBlock2D(in_channels=8, out_channels=12, temb_channels=6, groups=4).to(F64)
    if fused:  # the FusedGroupNorm swap (SiLU inside the norm, identity nonlinearity)
        assert fuse_group_norms(block, mode="off") == 2
    x, temb = torch.randn(3, 8, *hw, dtype=F64), torch.randn(3, 6, dtype=F64)
    y, stats = sc.resnet_dense(block, x, temb)
    assert torch.equal(y, block(x, temb))  # the capture forward is the stock one
    rows = _rows_masks(3, hw[0] * hw[1], seed=hw[0])
    ts = build_tiles("resnet", hw, rows)
    got = _scatter(sc.resnet_tiles(block, x, temb, ts, stats), ts, 3, hw)
    want = _rows(y)
    assert ts.dst.numel() == sum(idx.numel() for _, idx in rows)
    torch.testing.assert_close(got[ts.dst], want[ts.dst], rtol=0, atol=1e-12)


@pytest.mark.parametrize("hw", [(16, 16), (10, 14), (6, 6)])
def test_sampler_tiles_equal_the_stock_forward(hw: tuple[int, int]) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 8, *hw, dtype=F64)
    down = Downsample2D(8, use_conv=True, out_channels=8, padding=1).to(F64)
    up = Upsample2D(8, use_conv=True, out_channels=8).to(F64)
    for kind, block in (("down", down), ("up", up)):
        assert sc.check_supported(block) is None and sc.kind_of(block) == kind
        y = block(x)
        out_hw = tuple(y.shape[-2:])
        rows = _rows_masks(2, out_hw[0] * out_hw[1], seed=3)
        ts = build_tiles(kind, out_hw, rows)
        tiles = sc.down_tiles(block, x, ts) if kind == "down" else sc.up_tiles(block, x, ts)
        got = _scatter(tiles, ts, 2, out_hw)
        torch.testing.assert_close(got[ts.dst], _rows(y)[ts.dst], rtol=0, atol=1e-12)


def test_tiles_cover_only_masked_tokens_and_their_tiles() -> None:
    L = 32 * 32
    idx = torch.tensor([0, 33, 1023])  # corner tiles (0, 0) twice and (3, 3)
    ts = build_tiles("resnet", (32, 32), [(0, idx)])
    assert ts.t == 8 and ts.n == 2 and ts.a == 12
    assert ts.valid.shape == (2, 1, 12, 12)
    # the top-left tile's window starts 2 positions outside the image on both sides
    assert not ts.valid[0, 0, :2].any() and not ts.valid[0, 0, :, :2].any()
    assert ts.valid[0, 0, 2:, 2:].all()
    assert torch.equal(ts.dst, idx) and L == 1024


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_statistics_keep_twice_the_cache_precision(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # means and rstds of GroupNorms: 0.05 .. 2000 in magnitude, either sign
    v = torch.cat([torch.randn(4, 32, generator=g) * 300 + 1000,
                   -(torch.rand(4, 32, generator=g) * 50 + 0.05)], dim=1)  # fmt: skip
    enc = encode_stats(v, dtype)
    assert enc.dtype == dtype and enc.shape == (4, 1, 128)
    rel = ((decode_stats(enc) - v).abs() / v.abs()).max().item()
    one_rounding = torch.finfo(dtype).eps / 2
    assert rel < 8 * one_rounding**2, rel  # hi + lo: about the square of one rounding
    hi_only = ((enc[:, 0, :64].float() - v).abs() / v.abs()).max().item()
    assert hi_only > 20 * rel


@functools.cache
def _pipe(sparse: str) -> EditPipeline:
    return EditPipeline.load("sdxl-inpaint:tiny", dtype="fp64", execution=ExecConfig(
        sparse_convs=sparse), limits=LimitsConfig(max_image_pixels=512 * 512))  # fmt: skip


def test_cache_layout_and_key_follow_the_switch() -> None:
    on, off = _pipe("auto"), _pipe("off")
    kinds_on = [b.kind for b in on.family.masked.blocks]
    assert {"resnet", "down", "up", "unet"} == set(kinds_on)
    assert {b.kind for b in off.family.masked.blocks} == {"unet"}
    assert off.family.masked.convs is None
    # the transformer blocks keep their forward order; the conv blocks interleave with them
    names_on = [b.name for b in on.family.masked.blocks if b.kind == "unet"]
    assert names_on == [b.name for b in off.family.masked.blocks]
    img = png_bytes(make_image(64, 64, seed=1))
    spec = TemplateSpec(image=img, prompt="p", num_inference_steps=2)
    k_on, k_off = on.register_template(spec), off.register_template(spec)
    assert k_on != k_off  # a cache of one layout is never read with the other's block ids
    on.build_template(spec)
    meta = on.store.meta(k_on)
    convs = on.family.masked.convs
    assert len(meta.block_shapes) == on.family.masked.num_cached_blocks
    assert meta.block_shapes[convs.stats_block] == (1, 2 * convs.width)
    widths = {b: w for b, (_, w) in convs.stats.items()}
    assert sum(widths.values()) == convs.width and len(widths) == kinds_on.count("resnet")
    # every conv block's cached output is its (L, C_out) map at its level
    specs = {d.block_id: d for d in family_blocks(on.family)}
    for b, (kind, level) in convs.blocks.items():
        L, C = meta.block_shapes[b]
        assert L == (16 >> level) ** 2 and C == specs[b].channels, (b, kind)


def _count(pipe: EditPipeline, state) -> dict[str, int]:
    """FLOPs of one step by module kind: conv blocks (ResNets, samplers), the rest."""
    names = {f"UNet2DConditionModel.{b.name}" for b in pipe.family.masked.blocks
             if b.kind != "unet"}  # fmt: skip
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, depth=None) as fc:
        pipe.denoise_step([state])
    counts = fc.get_flop_counts()
    convs = sum(sum(c.values()) for n, c in counts.items() if n in names)
    return {"convs": convs, "total": fc.get_total_flops()}


def test_masked_step_conv_flops_at_m_0_2() -> None:
    """At m = 0.2 (160², every grid 10x10-multiple) the conv blocks cost what their active tiles
    cost, or their whole map where the tiles with conv1's halo would cover at least as many
    positions: expected from the tile counts alone (state.token_index -> build_tiles), measured
    by torch's FLOP counter. SDXL-tiny: 0.545 of the full conv FLOPs (its coarse 10x10 grid
    gets 4x4 tiles, whose halo makes them cost more than the map, which it computes instead; the
    20x20 grid 4x4 tiles, the 40x40 grid 8x8); the whole step costs 0.382 of a full step,
    against 0.533 with attention-only masking (transformer blocks: 0.278,
    test_masked_flops.py)."""
    pipe, size = _pipe("auto"), 160
    tpl = png_bytes(make_image(size, size, seed=1))
    key = pipe.build_template(TemplateSpec(image=tpl, num_inference_steps=3))
    edit = dict(image=tpl, mask=png_bytes(make_mask(size, size, (0.2, 0.3, 0.6, 0.8))),
                prompt="a coat", num_inference_steps=3)  # fmt: skip
    masked = pipe.preprocess(EditRequest(uid="m", template_id=key, **edit))
    full = pipe.preprocess(EditRequest(uid="f", **edit))
    assert masked.path == "masked" and full.path == "full"
    got_full, got_masked = _count(pipe, full), _count(pipe, masked)
    assert got_full["convs"] > 0
    # expected: per conv block, 2 * rows * MACs of its tiles (conv1 on t+2 windows, conv2 and
    # the shortcut on t x t tiles; samplers: t x t outputs)
    blocks = {d.block_id: d for d in family_blocks(pipe.family)}
    lat = masked.latents.shape[-2:]
    temb = 0  # the time embedding's projection: once per row, either way
    for b in pipe.family.masked.blocks:
        proj = getattr(pipe.family.backbone.get_submodule(b.name), "time_emb_proj", None)
        temb += 2 * masked.num_rows * proj.in_features * proj.out_features if proj else 0
    want, maps = temb, 0
    for b, (kind, level) in pipe.family.masked.convs.blocks.items():
        d, hw = blocks[b], (lat[0] >> level, lat[1] >> level)
        ts = build_tiles(kind, hw, [(0, masked.token_index[hw[0] * hw[1]])])
        t, inner = ts.t, ts.n * ts.t * ts.t
        outs = ts.n * ((t + 2) ** 2 + t * t) if kind == "resnet" else 2 * ts.n * t * t
        if outs >= 2 * hw[0] * hw[1]:  # tiles as large as the map: the map
            want += 2 * masked.num_rows * conv_row_macs(d, hw[0] * hw[1], hw[0] * hw[1])
            maps += 1
            continue
        if kind == "resnet":
            macs = 9 * ts.n * (t + 2) ** 2 * d.in_channels * d.channels + 9 * inner * d.channels**2
            macs += inner * d.in_channels * d.channels if d.in_channels != d.channels else 0
        else:
            macs = 9 * inner * d.in_channels * d.channels
        want += 2 * masked.num_rows * macs
    assert got_masked["convs"] == want and maps > 0
    assert got_masked["convs"] / got_full["convs"] == pytest.approx(0.545, abs=0.002)
    assert got_masked["total"] / got_full["total"] == pytest.approx(0.382, abs=0.002)
    # attention-only masking (sparse convs off) of the same edit: convs at full cost
    off = _pipe("off")
    key_off = off.build_template(TemplateSpec(image=tpl, num_inference_steps=3))
    masked_off = off.preprocess(EditRequest(uid="m", template_id=key_off, **edit))
    off_total = _count(off, masked_off)["total"]
    assert off_total / got_full["total"] == pytest.approx(0.533, abs=0.002)
    # pricing (pure Python, no masks) matches the stock forward's count at n = L
    grid = {b: (lat[0] >> lv) * (lat[1] >> lv) for b, (_, lv) in
            pipe.family.masked.convs.blocks.items()}  # fmt: skip
    want_full = temb + sum(2 * full.num_rows * conv_row_macs(blocks[b], L, L)
                           for b, L in grid.items())  # fmt: skip
    assert got_full["convs"] == want_full
