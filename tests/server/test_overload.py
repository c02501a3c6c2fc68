"""Overload, stuck and dead workers, against a real server with one worker slot and a server queue
of one (RELIABILITY.md items 4, 7 and 8): 429 + Retry-After when full and both held requests then
succeed; a stuck loop and a frozen supervisor flip /health within the deadline while probes stay
instant; a killed supervisor fails its request fast, flips /health, is restarted, and serves."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.server.test_harness import (
    FAULT_PROMPTS,
    ServerProcess,
    descendants,
    edit_files,
    image_png,
    shm_segments,
)

RETRY_AFTER = "3"
STALL_S = 3.0  # --stall-s: the server calls a loop stuck after this long without a step
HEALTH_TIMEOUT_S = 2.0  # the harness's --health-timeout-s
HANG_S = 20.0  # --worker-hang-s: a supervisor silent this long is killed and restarted


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        "--max-batch",
        "1",
        "--worker-slots",
        "1",
        "--max-queue",
        "1",
        "--retry-after-s",
        RETRY_AFTER,
        "--stall-s",
        str(STALL_S),
        "--stall-timeout-s",
        "10",
        "--heartbeat-timeout-s",
        "5",
        "--worker-hang-s",
        str(HANG_S),
    )
    yield server
    server.gate.unlink(missing_ok=True)
    assert server.stop() == 0


def _in_background(fn, *args) -> dict:
    out: dict = {}

    def run() -> None:
        out["response"] = fn(*args)

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _edit(srv: ServerProcess, prompt: str, steps: int = 3, seed: int = 0) -> requests.Response:
    return srv.post(
        "/v1/edits",
        files=edit_files(image_png(seed=seed)),
        data={"prompt": prompt, "num_inference_steps": str(steps), "seed": str(seed)},
    )


def _result(job: dict, timeout: float = 120.0) -> requests.Response:
    job["thread"].join(timeout)
    assert "response" in job, "request still running"
    return job["response"]


def _wait_steps(srv: ServerProcess, more_than: int) -> None:
    deadline = time.monotonic() + 60
    while srv.worker()["steps_total"] <= more_than:
        assert time.monotonic() < deadline, srv.worker()
        time.sleep(0.05)


def test_full_queue_answers_429_with_retry_after_and_held_requests_succeed(srv) -> None:
    srv.gate.touch()
    steps0 = srv.worker()["steps_total"]
    held = _in_background(_edit, srv, FAULT_PROMPTS["hold"], 3, 1)
    srv.wait_in_flight(1)
    _wait_steps(srv, steps0)  # in the denoise loop, held there by the gate
    queued = _in_background(_edit, srv, "queued", 3, 2)
    deadline = time.monotonic() + 30
    while srv.metric("instgenie_queue_depth") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = _edit(srv, "one too many")
    assert r.status_code == 429 and r.headers["Retry-After"] == RETRY_AFTER
    assert r.json()["error"]["code"] == "overloaded"
    r = srv.post("/v1/edits?async=true", files=edit_files(image_png()), data={"prompt": "x"})
    assert r.status_code == 429 and r.headers["Retry-After"] == RETRY_AFTER
    r = srv.post("/v1/images/edits", files={"image": ("i.png", image_png())}, data={"prompt": "x"})
    assert r.status_code in (400, 429)  # no transparency: 400 before admission
    assert (
        srv.metric("instgenie_http_requests_total", method="POST", route="/v1/edits", status="429")
        == 2
    )
    srv.gate.unlink()
    first, second = _result(held), _result(queued)
    assert first.status_code == 200, first.text
    assert second.status_code == 200, second.text
    assert second.json()["timings"]["server_queue_ms"] > 0
    assert srv.metric("instgenie_queue_depth") == 0


def test_a_stuck_loop_flips_health_then_recovers(srv) -> None:
    assert srv.health()[0] == 200
    restarts = srv.worker()["restarts"]
    assert srv.metric("instgenie_worker_restarts_total", worker="0", node="local") == restarts
    stuck = _in_background(_edit, srv, FAULT_PROMPTS["stall"], 3, 4)
    srv.wait_in_flight(1)
    t0 = time.monotonic()
    body = srv.wait_health(503, timeout=STALL_S + 10, why="stuck loop")
    assert time.monotonic() - t0 >= STALL_S - 1.5  # not before the deadline (minus poll lag)
    assert "no step" in body["workers"][0]["reason"]
    # the worker's own watchdog kills the frozen loop: the request fails fast and retryable
    r = _result(stuck, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died"
    assert r.headers["Retry-After"] == RETRY_AFTER
    srv.wait_health(200, timeout=120, why="loop restarted")
    assert _edit(srv, "after the stall").status_code == 200
    # the supervisor restarted the loop (not the server the supervisor): counted all the same
    assert srv.worker()["restarts"] == restarts + 1
    assert srv.metric("instgenie_worker_restarts_total", worker="0", node="local") == restarts + 1


def test_probes_stay_instant_and_flip_when_the_worker_freezes(srv) -> None:
    sup = srv.worker()["pid"]
    os.kill(sup, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda _: srv.get("/health", timeout=5).status_code, range(64)))
        assert time.monotonic() - t0 < 5  # 64 probes, none waits for the frozen worker
        assert set(answers) <= {200, 503}
        body = srv.wait_health(503, timeout=HEALTH_TIMEOUT_S + 5, why="frozen supervisor")
        assert "no stats answer" in body["workers"][0]["reason"]
        assert srv.get("/ready").status_code == 503
    finally:
        os.kill(sup, signal.SIGCONT)
    srv.wait_health(200, timeout=30, why="resumed")


def test_a_frozen_supervisor_is_killed_and_restarted(srv) -> None:
    sup = srv.worker()["pid"]
    restarts = srv.metric("instgenie_worker_restarts_total", worker="0", node="local")
    os.kill(sup, signal.SIGSTOP)  # never resumed: the server must fence it on its own
    waiting = _in_background(_edit, srv, "behind a frozen worker", 3, 6)
    t0 = time.monotonic()
    r = _result(waiting, timeout=HANG_S + 30)
    assert time.monotonic() - t0 < HANG_S + 15  # not the request timeout
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died"
    assert not os.path.exists(f"/proc/{sup}") or "Z" in open(f"/proc/{sup}/stat").read().split()[2]
    body = srv.wait_health(200, timeout=240, why="restarted after the hang")
    assert body["workers"][0]["pid"] != sup
    assert srv.metric("instgenie_worker_restarts_total", worker="0", node="local") == restarts + 1
    assert _edit(srv, "after the fence").status_code == 200


def test_killed_worker_fails_fast_restarts_and_serves(srv) -> None:
    status, health = srv.health()
    sup, restarts = health["workers"][0]["pid"], health["workers"][0]["restarts"]
    children = descendants(sup)
    assert status == 200 and children
    running = _in_background(_edit, srv, "long", 200, 5)
    srv.wait_in_flight(1)
    t0 = time.monotonic()
    os.kill(sup, signal.SIGKILL)
    r = _result(running, timeout=10)
    assert time.monotonic() - t0 < 5  # failed fast, not after 200 steps
    assert r.status_code == 503 and r.headers["Retry-After"] == RETRY_AFTER
    err = r.json()["error"]
    assert err["code"] == "worker_died" and "retryable: yes" in err["message"]
    body = srv.wait_health(503, timeout=5, why="dead worker")
    assert body["workers"][0]["state"] in ("restarting", "up")
    r = _edit(srv, "while restarting")
    assert r.status_code == 503 and r.headers["Retry-After"] == RETRY_AFTER
    assert r.json()["error"]["code"] in ("no_worker", "worker_died")
    body = srv.wait_health(200, timeout=240, why="restarted")
    assert body["workers"][0]["restarts"] == restarts + 1 and body["workers"][0]["pid"] != sup
    assert _edit(srv, "after the restart").status_code == 200
    assert not [p for p in children if os.path.exists(f"/proc/{p}")]  # died with their parent
    assert shm_segments({sup}) == []
    assert srv.metric("instgenie_worker_restarts_total", worker="0", node="local") == restarts + 1
