"""`instgenie client edit --async`, `client job` and `client cancel` against a real server (tiny
model, CPU): the progress bar drawn from the job's Server-Sent Events, the result written with
-o, and cancellation of a running job."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from instgenie.cli import main
from tests.server.test_harness import (
    FAULT_PROMPTS,
    ServerProcess,
    edit_files,
    image_png,
    shared_server,
)


@pytest.fixture(scope="module")
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    return shared_server(request)


def client(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["client", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_async_edit_draws_progress_from_events_and_writes_the_image(
    srv: ServerProcess, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "e.png"
    rc, stdout, err = client(capsys, "edit", "--server", srv.url, "--async", "--prompt", "a hat",
                             "--steps", "4", "-o", str(out))  # fmt: skip
    assert rc == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("queued (position ") and lines[-1] == "done", err
    steps = [x for x in lines if x.startswith("step ")]
    assert steps == [
        "step 1/4 [#####...............]",
        "step 2/4 [##########..........]",
        "step 3/4 [###############.....]",
        "step 4/4 [####################]",
    ], err
    view = json.loads(stdout)
    assert view["status"] == "done" and view["output"] == str(out)
    assert view["progress"] == {"step": 4, "num_steps": 4}
    assert "image" not in view["result"] and view["result"]["num_steps"] == 4
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    # `client job ID`: the same job, its image written again
    again = tmp_path / "again.png"
    rc, stdout, err = client(capsys, "job", "--server", srv.url, view["id"], "-o", str(again))
    assert rc == 0, err
    assert json.loads(stdout)["status"] == "done" and again.read_bytes() == out.read_bytes()
    rc, stdout, err = client(capsys, "job", "--server", srv.url, "job_nope")
    assert rc == 2 and "job_not_found" in err and stdout == ""


def test_cancel_stops_a_running_job_and_job_reports_it(
    srv: ServerProcess, tmp_path: Path, capsys
) -> None:
    srv.gate.touch()  # the "hold" prompt holds the loop while the gate exists
    try:
        r = srv.post(
            "/v1/edits?async=true",
            files=edit_files(image_png(seed=91)),
            data={"prompt": FAULT_PROMPTS["hold"], "num_inference_steps": "3"},
        )
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        deadline = time.monotonic() + 60
        while srv.get(f"/v1/jobs/{job}").json()["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # a running job has no image yet: -o writes nothing and says so
        rc, stdout, err = client(capsys, "job", "--server", srv.url, job, "-o",
                                 str(tmp_path / "x.png"))  # fmt: skip
        running = r"is running \((step \d/3|preprocess|encode|denoise)\); nothing written"
        assert rc == 1 and re.search(running, err), err
        assert list(tmp_path.iterdir()) == []
        rc, stdout, err = client(capsys, "cancel", "--server", srv.url, job)
        assert rc == 0, err
        assert json.loads(stdout)["status"] == "cancelled"
    finally:
        srv.gate.unlink(missing_ok=True)
    rc, stdout, err = client(capsys, "job", "--server", srv.url, job, "--wait")
    assert rc == 1 and json.loads(stdout)["status"] == "cancelled"
    assert err.splitlines()[-1].startswith(f"error: job {job} cancelled: "), err
    srv.wait_in_flight(0, timeout=30)
