"""The post-processing process: Finished -> EditDone (VAE decode, resize back, paste-back, image
encode; with model_stages="loop" the loop has VAE-decoded already and this holds no model).
It owns each Finished bundle from receipt and releases it at once (unpack unlink=True).
A request that fails here fails alone.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from instgenie.messages import Finished
from instgenie.tensorshm import unpack
from instgenie.worker.child_runtime import ChildRuntime
from instgenie.worker.stages import Stages, failure
from instgenie.worker.state_wire import decoded_image, from_parts


def run(rt: ChildRuntime) -> None:
    model_here = rt.wcfg.model_stages == "process"
    device = (rt.wcfg.stage_device or rt.config.model.device) if model_here else "cpu"
    stages = Stages(rt.pipeline("stages" if model_here else "none", device, store=False))
    rt.ready()
    while (msg := rt.next_work()) is not None:
        if not isinstance(msg, Finished):
            continue
        rt.in_flight = (msg.uid,)
        t0 = time.perf_counter()
        try:
            tensors = unpack(msg.latents, unlink=True)
            state = from_parts(tensors, msg.meta, torch.device(device))
            done = stages.finish(state, decoded_image(tensors, msg.meta))
            done = dataclasses.replace(done, postprocess_ms=1e3 * (time.perf_counter() - t0))
        except Exception as e:
            rt.send(failure(msg.uid, e))
        else:
            rt.send(done)
        rt.publish(())
