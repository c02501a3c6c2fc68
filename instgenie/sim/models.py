"""A worker's CostSpec for the simulator, without torch: the model's block list from the committed
`models.json` (written by scripts/make_sim_models.py from engine/costspec.py's `model_cost_spec`
of the model built on the meta device) and the fits of a committed profile (spec.profile_fits),
the very CostSpec a worker started with that profile reports (engine/costspec.py), so the
simulator's prices are the router's and the worker planner's."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources
from pathlib import Path

from instgenie.scheduler.fits import LinearFit, Profile, check_profile
from instgenie.scheduler.spec import BlockSpec, CostSpec, block_class, profile_fits


@cache
def _models() -> dict:
    return json.loads(resources.files("instgenie.sim").joinpath("models.json").read_text())


def known_models() -> list[str]:
    return sorted(_models())


def model_spec(model: str) -> CostSpec:
    """`model`'s CostSpec without fits (nominal FLOPs), cache dtype float16."""
    try:
        d = dict(_models()[model])
    except KeyError:
        raise ValueError(f"model {model!r}: no block list; known: {known_models()}") from None
    d["blocks"] = [BlockSpec(**b) for b in d["blocks"]]
    return CostSpec(cache_dtype="float16", **d)


def profile_spec(
    profile_path: str | Path,
    model: str | None = None,
    loop_stages: bool = True,
    disk_gbps: float | None = None,
    dram_gbps: float | None = None,
) -> CostSpec:
    """The CostSpec of a worker of `model` (default: the profile's) running with the profile at
    `profile_path`, its cache in the profile's dtype. `dram_gbps` / `disk_gbps` (GB/s = 1e9
    bytes/s) replace that tier's load fit by bytes / bandwidth (the fit's intercept kept when the
    profile has one): a host whose memory or disk is not the profiled one's."""
    profile = Profile.load_file(profile_path)
    base = model_spec(model or profile.model)
    check_profile(profile, {b.block_id: block_class(b) for b in base.blocks}, str(profile_path))
    fits = profile_fits(profile, loop_stages)
    load = fits["load"]
    for tier, gbps in (("dram", dram_gbps), ("disk", disk_gbps)):
        if gbps is not None:
            if not gbps > 0:
                raise ValueError(f"{tier} bandwidth must be > 0 GB/s, got {gbps}")
            old = load.get(tier)
            load[tier] = LinearFit(1.0 / (gbps * 1e6), old.intercept if old else 0.0)
    fits["load"] = load
    return dataclasses.replace(base, cache_dtype=profile.dtype, profile=str(profile_path), **fits)
