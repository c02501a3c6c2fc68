"""What a worker reports so that it can be priced without its model: each hooked transformer
block's shape and token stride (`BlockSpec`) and the worker's `CostSpec` (its blocks, prompt
length, CFG, defaults, cache dtype, and the fits of its profile, if any).

Built by the worker's engine once its model is loaded (engine/costspec.py), used by the worker's
own per-step planner and sent to the router (messages.ChildReady.cost, Stats.cost), which prices
with the same `pricing.step_costs`. Both types travel on the wire as nested structs (messages.py
registers them): frozen, slotted dataclasses of wire-typed fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from instgenie.scheduler.fits import LinearFit, Profile


@dataclass(slots=True, frozen=True, kw_only=True)
class BlockSpec:
    """Static shape of one hooked block (independent of resolution and batch)."""

    block_id: int  # execution order, 0-based
    kind: str  # "unet" | "flux_dual" | "flux_single" | sparse convs: "resnet" | "down" | "up"
    channels: int  # hidden width C (conv blocks: output channels)
    #: multiply-adds of the feed-forward per token (UNet GEGLU: C*8C + 4C*C; Flux: 8C^2 / mlp)
    ff_macs: int
    stride: int  # pixels per token side: the block's token grid is (H / stride, W / stride)
    context_dim: int = 0  # cross-attention context width (UNet attn2), 0 otherwise
    mlp: int = 0  # Flux single block: MLP hidden width, 0 otherwise
    in_channels: int = 0  # conv blocks: input channels, 0 otherwise
    #: its cache holds keys and values (ExecConfig.kv_cache): it projects only masked tokens
    #: to keys/values and a host load carries two slabs (engine/masked/kv_layout.py)
    kv: bool = False


def block_class(d: BlockSpec) -> str:
    """The class a profile fits one latency model per mode for: blocks of one kind and width."""
    return f"{d.kind}:{d.channels}"


@dataclass(slots=True, frozen=True, kw_only=True)
class CostSpec:
    """What the router needs to price a worker's batch (sent by its loop at ready)."""

    model: str  # model id
    granule: int  # working sizes are multiples of this, pixels
    text_len: int  # prompt tokens per row
    cfg: bool  # a request with guidance > 1 runs two rows (classifier-free guidance)
    default_guidance: float  # guidance of a request that gives none
    default_steps: int  # steps of a request that gives none
    cache_dtype: str  # dtype of cached rows, e.g. "float16"
    blocks: list[BlockSpec]  # in execution order
    #: fitted latency models (instgenie profile): "<block class>/<mode>" -> fit of ms against
    #: FLOPs, mode "cached" | "full"; empty: no profile, prices are nominal FLOPs
    compute: dict[str, LinearFit] = field(default_factory=dict)
    load: dict[str, LinearFit] = field(default_factory=dict)  # tier -> fit of ms against bytes
    #: the step outside its transformer blocks: fit of ms against batch rows * pixels; None:
    #: not in the profile (or no profile)
    other: LinearFit | None = None
    #: the loop's model work per request outside its steps, each a fit of ms against the
    #: request's working pixels: "encode" (on receipt), "decode" (when it leaves the batch);
    #: empty: not in the profile, or that work does not run in the loop (model_stages="process")
    stages: dict[str, LinearFit] = field(default_factory=dict)
    profile: str = ""  # the profile file's path, "" if none
    #: a template capture run's cost to its loop beyond its priced steps, fit of ms against
    #: pixels x steps (Profile.capture); None: not in the profile
    capture: LinearFit | None = None
    #: pixels around an edit's mask its masked path computes too (ModelConfig.compute_margin):
    #: the router dilates masks by it before measuring token ratios
    compute_margin: int = 0
    #: masked steps pad their packed tokens up to a bucket's capacity and replay its graph
    #: (ExecConfig.graph_capture "buckets" on CUDA, scheduler/buckets.py): pricing adds the pads
    buckets: bool = False
    #: Flux blocks' caches hold keys and values instead of outputs (ExecConfig.kv_cache; the
    #: blocks doing so have BlockSpec.kv): such a block cannot compute all tokens, so the
    #: planner gets no choice (engine/masked/kv_layout.py)
    kv_cache: bool = False


def profile_fits(profile: Profile, loop_stages: bool = True) -> dict:
    """CostSpec's fit fields (compute, load, other, stages, capture) from a fitted profile;
    `loop_stages`: the loop's process runs each request's encode and decode (else no stages)."""
    return {
        "compute": {f"{c}/{m}": f for c, fits in profile.compute.items()
                    for m, f in fits.items()},
        "load": dict(profile.load),
        "other": profile.other,
        "stages": dict(profile.stages) if loop_stages else {},
        "capture": profile.capture,  # a loop's capture: wherever its stages run
    }  # fmt: skip
