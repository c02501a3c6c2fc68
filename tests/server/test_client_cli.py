"""`instgenie client ...` (instgenie/server/client_cli.py): input and output errors, `template
--wait` outcomes and Ctrl-C.

What is tested is the client's own behaviour, so the server is a stand-in (`FakeAPI`, stdlib
http.server in a thread) that answers the few routes the client uses like the real API does and
records what it was sent; tests/server/test_e2e.py runs the client against a real server.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from instgenie.cli import main

ROOT = Path(__file__).resolve().parents[2]
IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 256  # 64 KiB of "image" the client stores


class FakeAPI:
    """POST /v1/edits, POST /v1/templates, GET /v1/templates/{id}, GET /ready."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.template_states = ["building"]  # POST answers the first; each GET the next (last)
        self.hold_edits = False  # hold POST /v1/edits until `release` is set
        self.edit_arrived, self.release = threading.Event(), threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, obj: dict) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                api.requests.append(("POST", self.path))
                if self.path == "/v1/edits":
                    api.edit_arrived.set()
                    if api.hold_edits:
                        api.release.wait(30)
                    self._answer(200, api.edit_answer())
                elif self.path == "/v1/templates":
                    self._answer(202, api.template_answer())
                else:
                    self._answer(404, {"error": {"code": "not_found", "message": self.path}})

            def do_GET(self) -> None:
                api.requests.append(("GET", self.path))
                if self.path == "/v1/templates/tpl-1":
                    self._answer(200, api.template_answer())
                elif self.path == "/ready":
                    self._answer(200, {"ready": True, "reason": None})
                else:
                    self._answer(404, {"error": {"code": "not_found", "message": self.path}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def edit_answer(self) -> dict:
        return {
            "id": "edit-1",
            "object": "edit",
            "image": base64.b64encode(IMAGE).decode(),
            "output_format": "png",
            "path": "full",
            "mask_ratio": 0.25,
        }

    def template_answer(self) -> dict:
        states = self.template_states
        state = states.pop(0) if len(states) > 1 else states[0]
        error = "image: not a decodable image" if state == "failed" else None
        return {"id": "tpl-1", "object": "template", "status": state, "error": error}

    def edits(self) -> int:
        return self.requests.count(("POST", "/v1/edits"))

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def api():
    fake = FakeAPI()
    yield fake
    fake.close()


def client(capsys, *argv: str) -> tuple[int, str, str]:
    """Run `instgenie client ARGV` in this process: (exit status, stdout, stderr)."""
    rc = main(["client", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def edit_args(api: FakeAPI, output: Path | str, *extra: str) -> list[str]:
    return ["edit", "--server", api.url, "--prompt", "a red hat", *extra, "-o", str(output)]


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# -- -o / --output ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("notimage.png/e.png", "'notimage.png' is not a directory"),  # the parent is a file
        ("notimage.png/sub/e.png", "'notimage.png' is not a directory"),
        ("nodir/e.png", "directory 'nodir' does not exist (create it first)"),  # none is made
        ("no/such/dir/e.png", "directory 'no/such/dir' does not exist"),
        ("somedir", "is a directory"),
        ("edit.txt", "not an image file suffix"),
    ],
)
def test_edit_refuses_an_unusable_output_before_sending_the_request(
    api: FakeAPI, tmp_path, monkeypatch, capsys, target: str, words: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notimage.png").write_bytes(b"not a directory")
    (tmp_path / "somedir").mkdir()
    before = listing(tmp_path)
    rc, out, err = client(capsys, *edit_args(api, target))
    assert rc == 2, err
    assert err.startswith("invalid input: output: ") and words in err, err
    assert "Traceback" not in err and out == ""
    assert api.edits() == 0  # refused before the server did any work
    assert listing(tmp_path) == before
    assert (tmp_path / "notimage.png").read_bytes() == b"not a directory"


def test_edit_with_an_explicit_format_accepts_any_output_name(
    api: FakeAPI, tmp_path, capsys
) -> None:
    out_file = tmp_path / "edit.out"
    rc, out, err = client(capsys, *edit_args(api, out_file, "--format", "png"))
    assert rc == 0, err
    assert out_file.read_bytes() == IMAGE


def test_edit_writes_the_output_whole_and_leaves_no_temporary_file(
    api: FakeAPI, tmp_path, capsys
) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    out_file = tmp_path / "a" / "b" / "edit.png"
    rc, out, err = client(capsys, *edit_args(api, out_file))
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["output"] == str(out_file) and summary["path"] == "full"
    assert "image" not in summary
    assert out_file.read_bytes() == IMAGE
    assert listing(tmp_path) == ["a", "a/b", "a/b/edit.png"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(out_file.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    out_file.write_bytes(b"an older edit")  # an existing output is replaced
    rc, out, err = client(capsys, *edit_args(api, out_file))
    assert rc == 0, err
    assert out_file.read_bytes() == IMAGE
    assert listing(tmp_path) == ["a", "a/b", "a/b/edit.png"]


def test_edit_that_cannot_write_its_output_exits_2_and_leaves_no_partial_file(
    api: FakeAPI, tmp_path
) -> None:
    """A write that fails half way (here a file size limit, `ulimit -f`; a full disk is alike)
    is a usage error naming `output`; the earlier file at that path is untouched."""
    out_file = tmp_path / "edit.png"
    out_file.write_bytes(b"an older edit")
    limit = len(IMAGE) // 2

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "instgenie.server", "client", *edit_args(api, out_file)]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(
        cmd, cwd=ROOT, env=env, preexec_fn=small_files, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("invalid input: output: ") and "File too large" in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert api.edits() == 1
    assert listing(tmp_path) == ["edit.png"]  # no temporary file left
    assert out_file.read_bytes() == b"an older edit"


# -- --image / --mask -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["edit", "--image", "nope.png", "-o", "out.png"], "image"),
        (["edit", "--mask", "nope.png", "-o", "out.png"], "mask"),
        (["edit", "--template-id", "tpl-1", "--mask", "nope.png", "-o", "out.png"], "mask"),
        (["template", "--image", "nope.png"], "image"),
        (["template", "--mask", "nope.png"], "mask"),
    ],
)
def test_an_unreadable_input_file_is_a_usage_error_naming_its_field(
    api: FakeAPI, tmp_path, monkeypatch, capsys, argv: list[str], field: str
) -> None:
    monkeypatch.chdir(tmp_path)
    extra = ["--prompt", "a red hat"] if argv[0] == "edit" else []
    rc, out, err = client(capsys, argv[0], "--server", api.url, *extra, *argv[1:])
    assert rc == 2, err
    assert err.startswith(f"invalid input: {field}: ") and "nope.png" in err, err
    assert "No such file or directory" in err and "Traceback" not in err
    assert api.requests == [] and out == ""
    assert listing(tmp_path) == []


# -- template --wait --------------------------------------------------------------------------


def template_args(api: FakeAPI, *extra: str) -> list[str]:
    return ["template", "--server", api.url, "--prompt", "a person", *extra]


def test_template_wait_prints_the_ready_template_and_exits_0(api: FakeAPI, capsys) -> None:
    api.template_states = ["building", "building", "ready"]
    rc, out, err = client(capsys, *template_args(api, "--wait", "--timeout", "30"))
    assert rc == 0, err
    assert json.loads(out) == {
        "id": "tpl-1",
        "object": "template",
        "status": "ready",
        "error": None,
    }
    assert api.requests.count(("GET", "/v1/templates/tpl-1")) == 2


def test_template_without_wait_exits_0_while_building(api: FakeAPI, capsys) -> None:
    rc, out, err = client(capsys, *template_args(api))
    assert rc == 0, err
    assert json.loads(out)["status"] == "building"
    assert api.requests == [("POST", "/v1/templates")]


def test_template_wait_that_times_out_exits_1(api: FakeAPI, capsys) -> None:
    rc, out, err = client(capsys, *template_args(api, "--wait", "--timeout", "1"))
    assert rc == 1, err
    assert json.loads(out)["status"] == "building"  # the last state, to go on polling
    assert err.strip() == "timeout: template tpl-1 still building after 1 s"


def test_template_that_failed_to_build_exits_1_and_says_why(api: FakeAPI, capsys) -> None:
    api.template_states = ["building", "failed"]
    rc, out, err = client(capsys, *template_args(api, "--wait", "--timeout", "30"))
    assert rc == 1, err
    assert json.loads(out)["status"] == "failed"
    assert err.strip() == "error: template tpl-1 failed: image: not a decodable image"


@pytest.mark.parametrize(
    ("option", "value"), [("--timeout", "-5"), ("--timeout", "0"), ("--timeout", "nan")]
)
def test_template_timeout_must_be_positive(api: FakeAPI, capsys, option: str, value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["client", *template_args(api, "--wait", f"{option}={value}")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be > 0, got {value}" in err
    assert api.requests == []


@pytest.mark.parametrize("command", ["edit", "template", "health"])
def test_wait_ready_s_must_not_be_negative(api: FakeAPI, capsys, command: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["client", command, "--server", api.url, "--wait-ready-s=-1"])
    assert exc.value.code == 2
    assert "argument --wait-ready-s: must be >= 0, got -1" in capsys.readouterr().err
    assert api.requests == []


# -- Ctrl-C -----------------------------------------------------------------------------------


def test_sigint_during_an_edit_exits_130_without_a_traceback_or_a_file(
    api: FakeAPI, tmp_path
) -> None:
    api.hold_edits = True
    out_file = tmp_path / "edit.png"
    cmd = [sys.executable, "-m", "instgenie.cli", "client", *edit_args(api, out_file)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a shell's background job inherits SIGINT ignored (CI): give the client a terminal's
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert api.edit_arrived.wait(60), "the client never sent its edit"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted" and out == ""
    assert listing(tmp_path) == []  # neither the file nor its temporary
