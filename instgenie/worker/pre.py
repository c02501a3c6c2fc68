"""The pre-processing process: SubmitEdit -> Prepared (decode, validate, resize, encode prompt and
image, draw noise), RegisterTemplate -> registered, BuildTemplate -> the capture run's Prepared.

Tensors go to the supervisor (and on to the loop) in a shared-memory bundle this process packs;
ownership passes with the message (tensorshm's rule). A request that fails here fails alone.
"""

from __future__ import annotations

import os
import time

from instgenie.engine.request import RequestState
from instgenie.messages import (
    BuildTemplate,
    DropTemplate,
    Prepared,
    RegisterTemplate,
    SubmitEdit,
    TemplateReady,
)
from instgenie.tensorshm import pack, release
from instgenie.worker.child import ChildRuntime
from instgenie.worker.codec import to_parts
from instgenie.worker.stages import Stages, failure


def prepared(state: RequestState, prefix: str, preprocess_ms: float) -> Prepared:
    """Pack a prepared state into a new bundle owned by the caller until it is sent."""
    tensors, meta = to_parts(state)
    bundle = pack(tensors, prefix)
    return Prepared(uid=state.uid, state=bundle, meta=meta, preprocess_ms=preprocess_ms,
                    pid=os.getpid())  # fmt: skip


def send_prepared(rt: ChildRuntime, msg: Prepared) -> None:
    try:
        rt.send(msg)
    except BaseException:
        release(msg.state)  # never handed over: still ours
        raise


def run(rt: ChildRuntime) -> None:
    stages = Stages(rt.pipeline("stages", rt.wcfg.stage_device or rt.config.model.device))
    rt.ready()
    while (msg := rt.next_work()) is not None:
        rt.in_flight = (getattr(msg, "uid", ""),)
        t0 = time.perf_counter()
        if isinstance(msg, RegisterTemplate):
            stages.register(msg)
        elif isinstance(msg, DropTemplate):
            stages.drop(msg.template_id)
        elif isinstance(msg, BuildTemplate):
            try:
                state = stages.build(msg.template_id)
            except Exception as e:
                fail = failure(msg.template_id, e)
                rt.send(TemplateReady(template_id=msg.template_id, ok=False, message=fail.message))
            else:
                send_prepared(rt, prepared(state, rt.shm_prefix, 1e3 * (time.perf_counter() - t0)))
        elif isinstance(msg, SubmitEdit):
            try:
                state = stages.prepare(msg)
                out = prepared(state, rt.shm_prefix, 1e3 * (time.perf_counter() - t0))
            except Exception as e:  # bad input (typed) or a fault of this request alone
                rt.send(failure(msg.uid, e))
            else:
                send_prepared(rt, out)
        rt.publish(())
