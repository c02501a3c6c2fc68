"""The worker's requests in flight: every accepted edit from its admission to its terminal reply,
with the stage it is in, the process that holds it, and the request counters and latencies.

Invariants: request ids inside the worker are `<seq>:<client uid>` (unique for the worker's
life), so a late message of a cancelled request never reaches a newer request that reuses the
client uid; a client has at most one request in flight per client uid; at most `max_queue`
requests are in flight; `close` forgets a request and is the only way one leaves the table.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from instgenie.config import WorkerConfig
from instgenie.messages import (
    EditDone,
    EditFailed,
    Finished,
    Prepared,
    Progress,
    Stage,
    SubmitEdit,
    TensorBundle,
)
from instgenie.worker.child_processes import Child

MAX_UID_CHARS = 256


@dataclass
class Flight:  # one accepted request
    uid: str  # internal id "<seq>:<client uid>"
    client_uid: str
    identity: bytes
    msg: SubmitEdit  # with the internal uid
    accepted_at: float  # monotonic
    stage: str = "queued"  # "queued" | "pre" | "loop" | "post"
    holder: Child | None = None
    bundle: TensorBundle | None = None  # forwarded by us to `holder`
    preprocess_ms: float = 0.0  # pre process (+ the loop's encode, model_stages="loop")
    denoise_ms: float = 0.0
    decode_ms: float = 0.0  # the loop's VAE decode (model_stages="loop")

    def sent(self, target: Child, stage: str | None = None) -> None:
        """Forwarded to `target` (entering `stage`, if given)."""
        self.holder = target
        if stage is not None:
            self.stage = stage
        target.sent(self.uid)

    def prepared(self, msg: Prepared) -> None:
        """Its pre process answered; the supervisor holds its bundle until the loop takes it."""
        if self.holder is not None:
            self.holder.answered(self.uid)
        self.stage, self.holder, self.bundle = "loop", None, msg.state
        self.preprocess_ms = msg.preprocess_ms

    def finished(self, msg: Finished) -> None:
        """The loop answered; the supervisor holds its latents until a post process takes them."""
        if self.holder is not None:
            self.holder.answered(self.uid)
        self.stage, self.holder, self.bundle = "post", None, msg.latents
        self.denoise_ms = msg.denoise_ms
        notes = msg.meta.notes  # model_stages="loop": the loop's encode/decode
        self.preprocess_ms += notes.encode_ms
        self.decode_ms = notes.decode_ms

    def progress(self, stage: Stage) -> Progress:
        """The client's notice that its request entered `stage`."""
        return Progress(uid=self.client_uid, step=0, num_steps=0, stage=stage)


class RequestTable:
    def __init__(self, w: WorkerConfig) -> None:
        self.max_queue = w.max_queue
        self._flights: dict[str, Flight] = {}
        self._by_client: dict[tuple[bytes, str], str] = {}
        self._seq = 0
        self.counters = dict.fromkeys(
            "requests_accepted requests_done requests_failed requests_cancelled "
            "requests_rejected".split(),
            0,
        )
        self.cache_hits: dict[str, int] = {}  # finished edits by the cache tier that served them
        self.latency: deque[tuple[float, float]] = deque(maxlen=2048)  # (total_ms, queue_ms)

    def __len__(self) -> int:
        return len(self._flights)

    def all(self) -> list[Flight]:
        return list(self._flights.values())

    def get(self, uid: str) -> Flight | None:
        return self._flights.get(uid)

    def of_client(self, identity: bytes, client_uid: str) -> Flight | None:
        uid = self._by_client.get((identity, client_uid))
        return None if uid is None else self._flights[uid]

    def refusal(self, identity: bytes, msg: SubmitEdit) -> tuple[str, str, bool] | None:
        """(code, why, retryable) when `msg` cannot be accepted now; None when it can."""
        if not 0 < len(msg.uid) <= MAX_UID_CHARS:
            return "invalid_request", f"uid: must be 1..{MAX_UID_CHARS} characters", False
        if (identity, msg.uid) in self._by_client:
            return "invalid_request", f"uid: {msg.uid!r} is already in flight", False
        if len(self._flights) >= self.max_queue:
            return "overloaded", f"the worker holds {len(self._flights)} requests", True
        return None

    def rejected(self) -> None:
        self.counters["requests_rejected"] += 1

    def cancelled(self) -> None:
        self.counters["requests_cancelled"] += 1

    def accept(self, identity: bytes, msg: SubmitEdit) -> Flight:
        """A new request (check `refusal` first), with its internal id."""
        self._seq += 1
        uid = f"{self._seq}:{msg.uid}"
        flight = Flight(uid, msg.uid, identity, dataclasses.replace(msg, uid=uid), time.monotonic())
        self._flights[uid] = flight
        self._by_client[(identity, msg.uid)] = uid
        self.counters["requests_accepted"] += 1
        return flight

    def close(self, flight: Flight, msg: EditDone | EditFailed) -> EditDone | EditFailed:
        """Forget `flight`, count its end; its terminal reply, timed and with the client's uid."""
        self._flights.pop(flight.uid, None)
        self._by_client.pop((flight.identity, flight.client_uid), None)
        if flight.holder is not None:
            flight.holder.answered(flight.uid)
        if isinstance(msg, EditDone):
            total = 1e3 * (time.monotonic() - flight.accepted_at)
            # inline (naive) runs report their own pre and denoise times in EditDone
            pre = msg.preprocess_ms or flight.preprocess_ms
            denoise = msg.denoise_ms or flight.denoise_ms
            post = msg.postprocess_ms + flight.decode_ms
            msg = dataclasses.replace(
                msg, preprocess_ms=pre, denoise_ms=denoise, postprocess_ms=post, total_ms=total,
                queue_ms=max(0.0, total - pre - denoise - post),
            )  # fmt: skip
            self.counters["requests_done"] += 1
            if msg.cache_tier is not None:
                self.cache_hits[msg.cache_tier] = self.cache_hits.get(msg.cache_tier, 0) + 1
            self.latency.append((total, msg.queue_ms))
        elif msg.code != "cancelled":  # a cancel is counted by `cancelled`
            self.counters["requests_failed"] += 1
        return dataclasses.replace(msg, uid=flight.client_uid)

    def stages(self) -> dict[str, int]:
        """How many requests are in each stage."""
        stages = [f.stage for f in self._flights.values()]
        return {s: stages.count(s) for s in ("queued", "pre", "loop", "post")}
