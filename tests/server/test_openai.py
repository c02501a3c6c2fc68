"""The OpenAI-compatible route driven by the unmodified `openai` Python client (and by a raw
multipart request in the client's array form): alpha = 0 marks the edit region, b64_json answers,
OpenAI-shaped errors, and the template cache found by hashing the image bytes."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from tests.server.test_harness import SIZE, ServerProcess, image_png, shared_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    return shared_server(request)


@pytest.fixture(scope="module")
def client(srv: ServerProcess):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _rgba_mask(box=(16, 16, 48, 48)) -> bytes:
    """OpenAI polarity: opaque everywhere except a transparent box (the region to edit)."""
    arr = np.full((SIZE, SIZE, 4), 255, np.uint8)
    x0, y0, x1, y1 = box
    arr[y0:y1, x0:x1, 3] = 0
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(buf, format="PNG")
    return buf.getvalue()


def _image(b64: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


def test_openai_client_edit(client, srv: ServerProcess) -> None:
    image = image_png(seed=61)
    res = client.images.edit(
        image=("in.png", image, "image/png"),
        mask=("mask.png", _rgba_mask(), "image/png"),
        prompt="a straw hat",
        model="sd2-inpaint:tiny",
        n=2,
        size="auto",
    )
    assert res.created > 0 and len(res.data) == 2
    a, b = (_image(d.b64_json) for d in res.data)
    assert a.format == b.format == "PNG" and a.size == b.size == (SIZE, SIZE)
    # the region outside the transparent box is pasted back from the input
    src = np.asarray(Image.open(io.BytesIO(image)).convert("RGB")).astype(int)
    out = np.asarray(a.convert("RGB")).astype(int)
    assert (
        np.abs(out[:8] - src[:8]).max() <= 2
        and np.abs(out[16:48, 16:48] - src[16:48, 16:48]).max() > 8
    )
    assert np.asarray(a).tobytes() != np.asarray(b).tobytes()  # n images, n seeds


def test_openai_image_transparency_is_the_mask(client) -> None:
    arr = np.asarray(Image.open(io.BytesIO(image_png(seed=62))).convert("RGBA")).copy()
    arr[20:40, 20:40, 3] = 0
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(buf, format="PNG")
    res = client.images.edit(
        image=("in.png", buf.getvalue(), "image/png"), prompt="a cat", output_format="webp"
    )
    assert _image(res.data[0].b64_json).format == "WEBP"


def test_openai_errors_have_openai_shape(client, srv: ServerProcess) -> None:
    image = ("in.png", image_png(seed=63), "image/png")
    with pytest.raises(openai.BadRequestError) as e:  # an opaque mask: wrong polarity convention
        client.images.edit(image=image, mask=("m.png", image_png(seed=1), "image/png"), prompt="x")
    err = e.value.body
    assert err["param"] == "mask" and err["type"] == "invalid_request_error"
    assert "alpha" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(
            image=image,
            mask=("m.png", _rgba_mask(), "image/png"),
            prompt="x",
            response_format="url",
        )
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.NotFoundError) as e:
        client.images.edit(
            image=image, mask=("m.png", _rgba_mask(), "image/png"), prompt="x", model="dall-e-2"
        )
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:  # no transparency anywhere: nothing to edit
        client.images.edit(image=image, prompt="x")
    assert e.value.body["param"] == "mask"
    r = srv.post("/v1/images/edits", data={"prompt": "x"})  # raw: the exact OpenAI error shape
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for body in ('{"prompt": "x"}', '{"prompt":'):  # JSON, even broken: says what it takes
        r = srv.post("/v1/images/edits", data=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_media_type"
        assert "this route takes multipart/form-data" in r.json()["error"]["message"]


def test_raw_multipart_array_form_and_template_hit(srv: ServerProcess) -> None:
    """`image[]` as the client sends image lists; the same bytes as a template hit its cache."""
    image = image_png(seed=64)
    r = srv.post(
        "/v1/templates",
        files={"image": ("t.png", image, "image/png")},
        data={"num_inference_steps": "2"},
    )
    tid = r.json()["id"]
    while srv.get(f"/v1/templates/{tid}").json()["status"] == "building":
        time.sleep(0.05)
    before = srv.metric("instgenie_edits_total", path="masked", cache="hit")
    r = srv.post(
        "/v1/images/edits",
        files=[
            ("image[]", ("in.png", image, "image/png")),
            ("mask", ("m.png", _rgba_mask(), "image/png")),
        ],
        data={"prompt": "x", "response_format": "b64_json"},
    )
    assert r.status_code == 200, r.text
    assert _image(r.json()["data"][0]["b64_json"]).size == (SIZE, SIZE)
    assert srv.metric("instgenie_edits_total", path="masked", cache="hit") == before + 1
