"""The worker's CostSpec: what the API server's mask-aware router needs to price a batch on this
worker without a model or torch (messages.CostSpec; priced by instgenie.scheduler.estimate).

Built by the denoise loop once its model is loaded, from the model itself (each hooked block's
dimensions and token stride, the prompt length, CFG) and its fitted latency profile, if any
(`--profile`, the same fits the per-step load planner uses). Sent with ChildReady and handed to
clients in Stats when asked (GetStats.cost).
"""

from __future__ import annotations

from instgenie.scheduler.pricing import block_dims
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
    profile = pipe.cost_model.profile if pipe.cost_model is not None else None
    return CostSpec(
        model=str(fam.spec),
        granule=int(fam.granule),
        text_len=int(fam.text_len),
        cfg=bool(fam.uses_cfg(2.0)),
        default_guidance=float(fam.default_guidance),
        default_steps=int(fam.default_steps),
        cache_dtype=str(pipe.store_dtype()).removeprefix("torch."),
        blocks=blocks,
        **(profile_fits(profile, loop_stages) if profile is not None else {}),
        profile=profile_path if profile is not None else "",
    )


def profile_fits(profile, loop_stages: bool = True) -> dict:  # noqa: ANN001 - a Profile
    """CostSpec's fit fields (compute, load, other, stages) from a fitted latency profile."""

    def fit(f) -> CostFit:  # noqa: ANN001 - a profiler.LinearFit
        return CostFit(slope=f.slope, intercept=f.intercept)

    return {
        "compute": {f"{c}/{m}": fit(f) for c, fits in profile.compute.items()
                    for m, f in fits.items()},
        "load": {t: fit(f) for t, f in profile.load.items()},
        "other": fit(profile.other) if profile.other is not None else None,
        "stages": {k: fit(f) for k, f in profile.stages.items()} if loop_stages else {},
    }  # fmt: skip
