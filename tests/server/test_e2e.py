"""End to end over HTTP against a real `instgenie serve` (tiny model, CPU): templates with their
asynchronous cache build, masked edits that hit it, full-path edits of unregistered images, async
jobs with Server-Sent Events, cancellation by DELETE, the operational endpoints and the CLI."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time

import pytest

from tests.server.test_harness import (
    ROOT,
    SIZE,
    ServerProcess,
    decoded,
    edit_files,
    image_png,
    mask_png,
    shared_server,
)


@pytest.fixture(scope="module")
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    return shared_server(request)


def _wait_template(srv: ServerProcess, tid: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = srv.get(f"/v1/templates/{tid}").json()
        if body["status"] != "building":
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.1)


def test_template_build_then_masked_edit_hits_the_cache(srv: ServerProcess) -> None:
    image = image_png(seed=11)
    tid = hashlib.sha256(image).hexdigest()
    r = srv.post(
        "/v1/templates",
        files={"image": ("t.png", image, "image/png")},
        data={"prompt": "a person", "seed": "3", "num_inference_steps": "2"},
    )
    assert r.status_code == 202, r.text
    assert r.json()["id"] == tid and r.json()["status"] == "building"  # returned at once
    again = srv.post(
        "/v1/templates",
        files={"image": ("t.png", image, "image/png")},
        data={"prompt": "a person", "seed": "3", "num_inference_steps": "2"},
    )
    assert again.status_code == 200 and again.json()["id"] == tid  # idempotent
    ready = _wait_template(srv, tid)
    assert ready["status"] == "ready", ready
    assert ready["build_ms"] > 0 and sum(ready["bytes_by_tier"].values()) > 0
    assert (ready["width"], ready["height"]) == (SIZE, SIZE)

    r = srv.post(
        "/v1/edits", files=edit_files(), data={"template_id": tid, "prompt": "a hat", "seed": "5"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["path"], body["cache"], body["template_id"]) == ("masked", "hit", tid)
    assert body["cache_tier"] in ready["bytes_by_tier"]
    assert body["num_steps"] == 2  # the template's steps
    assert 0 < body["mask_ratio"] < 1
    t = body["timings"]
    assert t["total_ms"] > 0 and t["denoise_ms"] > 0 and t["server_total_ms"] >= t["total_ms"]
    out = decoded(body["image"])
    assert out.format == "PNG" and out.size == (SIZE, SIZE)

    # the same image bytes sent as an image (JSON, base64) find the template by hash
    r = srv.post(
        "/v1/edits",
        json={
            "image": base64.b64encode(image).decode(),
            "mask": base64.b64encode(mask_png()).decode(),
            "prompt": "a hat",
            "output_format": "webp",
        },
    )
    assert r.status_code == 200, r.text
    assert (r.json()["path"], r.json()["template_id"]) == ("masked", tid)
    assert decoded(r.json()["image"]).format == "WEBP"
    assert srv.metric("instgenie_cache_hits_total", tier=body["cache_tier"]) >= 2
    # both edits asked for "a hat": the second took the loop's prompt-encoder cache (the
    # worker's stats reach /metrics with the health poll)
    deadline = time.monotonic() + 30
    while srv.metric("instgenie_prompt_cache_hits_total", worker="0", node="local") < 1:
        assert time.monotonic() < deadline, "no prompt cache hit reported"
        time.sleep(0.2)
    assert (
        srv.metric("instgenie_prompt_cache_misses_total", worker="0", node="local") >= 2
    )  # capture + 1st
    assert srv.metric("instgenie_prompt_cache_bytes", worker="0", node="local") > 0

    # DELETE removes it everywhere: unknown afterwards, and edits naming it are refused
    assert srv.delete(f"/v1/templates/{tid}").json() == {
        "id": tid,
        "object": "template",
        "deleted": True,
    }
    assert srv.get(f"/v1/templates/{tid}").status_code == 404
    r = srv.post("/v1/edits", files=edit_files(), data={"template_id": tid, "prompt": "x"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "template_id"


def test_the_step_log_has_every_polled_step_with_its_worker_and_node(srv: ServerProcess) -> None:
    """serve --step-log: a template's capture run shows in the file as JSON lines, each a
    StepEntry with the worker's index and node, its steps 0..n-1 in order."""
    image = image_png(seed=13)
    tid = hashlib.sha256(image).hexdigest()
    r = srv.post("/v1/templates", files={"image": ("t.png", image, "image/png")},
                 data={"prompt": "a coat", "seed": "4", "num_inference_steps": "2"})  # fmt: skip
    assert r.status_code == 202, r.text
    assert _wait_template(srv, tid)["status"] == "ready"
    assert srv.step_log is not None
    uid = f"template:{tid}"
    deadline = time.monotonic() + 30
    while True:  # the health poll appends what it read (every 0.2 s here)
        text = srv.step_log.read_text() if srv.step_log.exists() else ""
        rows = [json.loads(line) for line in text.splitlines()]
        mine = [r for r in rows if any(m[0] == uid for m in r["members"])]
        if len(mine) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [dict(r["members"])[uid] for r in mine] == [0, 1]
    assert all(r["worker"] == 0 and r["node"] == "local" and r["duration_ms"] > 0 for r in mine)
    assert mine[1]["left"] == [uid]


def test_template_without_steps_builds_at_the_servers_default_and_its_edits_hit(
    srv: ServerProcess,
) -> None:
    """The shared server runs with --default-steps 2. A template that names no steps is built
    at those steps and an edit that names none runs them too: a masked cache hit (before, the
    template was built at the model's own default and every such edit missed its cache)."""
    image = image_png(seed=12)
    r = srv.post("/v1/templates", json={"image": base64.b64encode(image).decode()})
    assert r.status_code == 202, r.text
    assert r.json()["num_inference_steps"] == 2
    tid = r.json()["id"]
    try:
        assert _wait_template(srv, tid)["status"] == "ready"
        r = srv.post("/v1/edits", files=edit_files(), data={"template_id": tid, "prompt": "a hat"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["path"], body["cache"], body["num_steps"]) == ("masked", "hit", 2)
    finally:
        srv.delete(f"/v1/templates/{tid}")


def test_unregistered_image_runs_the_full_path(srv: ServerProcess) -> None:
    r = srv.post(
        "/v1/edits",
        files=edit_files(image_png(seed=21)),
        data={"prompt": "a red hat", "output_format": "jpeg", "seed": "1"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["path"], body["cache"], body["template_id"]) == ("full", None, None)
    out = decoded(body["image"])
    assert out.format == "JPEG" and out.size == (SIZE, SIZE)
    assert body["model"] == "sd2-inpaint:tiny" and body["seed"] == 1


def test_async_job_streams_progress_then_result(srv: ServerProcess) -> None:
    r = srv.post(
        "/v1/edits?async=true",
        files=edit_files(image_png(seed=31)),
        data={"prompt": "x", "num_inference_steps": "3"},
    )
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["Location"] == f"/v1/jobs/{job['id']}"
    with srv.get(f"/v1/jobs/{job['id']}/events", stream=True) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in stream.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: ") and events[-1] == "done":
                done = json.loads(line[6:])
                break
    assert events[0] == "queued" and events[-1] == "done", events
    assert [e for e in events if e == "step"] == ["step"] * 3
    assert done["result"]["num_steps"] == 3 and "image" not in done["result"]
    final = srv.get(f"/v1/jobs/{job['id']}").json()
    assert final["status"] == "done" and final["progress"] == {"step": 3, "num_steps": 3}
    assert decoded(final["result"]["image"]).size == (SIZE, SIZE)
    # a finished job is forgotten by DELETE
    assert srv.delete(f"/v1/jobs/{job['id']}").json()["status"] == "done"
    assert srv.get(f"/v1/jobs/{job['id']}").status_code == 404


def test_delete_cancels_a_running_job_and_frees_its_slot(srv: ServerProcess) -> None:
    r = srv.post(
        "/v1/edits?async=true",
        files=edit_files(image_png(seed=41)),
        data={"prompt": "x", "num_inference_steps": "200"},
    )
    job = r.json()["id"]
    cancels = srv.metric("instgenie_edit_failures_total", code="cancelled")
    deadline = time.monotonic() + 60
    while srv.get(f"/v1/jobs/{job}").json()["progress"]["step"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    view = srv.delete(f"/v1/jobs/{job}").json()
    assert view["status"] == "cancelled" and view["error"]["code"] == "cancelled"
    assert view["progress"]["step"] < 200
    srv.wait_in_flight(0, timeout=10)  # the worker confirmed: the slot is free
    assert time.monotonic() - t0 < 10
    # an admitted edit that did not finish: counted as a failure, by why
    assert srv.metric("instgenie_edit_failures_total", code="cancelled") == cancels + 1
    r = srv.post("/v1/edits", files=edit_files(image_png(seed=42)), data={"prompt": "next"})
    assert r.status_code == 200


def test_operational_endpoints(srv: ServerProcess) -> None:
    status, health = srv.health()
    assert status == 200 and health["status"] == "ok" and not health["draining"]
    w = health["workers"][0]
    assert w["healthy"] and w["state"] == "up" and w["address"].startswith("ipc://")
    assert srv.get("/ready").json() == {"ready": True, "reason": None}
    models = srv.get("/v1/models").json()
    assert models["data"][0]["id"] == "sd2-inpaint:tiny"
    srv.post("/v1/edits", files=edit_files(image_png(seed=51)), data={"prompt": "x"})
    text = srv.get("/metrics").text
    for name in (
        "instgenie_http_requests_total",
        "instgenie_queue_depth",
        "instgenie_batch_size",
        "instgenie_step_seconds_bucket",
        "instgenie_cache_hits_total",
        "instgenie_cache_bytes_loaded_total",
        "instgenie_worker_in_flight",
        "instgenie_edits_total",
        "instgenie_worker_up",
    ):
        assert name in text, name
    assert (
        srv.metric("instgenie_http_requests_total", method="POST", route="/v1/edits", status="200")
        >= 1
    )
    # a CPU worker never replays CUDA graphs: every step ran eagerly
    assert srv.metric("instgenie_step_seconds_count", worker="0", node="local", graph="eager") >= 2
    assert srv.metric("instgenie_step_seconds_count", worker="0", node="local", graph="replay") == 0
    assert srv.metric("instgenie_worker_up", worker="0", node="local") == 1


def test_openapi_shows_upload_fields(srv: ServerProcess) -> None:
    spec = srv.get("/openapi.json").json()
    oa = spec["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]
    props = _props(spec, oa["multipart/form-data"]["schema"])
    assert {"image", "image[]", "mask", "prompt", "n", "response_format"} <= set(props)
    assert _is_binary(spec, props["mask"])
    native = spec["paths"]["/v1/edits"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(native)
    form = native["multipart/form-data"]["schema"]["properties"]
    assert form["image"]["format"] == form["mask"]["format"] == "binary"
    tmpl = spec["paths"]["/v1/templates"]["post"]["requestBody"]["content"]
    assert tmpl["multipart/form-data"]["schema"]["properties"]["image"]["format"] == "binary"


def _props(spec: dict, schema: dict) -> dict:
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema["properties"]


def _is_binary(spec: dict, prop: dict) -> bool:
    alts = prop.get("anyOf", [prop])
    return any(a.get("format") == "binary" or a.get("contentMediaType") for a in alts)


def test_client_cli_edits_through_the_server(srv: ServerProcess, tmp_path) -> None:
    out = tmp_path / "edit.png"
    cmd = [
        sys.executable,
        "-m",
        "instgenie.server",
        "client",
        "edit",
        "--server",
        srv.url,
        "--wait-ready-s",
        "30",
        "--prompt",
        "a red silk shirt",
        "--steps",
        "2",
        "-o",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["output"] == str(out) and summary["path"] == "full"
    assert decoded(base64.b64encode(out.read_bytes()).decode()).size == (256, 256)  # the sample
    bad = subprocess.run(
        cmd[:-2] + ["--steps", "0", "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "num_inference_steps" in bad.stderr
