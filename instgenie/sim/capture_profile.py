"""`instgenie profile --capture-from STEP_LOG`: fit a profile's capture cost from a served run.

A template's capture run costs a served loop more than its priced steps: the DRAM segment's
creation at its first step, the staged copies beside every step, the commit at its last, and its
batch run eagerly (no graph replay). The cache-aware router prices a miss with it
(Estimator.capture_step_ms), so a profile carries it as `Profile.capture`: a fit of ms against
the template's working pixels x its steps, through the origin (a capture's bytes, and so its
copies, are proportional to both), its slope the median over the log's complete captures
(physics.capture_costs) divided by the run's pixels x steps. The profiler's
isolated timings cannot see this cost; a served step log (`instgenie serve --step-log`) shows it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from instgenie.errors import ValidationError
from instgenie.outputs import PendingOutput
from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.fits import LinearFit, Profile
from instgenie.sim import physics
from instgenie.sim.models import profile_spec


def fit_capture(profile_path: str | Path, step_log: str | Path, size: int | None, steps: int,
                mask_ratio: float) -> Profile:  # fmt: skip
    """The profile at `profile_path` with its capture fit from `step_log` (a served run of
    `size`² images, default the profile's size, and `steps` steps; its cache-reading edits
    priced at `mask_ratio`). ValidationError if the log holds no complete capture."""
    try:
        prof = Profile.load_file(profile_path)
        spec = profile_spec(profile_path)
    except FileNotFoundError:
        raise ValidationError("output", f"{str(profile_path)!r} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValidationError("output", f"{str(profile_path)!r} is not a profile: {exc}") from None
    try:
        lines = Path(step_log).read_text().splitlines()
        rows = [json.loads(x) for x in lines if x.strip()]
    except (OSError, ValueError) as exc:
        raise ValidationError("capture_from", f"{str(step_log)!r}: {exc}") from None
    pixels = (size or prof.size) ** 2
    costs = physics.capture_costs(rows, Estimator(spec), pixels, steps, mask_ratio)
    if not costs:
        raise ValidationError(
            "capture_from", f"{str(step_log)!r} holds no capture run of {steps} steps "
            "(serve with --step-log and register a template)",
        )  # fmt: skip
    ms = statistics.median(costs)
    prof.capture = LinearFit(ms / (pixels * steps), 0.0, 0.0, len(costs))
    prof.meta = dict(prof.meta, capture_samples=[round(c, 1) for c in costs],
                     capture_meta={"step_log": str(step_log), "pixels": pixels, "steps": steps,
                                   "mask_ratio": mask_ratio})  # fmt: skip
    return prof


def cmd_capture_from(args: argparse.Namespace) -> int:
    """`instgenie profile -o PROFILE --capture-from STEP_LOG`: rewrite PROFILE with its capture
    fit (written whole or not at all). The flags of a timing run are refused with it (the
    model is the profile's own: --model and the execution flags are not read)."""
    timing = [f for f, given in (("--stages-only", args.stages_only),
                                 ("--disk-dir", args.disk_dir is not None)) if given]  # fmt: skip
    if timing:
        raise ValidationError(
            "capture_from", f"--capture-from loads no model; {', '.join(timing)} cannot go with it"
        )
    prof = fit_capture(args.output, args.capture_from, args.size, args.capture_steps,
                       args.capture_mask_ratio)  # fmt: skip
    with PendingOutput(Path(args.output)) as pending:
        pending.commit(json.dumps(prof.to_json(), indent=1).encode())
    assert prof.capture is not None
    print(f"capture: {prof.capture.slope * 1e6:.1f} ms/Mpx per step, {prof.capture.n} captures "
          f"(median of {prof.meta['capture_samples']} ms); wrote {args.output}")  # fmt: skip
    return 0
