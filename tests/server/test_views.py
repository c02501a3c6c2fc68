"""What the API answers and logs about an edit, a template and a job (issue 23 item 6): unix
seconds as integers everywhere, why an edit of a template took the full path, and a quiet log
for a healthy start. Against a real server (tiny model, CPU)."""

from __future__ import annotations

import time

import pytest

from instgenie.config import ExecConfig, to_dict
from tests.server.test_harness import ServerProcess, image_png, mask_png, shared_server


@pytest.fixture(scope="module")
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    return shared_server(request)


def ready_template(srv: ServerProcess, seed: int, **fields: str) -> dict:
    r = srv.post("/v1/templates", files={"image": ("t.png", image_png(seed=seed))},
                 data={"prompt": "a person", **fields})  # fmt: skip
    assert r.status_code in (200, 202), r.text
    tid = r.json()["id"]
    deadline = time.monotonic() + 120
    while (t := srv.get(f"/v1/templates/{tid}").json())["status"] == "building":
        assert time.monotonic() < deadline, t
        time.sleep(0.1)
    assert t["status"] == "ready", t
    return t


def edit(srv: ServerProcess, tid: str, query: str = "", **fields: str):
    return srv.post(f"/v1/edits{query}", files={"mask": ("m.png", mask_png())},
                    data={"template_id": tid, "prompt": "a hat", **fields})  # fmt: skip


def test_created_is_integer_unix_seconds_in_templates_edits_and_jobs(srv: ServerProcess) -> None:
    t = ready_template(srv, seed=81)
    now = time.time()
    assert type(t["created"]) is int and abs(t["created"] - now) < 300
    assert all(type(x["created"]) is int for x in srv.get("/v1/templates").json()["data"])
    r = edit(srv, t["id"])
    assert r.status_code == 200 and type(r.json()["created"]) is int
    r = edit(srv, t["id"], query="?async=true")
    assert r.status_code == 202, r.text
    job = r.json()
    assert type(job["created"]) is int and job["finished"] is None
    deadline = time.monotonic() + 120
    while (job := srv.get(f"/v1/jobs/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    assert job["status"] == "done", job
    assert type(job["created"]) is int and type(job["finished"]) is int
    assert job["created"] <= job["finished"] and type(job["result"]["created"]) is int


def test_an_edit_of_a_template_at_other_steps_says_why_it_took_the_full_path(
    srv: ServerProcess,
) -> None:
    t = ready_template(srv, seed=82, num_inference_steps="2")
    same = edit(srv, t["id"])  # the template's steps: its cache serves the edit
    assert same.status_code == 200, same.text
    assert same.json()["path"] == "masked" and same.json()["fallback_reason"] is None
    other = edit(srv, t["id"], num_inference_steps="3")
    assert other.status_code == 200, other.text
    body = other.json()
    assert body["path"] == "full" and body["cache"] == "miss" and body["num_steps"] == 3
    assert body["fallback_reason"] == (
        "the edit runs 3 denoise steps but the template's cache was captured at 2: use the "
        "template's num_inference_steps (and strength)"
    )
    deadline = time.monotonic() + 30  # the log line reaches the log file
    want = f"edit {body['id']} of template {t['id'][:12]} took the full path: the edit runs 3"
    while want not in srv.log():
        assert time.monotonic() < deadline, (want, srv.log()[-3000:])
        time.sleep(0.1)
    line = next(x for x in srv.log().splitlines() if want in x)
    assert " WARNING " in line, line


def test_a_healthy_start_logs_no_warning_about_ready_workers(srv: ServerProcess) -> None:
    """`worker N ready` is INFO: at the default level (WARNING) a clean start says nothing."""
    assert srv.health()[0] == 200
    ready = [x for x in srv.log().splitlines() if ") ready in " in x]
    assert ready == [], ready


def test_health_reports_the_cache_the_workers_were_started_with(srv: ServerProcess) -> None:
    """The test suite runs with INSTGENIE_CACHE_ROOT empty (tests/conftest.py): the default
    "auto" root resolves to no host cache, said at start and in /health."""
    status, body = srv.health()
    assert status == 200
    assert body["cache"] == {
        "root": None,
        "root_source": "INSTGENIE_CACHE_ROOT is empty",
        "tiers": {
            "gpu": {"budget_bytes": None,
                    "source": "no budget: every template in its loop's device memory"},
            "dram": {"budget_bytes": None, "source": "no host cache"},
            "disk": {"budget_bytes": None, "source": "no host cache"},
        },
    }  # fmt: skip
    assert body["workers"][0]["cache_gpu_budget_bytes"] is None
    # and each worker's execution settings (no flag, no INSTGENIE_* variable: the defaults)
    assert body["workers"][0]["execution"] == to_dict(ExecConfig())
    assert "instgenie: templates cached in each worker's device memory" in srv.log()
