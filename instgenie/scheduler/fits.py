"""Latency models: one linear fit type, and the profile schema that holds a model's fits.

A profile (profiles/*.json, written by `instgenie profile`, measured by engine/profiling.py) has,
per block class ("<kind>:<channels>", spec.block_class) and mode ("cached" = masked tokens from
a cache, "full" = every token), a fit of ms against the block's FLOPs (pricing.batch_flops); per
load tier ("dram", "disk") a fit of ms against bytes; the rest of the step ("other") against
batch rows * pixels; the loop's per-request stages ("encode", "decode") against pixels; and
what a template's capture run costs its loop beyond its priced steps ("capture", against pixels
x steps: fitted from a served step log, `instgenie profile --capture-from`).
The same `LinearFit` travels in a worker's CostSpec (spec.py), so the router and the worker's
planner price with the very fits the profile holds. Pure Python and numpy: scikit-learn is
imported only by `LinearFit.fit` (profiling).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

#: compute modes of a block: its masked tokens from a cache, or every token
MODES = ("cached", "full")
#: the loop's per-request model work outside its steps, fitted against pixels
STAGES = ("encode", "decode")


@dataclass(slots=True, frozen=True)
class LinearFit:
    """latency_ms = max(0, slope * x + intercept); x = FLOPs, bytes or pixels (the fit's use)."""

    slope: float  # ms per unit of x
    intercept: float  # ms
    r2: float = 0.0  # coefficient of determination on its samples (0: not recorded)
    n: int = 0  # samples fitted (0: not recorded)

    def predict(self, x: float) -> float:
        return max(0.0, self.slope * x + self.intercept)

    @classmethod
    def fit(cls, x: list[float], y: list[float]) -> LinearFit:
        """Least squares of y on x (scikit-learn); one distinct x: a constant model."""
        X, Y = np.asarray(x, dtype=np.float64)[:, None], np.asarray(y, dtype=np.float64)
        if len(set(x)) < 2:  # one distinct x: a constant model (R² undefined -> 1 if exact)
            return cls(0.0, float(Y.mean()), 1.0 if np.ptp(Y) == 0 else 0.0, len(x))
        from sklearn.linear_model import LinearRegression

        reg = LinearRegression().fit(X, Y)
        return cls(float(reg.coef_[0]), float(reg.intercept_), float(reg.score(X, Y)), len(x))


def fit_ms(fit: LinearFit | None, x: float) -> float:
    """A fitted latency at `x`, ms; 0 for no fit (a class or tier the profile lacks:
    check_profile refuses such profiles)."""
    return 0.0 if fit is None else fit.predict(x)


def fit_stages(samples: Mapping[str, list[tuple[int, float]]]) -> dict[str, LinearFit]:
    """Stage fits from their (pixels, ms) samples; a stage without samples gets none."""
    return {s: LinearFit.fit([x for x, _ in pts], [ms for _, ms in pts])
            for s, pts in samples.items() if pts}  # fmt: skip


@dataclass
class Profile:
    model: str
    device: str
    dtype: str
    size: int
    #: block class -> mode -> fit of ms against FLOPs
    compute: dict[str, dict[str, LinearFit]]
    #: tier -> fit of ms against bytes
    load: dict[str, LinearFit]
    #: block id -> class
    blocks: dict[int, str]
    meta: dict
    #: the step outside its blocks: fit of ms against batch rows * pixels; None in profiles
    #: fitted before it was measured
    other: LinearFit | None = None
    #: stage (STAGES) -> fit of ms against working pixels of one request; empty in profiles
    #: fitted before they were measured
    stages: dict[str, LinearFit] = field(default_factory=dict)
    #: a template's capture run in a served loop: what its steps take beyond their price (the
    #: segment's creation, the copies beside the steps, the commit, its batch run eagerly), fit
    #: of ms against the template's working pixels x its steps (its bytes scale with both);
    #: None: not fitted (a capture is priced as a full-path request alone)
    capture: LinearFit | None = None

    def set_stages(self, samples: dict[str, list[tuple[int, float]]]) -> None:
        """Fit the stages from their (pixels, ms) samples and keep the samples in meta."""
        self.stages = fit_stages(samples)
        self.meta = dict(self.meta, stage_samples={k: [[x, ms] for x, ms in v]
                                                   for k, v in samples.items()})  # fmt: skip

    def compute_ms(self, block_id: int, mode: str, flops: float) -> float:
        return self.compute[self.blocks[block_id]][mode].predict(flops)

    def load_ms(self, tier: str, nbytes: float) -> float:
        return self.load[tier].predict(nbytes) if nbytes > 0 else 0.0

    def to_json(self) -> dict:
        compute = {c: {m: asdict(f) for m, f in fits.items()} for c, fits in self.compute.items()}
        return {
            "model": self.model, "device": self.device, "dtype": self.dtype, "size": self.size,
            "compute": compute,
            "load": {t: asdict(f) for t, f in self.load.items()},
            "blocks": {str(b): c for b, c in self.blocks.items()},
            "other": asdict(self.other) if self.other is not None else None,
            "stages": {k: asdict(f) for k, f in self.stages.items()},
            "capture": asdict(self.capture) if self.capture is not None else None,
            "meta": self.meta,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        return cls(
            model=data["model"],
            device=data["device"],
            dtype=data["dtype"],
            size=int(data["size"]),
            compute={
                c: {m: LinearFit(**f) for m, f in fits.items()}
                for c, fits in data["compute"].items()
            },
            load={t: LinearFit(**f) for t, f in data["load"].items()},
            blocks={int(b): c for b, c in data["blocks"].items()},
            meta=data.get("meta", {}),
            other=LinearFit(**data["other"]) if data.get("other") else None,
            stages={k: LinearFit(**f) for k, f in (data.get("stages") or {}).items()},
            capture=LinearFit(**data["capture"]) if data.get("capture") else None,
        )

    @classmethod
    def load_file(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))


def check_profile(profile: Profile, want: Mapping[int, str], path: str = "profile") -> None:
    """ValueError unless `profile` was fitted for blocks `want` (block id -> class, spec.block_class
    of each block the model runs): a profile of another model plans with the wrong fits, or
    fails every step that reads a cache on a block it does not know. The model name may differ
    (a profile fitted on the random-weight `FAMILY:full` serves a local directory of the same
    architecture). engine.profiling.check_profile computes `want` from a loaded model."""
    want = dict(want)
    if profile.blocks != want:
        missing = sorted(set(want) - set(profile.blocks))
        wrong = sorted(b for b in want if b in profile.blocks and profile.blocks[b] != want[b])
        raise ValueError(
            f"{path} was fitted for {profile.model} ({len(profile.blocks)} blocks), not for this "
            f"model ({len(want)} blocks): "
            + (f"blocks {missing[:5]} missing; " if missing else "")
            + (f"blocks {wrong[:5]} of another class; " if wrong else "")
            + "fit one with `instgenie profile` for this model"
        )
