"""`instgenie serve` as a process: two workers started in parallel share the load; SIGTERM under
load drains (new requests 503, in-flight ones finish, exit 0, no orphan process or shared-memory
segment); a signal during start-up and a busy port end cleanly (RELIABILITY.md item 9)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import requests

from tests.server.test_harness import (
    FAULT_PROMPTS,
    ServerProcess,
    decoded,
    descendants,
    edit_files,
    image_png,
    mask_png,
    shm_segments,
)


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--devices", "cpu,cpu", "--max-batch", "2", "--retry-after-s", "5",
                           "--routing", "mask-aware")  # fmt: skip
    yield server
    if server.proc.poll() is None:
        assert server.stop() == 0


def _edit(srv: ServerProcess, steps: int, seed: int) -> requests.Response:
    return srv.post(
        "/v1/edits",
        files=edit_files(image_png(seed=seed)),
        data={"prompt": "x", "num_inference_steps": str(steps), "seed": str(seed)},
    )


def _concurrently(*calls) -> list[requests.Response]:
    out: list = [None] * len(calls)

    def run(i: int) -> None:
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_two_workers_share_the_load(srv: ServerProcess) -> None:
    _, health = srv.health()
    assert [w["device"] for w in health["workers"]] == ["cpu", "cpu"]
    assert all(w["healthy"] for w in health["workers"])
    # each worker reported its CostSpec (no --profile: the router prices its batches in FLOPs)
    assert [w["cost_model"] for w in health["workers"]] == ["flops", "flops"]
    first, second = _concurrently(lambda: _edit(srv, 4, 1), lambda: _edit(srv, 4, 2))
    assert first.status_code == second.status_code == 200
    # mask-aware routing: the second edit is predicted to finish sooner on the idle worker
    assert {first.json()["worker"], second.json()["worker"]} == {0, 1}
    assert first.json()["mask_ratio"] == second.json()["mask_ratio"] == 0.25


def test_mask_aware_routing_decodes_masks_in_the_server(srv: ServerProcess) -> None:
    """The server measures each mask to price it: a mask that does not decode is a typed 422
    at once, before it takes a worker slot."""
    files = edit_files(image_png(seed=9), mask_png()[:50])  # a valid header over cut data
    r = srv.post("/v1/edits", files=files, data={"prompt": "x"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "mask", r.text
    assert "truncated" in r.json()["error"]["message"]


@pytest.mark.parametrize("retry", [True, False])
def test_an_edit_whose_worker_dies_runs_again_on_the_other_unless_retry_is_false(
    srv: ServerProcess, retry: bool
) -> None:
    """The worker holding an edit is killed mid-denoise: with retry (the default) the edit runs
    once more on the other worker and answers 200, retried, with the image a plain run of the
    same request makes (seeded: deterministic); with "retry": false it answers 503 worker_died."""
    data = {"prompt": FAULT_PROMPTS["hold"], "num_inference_steps": "3", "seed": "7",
            "retry": "true" if retry else "false"}  # fmt: skip
    files = edit_files(image_png(seed=7))
    srv.gate.touch()  # the "hold" prompt holds the denoise loop while the gate exists
    out: dict = {}
    try:
        thread = threading.Thread(target=lambda: out.update(r=srv.post("/v1/edits", files=files,
                                                                         data=data)))  # fmt: skip
        thread.start()
        deadline = time.monotonic() + 60
        while not (busy := [w for w in srv.health()[1]["workers"] if w["in_flight"]]):
            assert time.monotonic() < deadline, srv.health()
            time.sleep(0.05)
        (holder,) = busy
        os.kill(holder["pid"], signal.SIGKILL)
        time.sleep(1.0)  # the death is seen and the retry sent while the gate still holds it
    finally:
        srv.gate.unlink(missing_ok=True)
    thread.join(120)
    r = out["r"]
    if retry:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["retried"] is True and body["worker"] != holder["index"]
        again = srv.post("/v1/edits", files=files, data=data)
        assert again.status_code == 200 and again.json()["retried"] is False
        assert decoded(body["image"]).tobytes() == decoded(again.json()["image"]).tobytes()
    else:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "worker_died"
    srv.wait_health(200, why="the killed worker restarts")
    deadline = time.monotonic() + 120
    while not all(w["healthy"] for w in srv.health()[1]["workers"]):
        assert time.monotonic() < deadline, srv.health()
        time.sleep(0.2)


def test_sigterm_drains_then_exits_cleanly(srv: ServerProcess) -> None:
    _, health = srv.health()
    procs = descendants(srv.pid)
    job = srv.post(
        "/v1/edits?async=true",
        files=edit_files(image_png(seed=3)),
        data={"prompt": "async", "num_inference_steps": "5"},
    ).json()
    results: list = []
    thread = threading.Thread(target=lambda: results.append(_edit(srv, 5, 4)))
    thread.start()
    deadline = time.monotonic() + 60
    while sum(w["in_flight"] for w in srv.health()[1]["workers"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not srv.health()[1]["draining"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = _edit(srv, 2, 5)  # new work is refused while the in-flight edits finish
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert srv.get("/ready").status_code == 503
    status = srv.get(f"/v1/jobs/{job['id']}").json()["status"]
    assert status in ("queued", "running", "done")  # reads still work while draining
    thread.join(120)
    assert results and results[0].status_code == 200, results
    assert decoded(results[0].json()["image"]).size == (64, 64)
    rc = srv.stop(sig=None, procs=procs)
    assert rc == 0, srv.log()[-2000:]
    assert "draining" in srv.log() and "stopped (drained)" in srv.log()
    assert shm_segments({w["pid"] for w in health["workers"]}) == []


def test_signal_during_start_up_stops_workers() -> None:
    server = ServerProcess(wait=False)
    deadline = time.monotonic() + 60
    while not descendants(server.pid):  # a worker supervisor is starting
        assert time.monotonic() < deadline
        time.sleep(0.05)
    procs = descendants(server.pid)
    sups = {p for p in procs if "instgenie.worker.lifeline supervisor" in _cmdline(p)}
    server.sup_pids |= sups
    assert server.stop(procs=procs) == 0  # SIGTERM; stop() checks orphans and shm


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_busy_port_fails_before_starting_workers() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        server = ServerProcess("--port", str(port), wait=False)
        assert server.stop(sig=None, timeout=60) == 1 and time.monotonic() - t0 < 10
        assert "Address already in use" in server.log()
        assert "worker 0 (" not in server.log()  # no worker was started


def test_bad_flag_values_are_refused_by_name() -> None:
    server = ServerProcess("--routing", "fastest", wait=False)
    assert server.stop(sig=None, timeout=60) == 2
    assert "routing: 'fastest' is not one of" in server.log()
