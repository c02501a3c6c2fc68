"""The worker's CostSpec: what the API server's mask-aware router needs to price a batch on this
worker without a model or torch (messages.CostSpec; priced by instgenie.server.estimate).

Built by the denoise loop once its model is loaded, from the model itself (each hooked block's
dimensions and token stride, the prompt length, CFG) and its fitted latency profile, if any
(`--profile`, the same fits the per-step load planner uses). Sent with ChildReady and handed to
clients in Stats when asked (GetStats.cost).
"""

from __future__ import annotations

from instgenie.cache.costs import block_dims
from instgenie.messages import CostBlock, CostFit, CostSpec


def cost_spec(pipe, profile_path: str = "", loop_stages: bool = True) -> CostSpec:  # noqa: ANN001
    """`pipe`: the loop's EditPipeline; `loop_stages`: its process runs each request's encode and
    decode (model_stages="loop" or inline stages), so they hold up its steps and are priced."""
    fam = pipe.family
    blocks = []
    for b in fam.masked.blocks:
        d = block_dims(fam.backbone.get_submodule(b.name), b.block_id, b.kind)
        blocks.append(CostBlock(
            block_id=b.block_id, kind=d.kind, channels=d.channels, ff_macs=d.ff_macs,
            context_dim=d.context_dim, mlp=d.mlp, stride=fam.token_stride * 2**b.level,
        ))  # fmt: skip
    compute: dict[str, CostFit] = {}
    load: dict[str, CostFit] = {}
    other = None
    stages: dict[str, CostFit] = {}
    profile = pipe.cost_model.profile if pipe.cost_model is not None else None
    if profile is not None:
        if profile.other is not None:
            other = CostFit(slope=profile.other.slope, intercept=profile.other.intercept)
        for cls, fits in profile.compute.items():
            for mode, f in fits.items():
                compute[f"{cls}/{mode}"] = CostFit(slope=f.slope, intercept=f.intercept)
        load = {t: CostFit(slope=f.slope, intercept=f.intercept) for t, f in profile.load.items()}
        if loop_stages:
            stages = {k: CostFit(slope=f.slope, intercept=f.intercept)
                      for k, f in profile.stages.items()}  # fmt: skip
    return CostSpec(
        model=str(fam.spec),
        granule=int(fam.granule),
        text_len=int(fam.text_len),
        cfg=bool(fam.uses_cfg(2.0)),
        default_guidance=float(fam.default_guidance),
        default_steps=int(fam.default_steps),
        cache_dtype=str(pipe.store_dtype()).removeprefix("torch."),
        blocks=blocks,
        compute=compute,
        load=load,
        other=other,
        stages=stages,
        profile=profile_path if profile is not None else "",
    )
