"""Template keys are the same in every process: the cache is shared by pre processes, restarted
ones and the workers of a host, and is found again after a restart only by its key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.server.test_harness import ROOT

# a scheduler loaded as the adapters load theirs (from_config): diffusers then records the
# fields that took defaults in `_use_default_values`, a list made from a set
PROBE = """
import json
from diffusers import EulerDiscreteScheduler
from PIL import Image
from instgenie.engine.templates import TemplateSpec, template_key
sched = EulerDiscreteScheduler.from_config({"beta_start": 0.00085, "beta_end": 0.012,
                                            "beta_schedule": "scaled_linear"})
spec = TemplateSpec(image=None, prompt="a person", seed=3)
key = template_key("sd2-inpaint:tiny", sched.config, Image.new("RGB", (64, 64), "gray"), None,
                   spec, height=64, width=64, num_steps=4, cfg=True, cache_dtype="torch.float32")
print(json.dumps([key, sched.config["_use_default_values"]]))
"""


def test_a_template_has_one_key_whatever_the_processs_hash_seed() -> None:
    keys, orders = set(), set()
    for seed in range(4):
        env = dict(os.environ, PYTHONHASHSEED=str(seed), PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True, timeout=300).stdout  # fmt: skip
        key, defaults = json.loads(out.strip().splitlines()[-1])
        keys.add(key)
        orders.add(tuple(defaults))
    assert len(orders) > 1  # the seeds did reorder diffusers' list: the test can tell
    assert len(keys) == 1
