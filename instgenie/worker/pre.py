"""The pre-processing process: SubmitEdit -> Prepared (decode, validate, resize, encode prompt and
image, draw noise), RegisterTemplate -> registered, BuildTemplate -> the capture run's Prepared.
With model_stages="loop" it holds no model: Prepared carries the decoded inputs and the loop
encodes them (codec.inputs_to_parts).

Tensors go to the supervisor (and on to the loop) in a shared-memory bundle this process packs;
ownership passes with the message (tensorshm's rule). A request that fails here fails alone.
"""

from __future__ import annotations

import os
import time

from instgenie.messages import (
    BuildTemplate,
    DropTemplate,
    InputsMeta,
    Prepared,
    RegisterTemplate,
    RequestNotes,
    StateMeta,
    SubmitEdit,
    TemplateReady,
)
from instgenie.tensorshm import pack, release
from instgenie.worker.child_runtime import ChildRuntime
from instgenie.worker.stages import Stages, capture_uid, failure
from instgenie.worker.state_wire import inputs_to_parts, to_parts


def prepared(
    uid: str, tensors: dict, meta: InputsMeta | StateMeta, prefix: str, preprocess_ms: float
) -> Prepared:
    """Pack into a new bundle owned by the caller until it is sent."""
    bundle = pack(tensors, prefix)
    return Prepared(uid=uid, state=bundle, meta=meta, preprocess_ms=preprocess_ms,
                    pid=os.getpid())  # fmt: skip


def send_prepared(rt: ChildRuntime, msg: Prepared) -> None:
    try:
        rt.send(msg)
    except BaseException:
        release(msg.state)  # never handed over: still ours
        raise


def run(rt: ChildRuntime) -> None:
    model_here = rt.wcfg.model_stages == "process"
    device = (rt.wcfg.stage_device or rt.config.model.device) if model_here else "cpu"
    stages = Stages(rt.pipeline("stages" if model_here else "none", device))

    def parts(msg: SubmitEdit | BuildTemplate) -> tuple[str, dict, InputsMeta | StateMeta]:
        """(uid, tensors, meta) of the request: a prepared state, or decoded inputs."""
        if isinstance(msg, BuildTemplate):
            if model_here:
                state = stages.build(msg.template_id)
                return (state.uid, *to_parts(state))
            inputs, notes = stages.build_inputs(msg.template_id)
            uid = capture_uid(msg.template_id)
            return (uid, *inputs_to_parts(uid, inputs, notes))
        if model_here:
            return (msg.uid, *to_parts(stages.prepare(msg)))
        return (msg.uid, *inputs_to_parts(msg.uid, stages.decode(msg), RequestNotes()))

    rt.ready()
    while (msg := rt.next_work()) is not None:
        rt.in_flight = (getattr(msg, "uid", ""),)
        t0 = time.perf_counter()
        if isinstance(msg, RegisterTemplate):
            stages.register(msg)
        elif isinstance(msg, DropTemplate):
            stages.drop(msg.template_id)
        elif isinstance(msg, (SubmitEdit, BuildTemplate)):
            try:
                uid, tensors, meta = parts(msg)
                ms = 1e3 * (time.perf_counter() - t0)
                out = prepared(uid, tensors, meta, rt.shm_prefix, ms)
            except Exception as e:  # bad input (typed) or a fault of this request alone
                if isinstance(msg, BuildTemplate):
                    why = failure(msg.template_id, e).message
                    rt.send(TemplateReady(template_id=msg.template_id, ok=False, message=why))
                else:
                    rt.send(failure(msg.uid, e))
            else:
                send_prepared(rt, out)
        rt.publish(())
