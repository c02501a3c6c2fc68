"""Shared by the server tests: a real `instgenie serve` subprocess (tiny model, CPU) and helpers;
plus the server's pure parts that need no server (routing policies, multipart part counting,
header-only image probing).

`shared_server(request)` starts one server for the whole session on first use (the modules that
use it share it) and stops it at the end of the session, checking that no process and no
/dev/shm segment is left behind.
"""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from instgenie.config import LimitsConfig
from instgenie.errors import ValidationError
from instgenie.scheduler.routing import LeastLoaded, RoundRobin, RouteRequest, WorkerView
from instgenie.server.uploads import _PartCounter, probe_image
from tests.conftest import make_image, make_mask, png_bytes

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sd2-inpaint:tiny"  # the faster tiny family on CPU (measured against sdxl-inpaint:tiny)
SIZE = 64  # test images are SIZE x SIZE pixels
START_TIMEOUT_S = 300
FAULT_PROMPTS = {
    "pre": "FAULT-PRE",
    "post": "FAULT-POST",
    "nan": "FAULT-NAN",
    "stall": "FAULT-STALL",
    "hold": "HOLD",
    "slowenc": "SLOW-ENCODE",
}
_SERVING = re.compile(r"serving \S+ on (http://\S+) with")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process whose parent chain reaches `pid`."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier and c not in out}
        out |= frontier
    return out


def worker_processes(sup_pids: set[int]) -> set[int]:
    """Live processes of these worker supervisors, reparented ones included: the supervisors
    and every child whose spec names one of their shm prefixes."""
    marks = [f'"shm_base": "igw{s}"' for s in sup_pids]
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        pid = int(d.name)
        if (pid in sup_pids and "instgenie.worker" in cmd) or any(m in cmd for m in marks):
            if _alive(pid):
                out.add(pid)
    return out


def shm_segments(sup_pids: set[int]) -> list[str]:
    return sorted(
        p.name
        for p in Path("/dev/shm").iterdir()
        if any(p.name.startswith(f"igw{s}-") or p.name.startswith(f"igw{s}_") for s in sup_pids)
    )


class ServerProcess:
    """`python -m instgenie.server serve ...` with its log in a temp file."""

    def __init__(self, *flags: str, faults: bool = True, wait: bool = True) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="igs-test-"))
        self.step_log: Path | None = None  # where --step-log writes, when the caller passed it
        self.gate = self.dir / "gate"  # the "hold" fault holds the loop while this file exists
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env["INSTGENIE_FAULTS"] = (
            ",".join(f"{k}={v}" for k, v in FAULT_PROMPTS.items()) if faults else ""
        )
        env["INSTGENIE_FAULT_GATE"] = str(self.gate)
        cmd = [
            sys.executable,
            "-m",
            "instgenie.server",
            "serve",
            "--model",
            MODEL,
            "--port",
            "0",
            "--default-steps",
            "2",
            "--health-poll-s",
            "0.2",
            "--health-timeout-s",
            "2",
            "--heartbeat-interval-s",
            "0.2",
            "--restart-backoff-s",
            "0.2",
            *flags,
        ]
        self.log_path = self.dir / "server.log"
        self._final_log: str | None = None  # the log, once stop() removed the directory
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.sup_pids: set[int] = set()  # every worker supervisor seen in /health
        self.url = ""
        if wait:
            self.url = self._wait_url()
            self.health()

    def _wait_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            m = _SERVING.search(self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"server did not start:\n{self.log()[-4000:]}")

    def log(self) -> str:
        if self._final_log is not None:
            return self._final_log
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid

    # ---- HTTP ----------------------------------------------------------------------------------
    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, timeout=kw.pop("timeout", 300), **kw)

    def delete(self, path: str, **kw) -> requests.Response:
        return requests.delete(self.url + path, timeout=kw.pop("timeout", 60), **kw)

    def health(self) -> tuple[int, dict]:
        r = self.get("/health", timeout=10)
        body = r.json()
        self.sup_pids |= {w["pid"] for w in body["workers"] if w["pid"]}
        return r.status_code, body

    def worker(self, index: int = 0) -> dict:
        return self.health()[1]["workers"][index]

    def wait_health(self, want: int, timeout: float = 120.0, why: str = "") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.health()
            if status == want:
                return body
            assert time.monotonic() < deadline, f"/health never {want} ({why}): {body}"
            time.sleep(0.1)

    def wait_in_flight(self, n: int, timeout: float = 60.0, index: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while self.worker(index)["in_flight"] != n:
            assert time.monotonic() < deadline, f"in_flight never {n}: {self.worker(index)}"
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample in /metrics (0.0 if absent)."""
        want = "".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in self.get("/metrics").text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, value = line.rsplit(" ", 1)
            sample, _, rest = key.partition("{")
            got = "".join(sorted(re.findall(r'\w+="[^"]*"', rest)))
            if sample == name and got == want:
                return float(value)
        return 0.0

    # ---- shutdown ------------------------------------------------------------------------------
    def stop(
        self,
        sig: int | None = signal.SIGTERM,
        timeout: float = 120.0,
        procs: set[int] | None = None,
    ) -> int:
        """Signal the server (sig None: already signalled; then pass `procs`, its descendants
        from before), wait for it; assert no process or shm segment is left."""
        if self.proc.poll() is None and sig is not None:
            self.health_quiet()
        if procs is None:
            procs = descendants(self.pid) if self.proc.poll() is None else set()
        if self.proc.poll() is None and sig is not None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for p in descendants(self.pid) | {self.pid}:
                os.kill(p, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(
                f"server did not stop in {timeout} s:\n{self.log()[-3000:]}"
            ) from None
        finally:
            self._log.close()
        deadline = time.monotonic() + 15

        def left() -> set[int]:
            return {p for p in procs if _alive(p)} | worker_processes(self.sup_pids)

        while left() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left(), f"orphan processes: {left()}"
        assert shm_segments(self.sup_pids) == [], "leaked shared-memory segments"
        self._final_log = self.log()
        shutil.rmtree(self.dir, ignore_errors=True)  # kept when an assertion above failed
        return rc

    def health_quiet(self) -> None:
        try:
            self.health()
        except (requests.RequestException, ValueError):
            pass


_SHARED: dict[str, ServerProcess] = {}


def shared_server(request: pytest.FixtureRequest) -> ServerProcess:
    """The session's main server (one worker, fault hooks armed), started on first use."""
    srv = _SHARED.get("main")
    if srv is None or srv.proc.poll() is not None:
        step_log = Path(tempfile.mkdtemp(prefix="igs-steps-")) / "steps.jsonl"
        srv = ServerProcess(
            "--step-log",
            str(step_log),
            "--max-batch",
            "4",
            "--max-image-pixels",
            "1000000",
            "--max-body-bytes",
            "2000000",
            "--max-parts",
            "24",
            "--stall-s",
            "20",
        )
        srv.step_log = step_log
        _SHARED["main"] = srv
        request.config.add_cleanup(lambda: _stop_shared(srv))
    return srv


def _stop_shared(srv: ServerProcess) -> None:
    rc = srv.stop()
    assert rc == 0, f"server exit status {rc}:\n{srv.log()[-3000:]}"


# ---- images ------------------------------------------------------------------------------------
def image_png(seed: int = 0, size: int = SIZE) -> bytes:
    return png_bytes(make_image(size, size, seed=seed))


def mask_png(size: int = SIZE, box: tuple[float, ...] = (0.25, 0.25, 0.75, 0.75)) -> bytes:
    return png_bytes(make_mask(size, size, box=box))


def decoded(b64: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


def edit_files(image: bytes | None = None, mask: bytes | None = None) -> dict:
    files = {"mask": ("mask.png", mask if mask is not None else mask_png(), "image/png")}
    if image is not None:
        files["image"] = ("image.png", image, "image/png")
    return files


def png_header(width: int, height: int) -> bytes:
    """A PNG claiming width x height whose pixel data is a few bytes (a bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# ---- pure parts --------------------------------------------------------------------------------
def _view(index: int, in_flight: int, slots: int = 2, ready=()) -> WorkerView:
    return WorkerView(
        index=index,
        device="cpu",
        in_flight=in_flight,
        slots=slots,
        templates_ready=frozenset(ready),
    )


def test_least_loaded_prefers_room_then_template_affinity() -> None:
    policy = LeastLoaded()
    req = RouteRequest(template_id="t" * 64, num_steps=2, pixels=SIZE * SIZE)
    assert policy.choose(req, [_view(0, 1), _view(1, 0)]) == 1
    assert policy.choose(req, [_view(0, 0), _view(1, 0, ready=["t" * 64])]) == 1  # affinity
    assert policy.choose(req, [_view(0, 1, slots=4), _view(1, 1, slots=2)]) == 0  # fraction used
    assert policy.choose(req, [_view(0, 2), _view(1, 2)]) is None  # no room: the request queues


def test_round_robin_takes_turns_and_skips_full_workers() -> None:
    policy = RoundRobin()
    req = RouteRequest(template_id=None, num_steps=None, pixels=1)
    workers = [_view(0, 0), _view(1, 0), _view(2, 0)]
    assert [policy.choose(req, workers) for _ in range(4)] == [0, 1, 2, 0]
    assert policy.choose(req, [_view(0, 0), _view(1, 2), _view(2, 0)]) == 2  # 1 is full
    assert policy.choose(req, [_view(0, 2), _view(1, 2)]) is None


def test_part_counter_sees_delimiters_split_across_chunks() -> None:
    boundary = b"xyzBOUNDARY"
    body = (
        b"".join(
            b"--" + boundary + b'\r\nContent-Disposition: form-data; name="f"\r\n\r\nv\r\n'
            for _ in range(5)
        )
        + b"--"
        + boundary
        + b"--\r\n"
    )
    for step in (1, 3, 7, len(body)):
        counter = _PartCounter(boundary)
        parts = [counter.feed(body[i : i + step]) for i in range(0, len(body), step)][-1]
        assert parts == 5, step


def test_probe_reads_headers_only() -> None:
    limits = LimitsConfig(max_image_pixels=1_000_000)
    t0 = time.perf_counter()
    with pytest.raises(ValidationError, match=r"5000x5000 = 25000000 pixels; the limit is 1000000"):
        probe_image(png_header(5000, 5000), "image", limits)
    with pytest.raises(ValidationError, match=r"10000000000 pixels \(from its header\); the"):
        probe_image(png_header(100_000, 100_000), "image", limits)  # past Pillow's bomb limit
    assert time.perf_counter() - t0 < 0.5  # nothing was decoded
    gif = io.BytesIO()
    Image.new("P", (8, 8)).save(gif, format="GIF")
    with pytest.raises(ValidationError, match="allowed format"):
        probe_image(gif.getvalue(), "image", limits)
    # EXIF orientation 6 (rotate 90): the displayed size is the transposed one
    jpeg = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.zeros((32, 64, 3), np.uint8)).save(jpeg, format="JPEG", exif=exif)
    assert probe_image(jpeg.getvalue(), "image", limits).size == (32, 64)
    # a valid PNG whose pixel data is cut off still probes: the probe never decodes pixels
    png = io.BytesIO()
    Image.fromarray(np.full((64, 48, 3), 7, np.uint8)).save(png, format="PNG")
    cut = png.getvalue()[:-40]  # IDAT truncated, IEND gone
    assert probe_image(cut, "image", limits).size == (48, 64)


def test_health_counts_a_loop_busy_in_a_stage_call_as_progress() -> None:
    """WorkerSlot's stall rule (pure): a loop holding requests whose steps do not move is
    unhealthy after stall_s, unless the worker reports it busy in an encode/decode
    ("loop_busy_s" > 0: the worker's own watchdog bounds that by stage_timeout_s)."""
    from types import SimpleNamespace

    from instgenie.config import Config
    from instgenie.server.pool import WorkerSlot

    def slot() -> WorkerSlot:
        s = WorkerSlot(0, Config(), 4, state="up")
        s.handle = SimpleNamespace(proc=SimpleNamespace(poll=lambda: None))  # a live process
        return s

    for busy, healthy in ((0.0, False), (12.5, True)):
        s = slot()
        for t in (0.0, 10.0, 20.0, 31.0):  # stats polled; the step counter never moves
            s.observe({"ready": 1.0, "in_loop": 1.0, "steps_total": 7.0, "loop_busy_s": busy}, t)
        ok, why = s.health(31.0, timeout_s=5.0, stall_s=30.0)
        assert ok is healthy, why
        if not healthy:
            assert why == "denoise loop made no step for 31.0 s"
