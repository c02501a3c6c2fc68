"""The web editor (`instgenie serve` at `/`) in a real headless Chromium, against a real server
(tiny model, CPU): register a template through the page, paint a mask with mouse events, submit,
follow the job's Server-Sent Events, cancel mid-run, a wrong-size mask's field error, an axe-core
accessibility check, a phone-width viewport with touch painting, and no request to any other
host. Chromium is the system's (Debian's `chromium`, installed by .ci/run); Playwright's Python
client drives it, no browser is downloaded. Set INSTGENIE_UI_SCREENSHOT=docs/images/editor.png
to (re)write the README's screenshot.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from instgenie.server.app import create_app
from instgenie.server.config import ServerConfig
from instgenie.server.metrics import Metrics
from instgenie.server.ui import CSP
from tests.conftest import make_image, png_bytes
from tests.server.test_harness import ROOT, shared_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
AXE = ROOT / "tests" / "assets" / "axe-core" / "axe.min.js"
SIZE = 128  # the template's side, pixels
TIMEOUT_MS = 120_000  # generous: a loaded 2-core machine

browser_only = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (CI installs Debian's: apt-get install chromium)"
)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (dev extra) missing")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (CI installs Debian's: apt-get install chromium)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Watch:
    """Every request a browser context makes, and the page's errors (CSP refusals included)."""

    def __init__(self, context, origin: str) -> None:
        self.origin = origin
        self.urls: list[str] = []
        self.errors: list[str] = []
        context.on("request", lambda r: self.urls.append(r.url))

    def page(self, context):
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on(
            "console",
            lambda m: self.errors.append(m.text) if m.type == "error" else None,
        )
        return page

    def check(self) -> None:
        assert self.urls, "the page made no request"
        foreign = [u for u in self.urls if urlsplit(u).scheme not in ("blob", "data")
                   and f"{urlsplit(u).scheme}://{urlsplit(u).netloc}" != self.origin]  # fmt: skip
        assert not foreign, f"requests to other hosts: {foreign}"
        # a 4xx the page provoked on purpose is logged by Chromium as a failed resource load
        refused = [e for e in self.errors if "status of 4" not in e]
        assert not refused, f"page errors: {refused}"


def _wait(page, js: str) -> None:
    """Wait until `js` (an expression) holds; on timeout, fail with what the page shows."""
    try:
        page.wait_for_function(f"() => {js}")
    except Exception as e:
        shown = page.evaluate(
            """() => ['job-status', 'job-log', 'e-form-error', 'e-mask-error', 't-form-error']
                 .map(id => id + ': ' + document.getElementById(id).textContent).join('\\n')"""
        )
        raise AssertionError(f"never {js}:\n{shown}") from e


def _ratio(page) -> float:
    return float(page.locator("#mask-ratio").inner_text().rstrip("%"))


def _stroke(page, points: list[tuple[float, float]]) -> None:
    """A mouse drag over the mask canvas through `points` (fractions of its box)."""
    box = page.locator("#mask-canvas").bounding_box()
    xy = [(box["x"] + fx * box["width"], box["y"] + fy * box["height"]) for fx, fy in points]
    page.mouse.move(*xy[0])
    page.mouse.down()
    for x, y in xy[1:]:
        page.mouse.move(x, y, steps=8)
    page.mouse.up()


@browser_only
def test_editor_flow(request, browser, tmp_path: Path) -> None:
    srv = shared_server(request)
    origin = srv.url.rstrip("/")
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    watch = Watch(context, origin)
    context.add_init_script(path=str(AXE))  # as devtools would inject it: exempt from the CSP
    page = watch.page(context)
    try:
        resp = page.goto(origin + "/")
        assert resp.status == 200 and resp.headers["content-security-policy"] == CSP
        assert "default-src 'self'" in CSP

        # 1. register a template through the page; the gallery shows it building, then ready
        image = tmp_path / "template.png"
        image.write_bytes(png_bytes(make_image(SIZE, SIZE, seed=29)))
        page.set_input_files("#t-image", str(image))
        page.fill("#t-prompt", "a test scene")
        page.fill("#t-steps", "2")
        page.click("#t-submit")
        # its own row: the shared server holds other tests' templates too
        tid = hashlib.sha256(image.read_bytes()).hexdigest()
        ready = page.locator(f"#gallery li[data-id='{tid}'][data-status=ready]")
        ready.wait_for()
        row = ready.inner_text()
        assert "2 steps" in row and f"{SIZE}×{SIZE}" in row, row
        assert page.locator("#mask-canvas").evaluate("c => [c.width, c.height]") == [SIZE, SIZE]

        # 2. paint: brush stroke, undo, rectangle, invert twice; the ratio follows live
        assert _ratio(page) == 0.0
        _stroke(page, [(0.2, 0.5), (0.8, 0.5)])
        stroke = _ratio(page)
        assert 2 < stroke < 40, stroke
        page.click("#undo")
        assert _ratio(page) == 0.0
        page.check("input[name=tool][value=rect]")
        _stroke(page, [(0.25, 0.25), (0.75, 0.75)])
        rect = _ratio(page)
        assert 20 < rect < 30, rect  # ~ a quarter of the image
        page.click("#invert")
        assert abs(_ratio(page) - (100 - rect)) < 0.2
        page.click("#invert")
        assert _ratio(page) == rect

        # 3. cancel mid-run: the held job is running, Cancel ends it, the form is usable again
        srv.gate.touch()
        try:
            page.fill("#e-prompt", "HOLD")
            page.click("#e-submit")
            _wait(page, "/Running|Step/.test(document.getElementById('job-status').textContent)")
            assert page.locator("#e-submit").is_disabled()
            page.click("#e-cancel")
            _wait(page, "document.getElementById('job-status').textContent === 'Cancelled.'")
        finally:
            srv.gate.unlink(missing_ok=True)
        assert page.locator("#e-submit").is_enabled()
        assert "cancelled" in page.locator("#job-log").inner_text()

        # 4. an edit, submitted with the keyboard (Enter in the prompt field); the progress bar
        # follows the job's events to 2/2; the result has the template's size, the masked path
        page.fill("#e-prompt", "a red square")
        page.fill("#e-seed", "7")
        page.focus("#e-prompt")
        page.keyboard.press("Enter")
        _wait(page, "document.getElementById('job-status').textContent === 'Done.'")
        log = page.locator("#job-log").inner_text()
        assert re.search(r"queued.*step 1/2.*step 2/2.*done", log), log
        assert page.locator("#progress").evaluate("p => [p.value, p.max]") == [2, 2]
        after = page.locator("#after-image")
        page.wait_for_function("() => document.getElementById('after-image').naturalWidth > 0")
        assert after.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [SIZE, SIZE]
        info = page.locator("#result-info")
        assert info.locator("dd[data-key=path]").inner_text() == "masked"
        assert "tier" in info.locator("dd[data-key=cache]").inner_text()
        sent = float(info.locator("dd[data-key=mask_ratio]").inner_text().rstrip("%"))
        assert abs(sent - rect) < 0.2, (sent, rect)  # the exported PNG is the painted mask
        assert page.locator("#history li").count() == 1
        assert page.locator("#download").get_attribute("download").endswith(".png")

        # 5. the screenshot (README): not blank
        shot = tmp_path / "editor.png"
        page.screenshot(path=str(shot))
        pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
        assert pixels.shape[1] == 1400 and pixels.std() > 10, pixels.std()
        target = os.environ.get("INSTGENIE_UI_SCREENSHOT")
        if target:
            shutil.copyfile(shot, ROOT / target)

        # 6. a worker failure (an injected fault in post-processing): the message is shown,
        # the form keeps its values and takes the next edit
        page.fill("#e-prompt", "FAULT-POST")
        page.click("#e-submit")
        _wait(page, "document.getElementById('job-status').textContent === 'Failed.'")
        assert page.locator("#e-form-error").inner_text().strip(), "no failure message"
        assert page.input_value("#e-prompt") == "FAULT-POST"
        assert page.locator("#e-submit").is_enabled()
        page.fill("#e-prompt", "a red square")

        # 7. a wrong-size uploaded mask: the API's field error beside the mask; nothing lost
        small = tmp_path / "small-mask.png"
        small.write_bytes(png_bytes(Image.new("L", (32, 32), 255)))
        page.set_input_files("#mask-file", str(small))
        page.click("#e-submit")
        err = page.locator("#e-mask-error")
        err.wait_for()
        assert "mask" in err.inner_text() and "32x32" in err.inner_text(), err.inner_text()
        assert page.locator("#mask-file").get_attribute("aria-invalid") == "true"
        assert page.input_value("#e-prompt") == "a red square"
        assert page.input_value("#e-seed") == "7"
        assert page.locator("#e-submit").is_enabled()

        # 8. accessibility: axe-core finds no serious or critical violation
        violations = page.evaluate(
            """async () => (await axe.run(document, {resultTypes: ['violations']})).violations
                 .map(v => ({id: v.id, impact: v.impact,
                             nodes: v.nodes.map(n => n.target.join(" "))}))"""
        )
        bad = [v for v in violations if v["impact"] in ("serious", "critical")]
        assert not bad, bad
        watch.check()
    finally:
        context.close()


@browser_only
def test_editor_phone_width_touch(request, browser) -> None:
    srv = shared_server(request)
    origin = srv.url.rstrip("/")
    buf = io.BytesIO(png_bytes(make_image(SIZE, SIZE, seed=30)))
    r = srv.post("/v1/templates", files={"image": ("t.png", buf, "image/png")},
                 data={"prompt": "phone", "num_inference_steps": "2"})  # fmt: skip
    assert r.status_code in (200, 202), r.text
    short = r.json()["id"][:10]
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True,
                                  is_mobile=True)  # fmt: skip
    watch = Watch(context, origin)
    page = watch.page(context)
    try:
        page.goto(origin + "/")
        # a template registered elsewhere: selectable, painted on a blank canvas of its size
        page.get_by_role("button", name=f"Select template {short}").click()
        overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"{overflow} px of horizontal overflow at 390 px"
        canvas = page.locator("#mask-canvas")
        canvas.scroll_into_view_if_needed()
        box = canvas.bounding_box()
        assert box["width"] <= 390
        page.touchscreen.tap(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_function("() => document.getElementById('mask-ratio').textContent !== '0.0%'")
        assert _ratio(page) > 0
        watch.check()
    finally:
        context.close()


def test_no_ui_flag() -> None:
    """`--no-ui` comes from ServerConfig.ui; without it `/` is the editor with its CSP."""
    from instgenie.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "sd2-inpaint:tiny", "--no-ui"])
    assert args.ui is False
    for ui in (True, False):
        runtime = type("R", (), {"cfg": ServerConfig(ui=ui), "metrics": Metrics()})()
        client = TestClient(create_app(runtime))  # no lifespan: the runtime is not started
        page = client.get("/")
        if ui:
            assert page.status_code == 200 and "editor.js" in page.text
            assert page.headers["content-security-policy"] == CSP
            js = client.get("/ui/editor.js")
            assert js.status_code == 200 and "javascript" in js.headers["content-type"]
            assert js.headers["cache-control"] == "no-cache"  # never an old module, new page
            assert js.headers["x-content-type-options"] == "nosniff"
            assert client.get("/ui/index.html").headers["content-security-policy"] == CSP
        else:
            assert page.status_code == 404 and client.get("/ui/editor.js").status_code == 404
