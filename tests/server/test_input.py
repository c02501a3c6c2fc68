"""Bad input is refused the same way on every route (issue 23 item 4): text fields that UTF-8
cannot encode or that hold NUL are a field-named 4xx `invalid_text` before anything stores or
forwards them; the OpenAI route validates `strength` and refuses fields it does not read, as the
native routes do; out-of-range steps get one message. Against a real server (tiny model, CPU)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.server.test_harness import SIZE, ServerProcess, image_png, mask_png, shared_server

EXAMPLES = 30  # generated requests per route

#: the text fields of each route's body (native: JSON members; OpenAI: multipart fields)
EDIT_FIELDS = ("prompt", "negative_prompt", "template_id", "image", "mask", "image_url", "mask_url")
TEMPLATE_FIELDS = ("prompt", "negative_prompt", "image", "mask", "image_url")
OPENAI_FIELDS = ("prompt", "negative_prompt", "model", "size", "response_format", "output_format",
                 "user")  # fmt: skip

#: any code point, lone surrogates (category Cs) and NUL included
_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
TEXTS = st.one_of(
    _ANY_TEXT,
    st.builds(lambda a, b: a + chr(0xD800) + b, _ANY_TEXT, _ANY_TEXT),  # a surrogate, surely
    st.builds(lambda a, b: a + "\x00" + b, _ANY_TEXT, _ANY_TEXT),  # a NUL, surely
)


@pytest.fixture(scope="module")
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    return shared_server(request)


def is_bad_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return "\x00" in text


def post_json(srv: ServerProcess, path: str, payload: dict):
    # ensure_ascii (the default) writes a lone surrogate as the escape "\ud800", as any client's
    # JSON encoder may: the server's decoder turns it back into one
    return srv.post(path, data=json.dumps(payload), headers={"Content-Type": "application/json"})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def rgba_mask() -> bytes:
    arr = np.full((SIZE, SIZE, 4), 255, np.uint8)
    arr[16:48, 16:48, 3] = 0  # alpha = 0: the region to edit
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(buf, format="PNG")
    return buf.getvalue()


def assert_answer(r, field: str, text: str, status: int = 422) -> None:
    """Never a 5xx; unencodable text (or NUL) in `field` is a 4xx naming that field."""
    assert r.status_code < 500, r.text
    if is_bad_text(text):
        assert r.status_code == status, (field, text, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_text", r.text
        assert err.get("field", err.get("param")) == field, r.text
        assert err["message"].startswith(f"{field}: "), r.text


def assert_lists_answer(srv: ServerProcess) -> None:
    r = srv.get("/v1/templates")
    assert r.status_code == 200, r.text
    for t in r.json()["data"]:
        assert srv.get(f"/v1/templates/{t['id']}").status_code == 200
    assert srv.get("/v1/models").status_code == 200


# ---- the reported cases -------------------------------------------------------------------------
def test_a_lone_surrogate_is_a_field_named_422_on_templates_and_edits(srv: ServerProcess) -> None:
    r = post_json(srv, "/v1/templates", {"image": b64(image_png(seed=71)), "prompt": "a\ud800"})
    assert r.status_code == 422, r.text
    assert r.json()["error"] == {
        "code": "invalid_text",
        "message": "prompt: is not valid Unicode text: character 1 is a lone surrogate (U+D800), "
        "which UTF-8 cannot encode",
        "field": "prompt",
    }
    assert_lists_answer(srv)  # nothing was stored
    edit = {"image": b64(image_png()), "mask": b64(mask_png()), "prompt": "x"}
    r = post_json(srv, "/v1/edits", {**edit, "negative_prompt": "a\ud800"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_text" and err["field"] == "negative_prompt"
    assert "SubmitEdit" not in err["message"] and "pack" not in err["message"]
    # an unknown member whose *name* is a lone surrogate: refused, and the answer still encodes
    r = post_json(srv, "/v1/edits", {**edit, "\udcff": 1})
    assert r.status_code == 422 and r.json()["error"]["field"] == "\\udcff", r.text
    assert r.json()["error"]["code"] == "invalid_text"


def test_nul_in_a_multipart_text_field_is_a_field_named_4xx(srv: ServerProcess) -> None:
    files = {"image": ("i.png", image_png()), "mask": ("m.png", mask_png())}
    r = srv.post("/v1/edits", files=files, data={"prompt": "a\x00b"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "prompt", r.text
    assert r.json()["error"]["code"] == "invalid_text"
    r = srv.post("/v1/templates", files={"image": ("i.png", image_png(seed=72))},
                 data={"prompt": "\x00"})  # fmt: skip
    assert r.status_code == 422 and r.json()["error"]["field"] == "prompt", r.text
    r = _openai(srv, user="u\x00")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "user" and r.json()["error"]["code"] == "invalid_text"


def test_a_stored_template_with_unencodable_text_still_renders() -> None:
    """Defensive serialization: a record whose prompt or worker message UTF-8 cannot encode
    (stored before validation existed, or quoted back by a worker) renders, escaped, in the
    template view that GET /v1/templates and /v1/templates/{id} answer."""
    from types import SimpleNamespace

    from instgenie.messages import RegisterTemplate
    from instgenie.server.native import _template_view
    from instgenie.server.schemas import TemplateResponse
    from instgenie.server.templates import TemplateRecord, WorkerBuild

    msg = RegisterTemplate(template_id="ab" * 32, image=b"", prompt="a\ud800", seed=0)
    rec = TemplateRecord(msg, SIZE, SIZE)
    rec.builds[0] = WorkerBuild(state="failed", message="RegisterTemplate: cannot pack 'a\ud800'")
    view = _template_view(SimpleNamespace(pool=SimpleNamespace(slots=[])), rec)
    json.dumps(view, ensure_ascii=False).encode("utf-8")  # what the JSON response does
    assert view["prompt"] == "a\\ud800" and view["status"] == "failed"
    assert (
        view["error"] == view["workers"][0]["message"] == "RegisterTemplate: cannot pack 'a\\ud800'"
    )
    TemplateResponse.model_validate(view)


# ---- every text field, generated ----------------------------------------------------------------
def _settings(fn):
    return settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))(fn)  # fmt: skip


def test_every_text_field_of_the_native_edit_route(srv: ServerProcess) -> None:
    base = {"image": b64(image_png()), "mask": b64(mask_png()), "prompt": "x",
            "num_inference_steps": 1}  # fmt: skip

    @_settings
    @given(field=st.sampled_from(EDIT_FIELDS), text=TEXTS)
    def run(field: str, text: str) -> None:
        payload = {**base, field: text}
        if field == "template_id":
            del payload["image"]
        assert_answer(post_json(srv, "/v1/edits", payload), field, text)

    run()
    assert_lists_answer(srv)


def test_every_text_field_of_the_template_route(srv: ServerProcess) -> None:
    image = image_png(seed=73)

    @_settings
    @given(field=st.sampled_from(TEMPLATE_FIELDS), text=TEXTS)
    def run(field: str, text: str) -> None:
        payload = {"image": b64(image), "prompt": "p", "num_inference_steps": 1, field: text}
        r = post_json(srv, "/v1/templates", payload)
        assert_answer(r, field, text)
        if r.status_code in (200, 202):  # registered: forget it, so the next one registers
            assert_lists_answer(srv)
            assert srv.delete(f"/v1/templates/{r.json()['id']}").status_code == 200

    run()
    assert_lists_answer(srv)


def test_every_text_field_of_the_openai_route(srv: ServerProcess) -> None:
    """Multipart carries bytes: a lone surrogate cannot be sent as UTF-8, so it is sent as the
    bytes "surrogatepass" makes (not UTF-8; Starlette reads such a part as Latin-1): never a
    5xx. NUL can be sent, and is a 400 naming the field."""
    files = {"image": ("i.png", image_png()), "mask": ("m.png", rgba_mask())}

    @_settings
    @given(field=st.sampled_from(OPENAI_FIELDS), text=TEXTS)
    def run(field: str, text: str) -> None:
        fields = {"prompt": "x", "num_inference_steps": "1", field: text}
        parts = {k: (None, v.encode("utf-8", "surrogatepass")) for k, v in fields.items()}
        r = srv.post("/v1/images/edits", files={**files, **parts})
        assert r.status_code < 500, r.text
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return
        assert_answer(r, field, text, status=400)

    run()
    assert_lists_answer(srv)


# ---- OpenAI: strength and unknown fields; steps: one message ------------------------------------
def _openai(srv: ServerProcess, **fields: str):
    files = {"image": ("i.png", image_png()), "mask": ("m.png", rgba_mask())}
    return srv.post("/v1/images/edits", files=files, data={"prompt": "x", **fields})


@pytest.mark.parametrize("value", ["0", "nan", "-0.5", "1.5", "inf"])
def test_openai_strength_out_of_range_is_refused(srv: ServerProcess, value: str) -> None:
    r = _openai(srv, strength=value)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "strength"


def test_openai_strength_is_used(srv: ServerProcess) -> None:
    """A partial strength runs fewer steps, as on the native route (it was silently dropped)."""
    r = _openai(srv, strength="0.5", num_inference_steps="4", seed="3")
    assert r.status_code == 200, r.text
    native = srv.post(
        "/v1/edits",
        files={"image": ("i.png", image_png()), "mask": ("m.png", mask_png())},
        data={"prompt": "x", "strength": "0.5", "num_inference_steps": "4"},
    )
    assert native.status_code == 200 and native.json()["num_steps"] == 2, native.text
    full = _openai(srv, strength="1", num_inference_steps="4", seed="3")
    assert full.status_code == 200
    assert r.json()["data"][0]["b64_json"] != full.json()["data"][0]["b64_json"]


@pytest.mark.parametrize("name", ["template_id", "colour", "steps"])
def test_openai_refuses_fields_it_does_not_read(srv: ServerProcess, name: str) -> None:
    r = _openai(srv, **{name: "ab" * 32})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "invalid_request"
    assert err["message"].startswith(f"{name}: Extra inputs are not permitted")
    if name == "template_id":
        assert "POST /v1/edits takes template_id" in err["message"]


@pytest.mark.parametrize("steps", [0, 201, 10**9])
def test_one_steps_message_on_every_route(srv: ServerProcess, steps: int) -> None:
    want = f"num_inference_steps: must be an integer between 1 and 200, got {steps}"
    edit = {"image": b64(image_png()), "mask": b64(mask_png()), "prompt": "x"}
    answers = [
        post_json(srv, "/v1/edits", {**edit, "num_inference_steps": steps}),
        srv.post("/v1/edits", files={"image": ("i.png", image_png()), "mask": ("m", mask_png())},
                 data={"prompt": "x", "num_inference_steps": str(steps)}),
        post_json(srv, "/v1/templates", {"image": b64(image_png(seed=74)),
                                         "num_inference_steps": steps}),
        _openai(srv, num_inference_steps=str(steps)),
    ]  # fmt: skip
    for r in answers:
        assert r.status_code in (400, 422), r.text
        err = r.json()["error"]
        assert err["message"] == want, r.text
        assert err.get("field", err.get("param")) == "num_inference_steps"
