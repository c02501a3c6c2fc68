"""The worker's CostSpec (scheduler.spec): what its own per-step planner prices with and what the
API server's mask-aware router needs to price a batch on this worker without a model or torch.

Built from the loaded model itself (each hooked block's dimensions and token stride, the prompt
length, CFG) and its fitted latency profile, if any (`--profile`): by the pipeline for its
planner (engine/step_pricing.py) and by the denoise loop once its model is loaded, which sends it
with ChildReady and hands it to clients in Stats when asked (GetStats.cost).
"""

from __future__ import annotations

import dataclasses

from instgenie.scheduler.fits import Profile
from instgenie.scheduler.spec import BlockSpec, CostSpec, profile_fits


def block_spec(block, block_id: int, kind: str, stride: int) -> BlockSpec:  # noqa: ANN001
    """The BlockSpec of one hooked diffusers block (a torch module) of token stride `stride`."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    if kind in ("resnet", "down", "up"):  # sparse convs: engine/masked/conv_blocks.py
        c_in = block.in_channels if kind == "resnet" else block.channels
        return BlockSpec(block_id=block_id, kind=kind, channels=block.out_channels, ff_macs=0,
                         stride=stride, in_channels=c_in)  # fmt: skip
    if kind == "unet":
        assert isinstance(block, BasicTransformerBlock)
        C = block.norm1.normalized_shape[0]
        proj = block.ff.net[0].proj.out_features  # GEGLU: C -> 2 * inner
        inner = block.ff.net[2].in_features
        ctx = block.attn2.to_k.in_features if block.attn2 is not None else 0
        return BlockSpec(block_id=block_id, kind=kind, channels=C, ff_macs=C * proj + inner * C,
                         context_dim=ctx, stride=stride)  # fmt: skip
    C = block.attn.to_q.in_features
    if kind == "flux_dual":
        assert isinstance(block, FluxTransformerBlock)
        inner = block.ff.net[2].in_features
        return BlockSpec(block_id=block_id, kind=kind, channels=C, ff_macs=2 * C * inner,
                         stride=stride)  # fmt: skip
    mlp = block.proj_mlp.out_features
    return BlockSpec(block_id=block_id, kind=kind, channels=C, ff_macs=0, mlp=mlp, stride=stride)


def family_blocks(fam) -> list[BlockSpec]:  # noqa: ANN001 - a loaded model family
    """The BlockSpec of every block the masked executor runs (transformer blocks; with sparse
    convs also ResNets and samplers), in execution order; K/V blocks marked."""
    kv = fam.masked.kv
    return [
        dataclasses.replace(
            block_spec(fam.backbone.get_submodule(b.name), b.block_id, b.kind,
                       fam.token_stride * 2**b.level),
            kv=kv is not None and b.block_id in kv,
        )
        for b in fam.masked.blocks
    ]  # fmt: skip


def cost_spec(pipe, profile_path: str = "", loop_stages: bool = True) -> CostSpec:  # noqa: ANN001
    """The CostSpec of `pipe`, an EditPipeline (its family, store dtype and profile,
    pipe.profile); `loop_stages`: its process runs each request's encode and decode
    (model_stages="loop" or inline stages), so they hold up its steps and are priced."""
    return model_cost_spec(pipe.family, str(pipe.store_dtype()), pipe.profile, profile_path,
                           loop_stages, pipe.compute_margin)  # fmt: skip


def model_cost_spec(
    fam,  # noqa: ANN001 - a loaded model family
    cache_dtype: str,
    profile: Profile | None,
    profile_path: str = "",
    loop_stages: bool = True,
    compute_margin: int | None = None,
) -> CostSpec:
    """The CostSpec of a loaded model whose caches are stored in `cache_dtype` (e.g.
    "torch.float16"), priced with `profile`'s fits (None: nominal FLOPs); `compute_margin`:
    its pipeline's (None: the family's)."""
    return CostSpec(
        model=str(fam.spec),
        granule=int(fam.granule),
        text_len=int(fam.text_len),
        cfg=bool(fam.uses_cfg(2.0)),
        default_guidance=float(fam.default_guidance),
        default_steps=int(fam.default_steps),
        cache_dtype=cache_dtype.removeprefix("torch."),
        blocks=family_blocks(fam),
        **(profile_fits(profile, loop_stages) if profile is not None else {}),
        profile=profile_path if profile is not None else "",
        compute_margin=int(fam.compute_margin if compute_margin is None else compute_margin),
        buckets=buckets_on(fam),
        kv_cache=fam.masked.kv is not None,
    )


def buckets_on(fam) -> bool:  # noqa: ANN001 - a loaded model family
    """Its masked steps replay bucket graphs (engine/bucket_graphs.py: CUDA, graphs not off)."""
    ex = fam.execution
    return (ex.graph_capture == "buckets" and ex.cuda_graphs != "off"
            and fam.device.type == "cuda")  # fmt: skip
