"""Sends a phase's requests at their arrival times (open loop) and records every answer.

Open loop: a request is sent at its scheduled time whatever happened to earlier ones, so a
slow server meets the offered rate, not a throttled one (a closed loop would hide queueing).
Each request runs on its own thread, at most `max_inflight` at once; an arrival that finds
them all busy is recorded as `client_overload` and not sent — counted, never silently delayed.
Send lag (actual minus scheduled send time) is recorded per request.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

#: `code` values that are not the server's error codes
OK, TIMEOUT, CONNECTION, CLIENT_OVERLOAD, BAD_ANSWER = (
    "ok",
    "timeout",
    "connection",
    "client_overload",
    "bad_answer",
)


class ServerError(Exception):
    """A request outside the measured traffic (readiness, templates) failed."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}" if status else f"{code}: {message}")
        self.status, self.code = status, code


@dataclass(slots=True)
class Outcome:
    index: int  # position in the phase's arrival list
    scheduled_s: float  # planned send offset from the phase start, s
    mask_ratio_requested: float  # the rectangle's achieved ratio on the grid, (0, 1]
    sent_s: float | None = None  # actual send offset, s; None: never sent (client_overload)
    done_s: float | None = None  # answer (or failure) offset, s
    status: int = 0  # HTTP status; 0: no HTTP answer
    code: str = CLIENT_OVERLOAD  # OK, the server's error code, or one of the codes above
    message: str = ""  # the error's message, "" when ok
    answer: dict = field(default_factory=dict)  # the ok answer's fields that matter (no image)

    @property
    def latency_ms(self) -> float | None:
        """Client-side latency: sent -> answered, ms (None when never sent)."""
        if self.sent_s is None or self.done_s is None:
            return None
        return 1e3 * (self.done_s - self.sent_s)


def _error_of(raw: bytes) -> tuple[str, str]:
    """(code, message) of an error body in the native or OpenAI shape."""
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or err.get("type") or "error"), str(err.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "error", raw[:300].decode(errors="replace")


def request_json(
    base: str, method: str, path: str, body: dict | None = None, timeout_s: float = 60.0
) -> tuple[int, dict]:
    """(status, JSON answer) of one HTTP call; HTTP errors come back as ServerError, as do
    connection failures (status 0)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise ServerError(exc.code, *_error_of(exc.read())) from None
    except TimeoutError as exc:
        raise ServerError(0, TIMEOUT, str(exc) or "timed out") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)  # URLError wraps a connect-time timeout
        code = TIMEOUT if isinstance(reason, TimeoutError) else CONNECTION
        raise ServerError(0, code, str(reason)) from None
    except ValueError as exc:  # a 2xx answer that is not JSON
        raise ServerError(0, BAD_ANSWER, str(exc)) from None


#: fields of an ok edit answer kept per request (the image itself is dropped)
ANSWER_FIELDS = (
    "mask_ratio",
    "path",
    "cache",
    "cache_tier",
    "worker",
    "node",
    "retried",
    "num_steps",
    "timings",
)


def _send(base: str, body: dict, out: Outcome, t0: float, timeout_s: float) -> None:
    out.sent_s = time.monotonic() - t0
    try:
        status, answer = request_json(base, "POST", "/v1/edits", body, timeout_s)
        if not isinstance(answer.get("image"), str):
            raise ServerError(status, BAD_ANSWER, "the answer carries no image")
        out.status, out.code = status, OK
        out.answer = {k: answer.get(k) for k in ANSWER_FIELDS}
    except ServerError as exc:
        out.status, out.code, out.message = exc.status, exc.code, str(exc)
    finally:
        out.done_s = time.monotonic() - t0


def run_phase(
    base: str,
    bodies: list[dict],
    offsets: list[float],
    ratios: list[float],
    max_inflight: int,
    timeout_s: float,
) -> tuple[list[Outcome], float]:
    """POST bodies[i] to /v1/edits at offsets[i] (s from now); wait for every answer.
    Returns (outcomes in arrival order, wall seconds from the start to the last answer).
    Request threads are daemons: an interrupted phase (Ctrl-C) does not wait for them."""
    outcomes = [Outcome(i, offsets[i], ratios[i]) for i in range(len(bodies))]
    slots = threading.BoundedSemaphore(max_inflight)
    threads: list[threading.Thread] = []

    def task(i: int) -> None:
        try:
            _send(base, bodies[i], outcomes[i], t0, timeout_s)
        finally:
            slots.release()

    t0 = time.monotonic()
    for i, at in enumerate(offsets):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if not slots.acquire(blocking=False):
            outcomes[i].done_s = time.monotonic() - t0  # recorded, not sent
            continue
        th = threading.Thread(target=task, args=(i,), name=f"loadtest-{i}", daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    ends = [o.done_s for o in outcomes if o.done_s is not None]
    return outcomes, max(ends, default=0.0)
