"""Templates captured with LoRAs (POST /v1/templates `loras`), on a real `instgenie serve`
(sdxl-inpaint:tiny, CPU; the server of test_loras_api): the id hashes the LoRAs too, the view
shows them, an edit naming the same LoRAs reads the cache (masked path), an unknown LoRA is a
404, the LoRA cannot be deleted while the template names it (409 lora_in_use), and a restart
keeps the template's LoRAs (state_db.py version 2; its migration: test_durability)."""

from __future__ import annotations

import base64
import hashlib
import json
import time

import pytest

from tests.server.test_harness import ServerProcess, edit_files, image_png, mask_png
from tests.server.test_loras_api import Served, lora_bytes, post_lora, serve_module

STEPS = "2"
served = pytest.fixture(scope="module")(serve_module)


def post_template(srv: ServerProcess, image: bytes, loras=None, as_json: bool = False):
    fields = {"prompt": "a person", "seed": 3, "num_inference_steps": int(STEPS)}
    if as_json:
        body = {**fields, "image": base64.b64encode(image).decode()}
        if loras is not None:
            body["loras"] = loras
        return srv.post("/v1/templates", json=body)
    data = {k: str(v) for k, v in fields.items()}
    if loras is not None:
        data["loras"] = json.dumps(loras)
    return srv.post("/v1/templates", files={"image": ("t.png", image, "image/png")}, data=data)


def wait_ready(srv: ServerProcess, tid: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = srv.get(f"/v1/templates/{tid}").json()
        if body["status"] != "building":
            assert body["status"] == "ready", body
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.1)


def edit_template(srv: ServerProcess, tid: str, loras=None):
    data = {"template_id": tid, "prompt": "a hat", "seed": "5"}
    if loras is not None:
        data["loras"] = json.dumps(loras)
    return srv.post("/v1/edits", files=edit_files(mask=mask_png()), data=data)


def test_template_with_loras_end_to_end(served: Served) -> None:
    srv, data = served.srv, lora_bytes(seed=11)
    lora_id = hashlib.sha256(data).hexdigest()
    assert post_lora(srv, data, name="style").status_code == 201
    image = image_png(seed=21)
    refs = [{"id": lora_id, "scale": 1.5}]

    r = post_template(srv, image, refs)
    assert r.status_code == 202, r.text
    tid = r.json()["id"]
    canon = json.dumps([[lora_id, 1.5]], separators=(",", ":")).encode()
    assert tid == hashlib.sha256(image + b"\0" + canon).hexdigest()
    assert r.json()["loras"] == refs
    again = post_template(srv, image, refs, as_json=True)  # JSON body, the same template
    assert again.status_code == 200 and again.json()["id"] == tid, again.text
    plain = post_template(srv, image)
    assert plain.status_code == 202, plain.text
    plain_id = plain.json()["id"]
    assert plain_id == hashlib.sha256(image).hexdigest() != tid
    assert plain.json()["loras"] == []

    ready = wait_ready(srv, tid)
    assert ready["loras"] == refs and sum(ready["bytes_by_tier"].values()) > 0
    listed = {t["id"]: t["loras"] for t in srv.get("/v1/templates").json()["data"]}
    assert listed[tid] == refs and listed[plain_id] == []

    r = edit_template(srv, tid, refs)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["path"], body["cache"], body["template_id"]) == ("masked", "hit", tid), body
    assert body["num_steps"] == int(STEPS)

    # an edit posting the image's bytes finds the template of that image without LoRAs (one
    # step, not the template's two: the full path, cheaper than a masked one here)
    r = srv.post("/v1/edits", files=edit_files(image, mask_png()),
                 data={"prompt": "a hat", "seed": "5", "num_inference_steps": "1"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["template_id"] == plain_id, r.json()

    # the LoRA stays while the template names it
    r = srv.delete(f"/v1/loras/{lora_id}")
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "lora_in_use" and tid in err["message"], err
    assert srv.get(f"/v1/loras/{lora_id}").status_code == 200

    # a restart keeps the template's LoRAs; its edits read the cache again
    assert srv.stop() == 0
    served.srv = srv = served.start()
    assert srv.get(f"/v1/templates/{tid}").json()["loras"] == refs
    assert srv.get(f"/v1/templates/{plain_id}").json()["loras"] == []
    assert wait_ready(srv, tid)["loras"] == refs  # captured again, with its LoRAs

    # once the template is gone the LoRA can go
    assert srv.delete(f"/v1/templates/{tid}").status_code == 200
    r = srv.delete(f"/v1/loras/{lora_id}")
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text


def test_template_loras_are_checked(served: Served) -> None:
    srv, image = served.srv, image_png(seed=22)
    r = post_template(srv, image, [{"id": "a" * 64, "scale": 1.0}])
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["code"], err["field"]) == ("lora_not_found", "loras")
    r = post_template(srv, image, [{"id": "a" * 64}], as_json=True)
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found", r.text
    for bad in ([{"id": "xyz"}], [{"id": "a" * 64, "scale": 9}], [{"id": "a" * 64}] * 2):
        r = post_template(srv, image, bad)
        assert r.status_code == 422 and r.json()["error"]["field"].startswith("loras"), r.text
    r = srv.post("/v1/templates", files={"image": ("t.png", image, "image/png")},
                 data={"prompt": "x", "loras": "[{"})  # fmt: skip
    assert r.status_code == 422 and r.json()["error"]["field"] == "loras", r.text
    assert srv.get(f"/v1/templates/{hashlib.sha256(image).hexdigest()}").status_code == 404
    assert srv.delete(f"/v1/loras/{'b' * 64}").status_code == 404
