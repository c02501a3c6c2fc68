"""FLOP accounting of a masked denoising step (torch.utils.flop_counter, tiny models, CPU).

Expected cost, per Table 1 of the paper: at mask ratio m the feed-forward, the query/output
projections and the attention scores of the masked tokens cost m of full; the keys/values are
still projected for every token (paper Fig. 5: queries from masked tokens, keys/values from all
tokens), and text tokens (Flux) and text keys/values (cross-attention) are always computed. The
non-transformer part (ResNets, proj_in/out, embedders) runs at full cost. `expected_*` below
count multiply-adds from the block shapes alone (independent of the implementation); the
measured masked FLOPs must not exceed them, and must match them closely.
"""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_flux import (
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from instgenie.config import ExecConfig, LimitsConfig
from instgenie.engine.pipeline import EditPipeline
from instgenie.engine.request import EditRequest
from instgenie.engine.templates import TemplateSpec
from tests.conftest import make_image, make_mask, png_bytes

# image side per family: every token grid a multiple of 10x10, so m is exactly 0.2 at every
# resolution (SD2-tiny's coarsest grid is 1/32 of the side: 5x5 at 160)
SIZES = {"sdxl-inpaint": 160, "flux-fill": 160, "sd2-inpaint": 320}
M = 0.2
BOX = (0.2, 0.3, 0.6, 0.8)  # 0.4 x 0.5 of the image = 0.2


@functools.cache
def pipeline(family: str) -> EditPipeline:
    # SD2-tiny runs at 320^2, over the tiny models' default pixel cap (4 x 128^2); attention-only
    # masking: the conv blocks' sparse FLOPs are test_sparse_convs.py's
    return EditPipeline.load(f"{family}:tiny", limits=LimitsConfig(max_image_pixels=512 * 512),
                             execution=ExecConfig(sparse_convs="off"))  # fmt: skip


def _block_names(model: torch.nn.Module) -> set[str]:
    kinds = (BasicTransformerBlock, FluxTransformerBlock, FluxSingleTransformerBlock)
    root = type(model).__name__
    return {f"{root}.{n}" for n, m in model.named_modules() if isinstance(m, kinds)}


def _count_step(pipe: EditPipeline, *states) -> tuple[int, int]:
    """(FLOPs inside transformer blocks, total FLOPs) of one denoising step of these requests."""
    backbone = pipe.family.backbone
    # the math SDPA backend decomposes into counted matmuls (the fused CPU kernel is not counted)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, depth=None) as fc:
        pipe.denoise_step(list(states))
    counts = fc.get_flop_counts()
    blocks = _block_names(backbone)
    in_blocks = sum(sum(c.values()) for name, c in counts.items() if name in blocks)
    return in_blocks, fc.get_total_flops()


def _unet_block_macs(block: BasicTransformerBlock, L: int, n: int, text_len: int) -> int:
    """Multiply-adds of one BasicTransformerBlock row computing n of its L tokens."""
    C = block.norm1.normalized_shape[0]
    ctx_dim = block.attn2.to_k.in_features
    ff = block.ff.net[0].proj.out_features * C + block.ff.net[2].in_features * C
    return (
        2 * n * C * C + 2 * L * C * C  # attn1: q, out on n tokens; k, v on all L tokens
        + 2 * n * L * C  # attn1 scores and PV
        + 2 * n * C * C + 2 * text_len * ctx_dim * C  # attn2: q, out; k, v on the text
        + 2 * n * text_len * C  # attn2 scores and PV
        + n * ff  # feed-forward (GEGLU: C -> 2*4C, 4C -> C)
    )  # fmt: skip


def _flux_block_macs(block: torch.nn.Module, L: int, n: int, tt: int) -> int:
    """Multiply-adds of one Flux block row: n of L image tokens queried, tt text tokens."""
    C = block.attn.to_q.in_features
    if isinstance(block, FluxTransformerBlock):
        ff = 8 * C * C
        return (
            2 * 6 * C * C  # AdaLN modulation of image and text streams (once per row)
            + 4 * tt * C * C + tt * ff  # text: q, k, v, out projections and feed-forward
            + 2 * n * C * C + 2 * L * C * C  # image: q, out on n tokens; k, v on all tokens
            + n * ff  # image feed-forward
            + 2 * (tt + n) * (tt + L) * C  # joint attention scores and PV
        )  # fmt: skip
    mlp = block.proj_mlp.out_features
    per_query = C * C + C * mlp + (C + mlp) * C  # q, proj_mlp, proj_out
    return (
        3 * C * C  # AdaLN modulation (once per row)
        + (tt + n) * per_query + 2 * (tt + L) * C * C  # k, v on every token
        + 2 * (tt + n) * (tt + L) * C
    )  # fmt: skip


def _expected_fraction(pipe: EditPipeline, state, size: int) -> float:
    """Masked / full multiply-adds of the transformer blocks for this request."""
    backbone, masks = pipe.family.backbone, state.token_index
    full = masked = 0
    if pipe.family.backbone_name == "unet":
        text_len = state.cond["prompt_embeds"].shape[1]
        for L, blocks in _probe_blocks(pipe, size).items():
            n = masks[L].numel()
            for block in blocks:
                full += state.num_rows * _unet_block_macs(block, L, L, text_len)
                masked += state.num_rows * _unet_block_macs(block, L, n, text_len)
    else:
        ((L, idx),) = masks.items()
        tt = state.cond["prompt_embeds"].shape[1]
        for block in [*backbone.transformer_blocks, *backbone.single_transformer_blocks]:
            full += _flux_block_macs(block, L, L, tt)
            masked += _flux_block_macs(block, L, idx.numel(), tt)
    return masked / full


@functools.cache
def _probe_blocks(pipe: EditPipeline, size: int) -> dict[int, list[BasicTransformerBlock]]:
    """{L: BasicTransformerBlocks whose input has L tokens}, found by a shape probe."""
    seen: dict[int, list] = {}
    hooks = []
    for m in pipe.family.backbone.modules():
        if isinstance(m, BasicTransformerBlock):

            def hook(mod, args, kwargs, seen=seen):
                seen.setdefault(args[0].shape[1] if args else kwargs["hidden_states"].shape[1],
                                []).append(mod)  # fmt: skip

            hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    state = pipe.preprocess(_edit(None, size))
    pipe.denoise_step([state])
    for h in hooks:
        h.remove()
    return {L: list(dict.fromkeys(mods)) for L, mods in seen.items()}


def _edit(
    template_id: str | None, size: int, box=BOX, image_seed: int = 1, uid: str = "flops"
) -> EditRequest:
    return EditRequest(
        uid=uid,
        image=png_bytes(make_image(size, size, seed=image_seed)),
        mask=png_bytes(make_mask(size, size, box)),
        prompt="a wool coat",
        num_inference_steps=3,
        template_id=template_id,
    )


@pytest.mark.parametrize("family", list(SIZES))
def test_masked_step_flops_within_table1(family: str) -> None:
    pipe, size = pipeline(family), SIZES[family]
    key = pipe.build_template(
        TemplateSpec(image=png_bytes(make_image(size, size, seed=1)), num_inference_steps=3)
    )
    full_state = pipe.preprocess(_edit(None, size))
    masked_state = pipe.preprocess(_edit(key, size))
    assert masked_state.path == "masked"
    ratios = {L: idx.numel() / L for L, idx in masked_state.token_index.items()}
    assert all(abs(r - M) < 1e-9 for r in ratios.values()), ratios

    full_blocks, full_total = _count_step(pipe, full_state)
    masked_blocks, masked_total = _count_step(pipe, masked_state)
    expected = _expected_fraction(pipe, masked_state, size)
    # the computed expectation at m = 0.2: SDXL-tiny 0.2780, Flux-tiny 0.2976, SD2-tiny (320^2)
    # 0.2040 of the full transformer-block FLOPs (K/V of every token, text K/V and Flux's text
    # tokens do not shrink; SD2-tiny's narrow blocks at 6400 tokens are attention-dominated)
    assert expected == pytest.approx(
        {"sdxl-inpaint": 0.2780, "flux-fill": 0.2976, "sd2-inpaint": 0.2040}[family], abs=1e-4
    )
    measured = masked_blocks / full_blocks
    assert measured <= expected * (1 + 1e-9), (measured, expected)
    assert measured == pytest.approx(expected, rel=1e-3)
    rest = full_total - full_blocks
    assert masked_total - masked_blocks == rest  # non-transformer part unchanged
    assert masked_total <= rest + expected * full_blocks * (1 + 1e-9)


@pytest.mark.parametrize("family", ["sdxl-inpaint", "flux-fill"])
def test_mixed_batch_costs_the_sum_of_its_requests(family: str) -> None:
    """One batch of two templates, two masks (m = 0.2 and 0.06), two step indices and a full-path
    request costs exactly what its requests cost alone: masked tokens are packed, not padded to
    the largest mask (padding would charge the m = 0.06 request the m = 0.2 one's projections
    and feed-forward), and a full-path row costs a full row."""
    pipe, size = pipeline(family), SIZES[family]
    keys = [
        pipe.build_template(
            TemplateSpec(image=png_bytes(make_image(size, size, seed=s)), num_inference_steps=3)
        )
        for s in (1, 2)
    ]
    small = (0.5, 0.5, 0.8, 0.7)  # 0.3 x 0.2 of the image = 0.06

    def states():
        a = pipe.preprocess(_edit(keys[0], size, uid="a"))
        b = pipe.preprocess(_edit(keys[1], size, small, image_seed=2, uid="b"))
        c = pipe.preprocess(_edit(None, size, uid="c"))
        pipe.denoise_step([a])  # a is one step ahead of b and c
        return a, b, c

    a, b, c = states()
    assert (a.path, b.path, c.path) == ("masked", "masked", "full")
    for state, m in ((a, M), (b, 0.06)):
        ratios = [idx.numel() / L for L, idx in state.token_index.items()]
        assert ratios == pytest.approx([m] * len(ratios), abs=1e-9), (state.uid, ratios)
    assert (a.step_index, b.step_index, c.step_index) == (1, 0, 0)

    mixed_blocks, mixed_total = _count_step(pipe, a, b, c)
    alone = [_count_step(pipe, s) for s in states()]
    # FLOP counts are integers of the shapes run: equal, not approximately equal
    assert mixed_blocks == sum(blocks for blocks, _ in alone), (mixed_blocks, alone)
    assert mixed_total == sum(total for _, total in alone)
    assert alone[1][0] < alone[0][0] < alone[2][0]  # m = 0.06 < m = 0.2 < full
