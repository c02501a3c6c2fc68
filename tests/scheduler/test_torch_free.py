"""The scheduler package runs without torch: a fresh interpreter in which torch cannot be imported
loads a committed profile, builds a CostSpec from it, routes a request (MaskAware.choose) and
plans a step (plan_step on step_costs), importing neither diffusers nor scikit-learn."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "torch":
                raise ImportError(f"torch is blocked in this test ({name})")
            return None

    sys.meta_path.insert(0, Blocked())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the torch block failed")

    import instgenie.messages  # the wire types import the scheduler's specs
    import instgenie.wire
    from instgenie.scheduler.fits import Profile, check_profile
    from instgenie.scheduler.planner import plan_step
    from instgenie.scheduler.pricing import RequestWork, step_costs
    from instgenie.scheduler.routing import MaskAware
    from instgenie.scheduler.spec import BlockSpec, CostSpec, block_class, profile_fits
    from instgenie.scheduler.views import RouteRequest, WorkerView

    profile = Profile.load_file("profiles/sdxl-inpaint-full-h200.json")
    blocks = []  # SDXL: width 640 at stride 16, width 1280 at stride 32
    for b, cls in sorted(profile.blocks.items()):
        c = int(cls.split(":")[1])
        blocks.append(BlockSpec(block_id=b, kind="unet", channels=c, ff_macs=12 * c * c,
                                context_dim=2048, stride=16 if c == 640 else 32))
    check_profile(profile, {d.block_id: block_class(d) for d in blocks})
    spec = CostSpec(model=profile.model, granule=32, text_len=77, cfg=True,
                    default_guidance=5.0, default_steps=20, cache_dtype="float16",
                    blocks=blocks, **profile_fits(profile))
    assert instgenie.wire.decode(instgenie.wire.encode(
        instgenie.messages.Stats(counters={}, cost=spec))).cost == spec

    px, ratios = 1024 * 1024, ((16, 0.1), (32, 0.12))
    req = RouteRequest(template_id="T", num_steps=20, pixels=px, token_ratios=ratios)
    held = (RouteRequest(template_id=None, num_steps=20, pixels=px),) * 2
    workers = [
        WorkerView(index=0, device="cuda:0", in_flight=2, slots=16, templates_ready=frozenset(),
                   requests=held, max_batch=8, cost=spec, host="node-a"),
        WorkerView(index=1, device="cuda:0", in_flight=3, slots=16,
                   templates_ready=frozenset({"T"}), template_tiers={"T": "dram"},
                   requests=(req,) * 3, max_batch=8, cost=spec, host="node-b"),
    ]
    choice = MaskAware().choose(req, workers)

    works = [RequestWork(2, ((16, round(0.1 * px / 256)), (32, round(0.12 * px / 1024))), True),
             RequestWork(2, None)]
    costs = step_costs(spec, px, works)
    plan = plan_step(costs)

    heavy = sorted(m for m in sys.modules if m.partition(".")[0] in
                   ("torch", "diffusers", "sklearn", "triton", "transformers"))
    print(choice, costs.num_blocks, len(plan.compute_all), plan.latency_ms <= plan.all_full_ms,
          plan.latency_ms > 0, "torch" in sys.modules, heavy)
    """
)


def test_scheduler_imports_and_decides_without_torch() -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    choice, blocks, compute_all, bounded, positive, torch_loaded, heavy = out.stdout.split(" ", 6)
    # the template edit goes where its cache is (a cheap masked step) rather than to the worker
    # with fewer requests, all on the full path
    assert choice == "1"
    assert int(blocks) == 70 and 0 <= int(compute_all) <= 70
    assert (bounded, positive, torch_loaded) == ("True", "True", "False")
    assert heavy.strip() == "[]"
