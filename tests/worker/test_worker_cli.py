"""`instgenie worker`: a worker run from the command line serves a client and drains on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from instgenie.config import ExecConfig, to_dict
from instgenie.ipc import ipc_address
from instgenie.worker.client import WorkerClient
from tests.conftest import make_image, make_mask, png_bytes

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, **variables: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **variables)
    return subprocess.Popen([sys.executable, "-m", "instgenie.cli", "worker", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_worker_command_serves_and_drains_on_sigterm() -> None:
    address = ipc_address("cli-worker")
    proc = _cli("--model", "sd2-inpaint:tiny", "--address", address, "--max-batch", "2",
                "--graph-capture", "always", INSTGENIE_FUSED_GEGLU="off")  # fmt: skip
    try:
        line = proc.stdout.readline()  # blocks until the ready line (or EOF if it died)
        assert line, proc.stderr.read()
        ready = json.loads(line)
        assert (ready["event"], ready["address"], ready["pid"]) == ("ready", address, proc.pid)
        assert (ready["model"], ready["policy"]) == ("sd2-inpaint:tiny", "continuous")
        # its execution settings: the flag given, the variable set, the defaults
        want = ExecConfig(graph_capture="always", fused_geglu="off")
        assert ready["execution"] == to_dict(want)
        children = _children(proc.pid)
        assert len(children) == 3  # loop, pre, post
        with WorkerClient(address) as client:
            image, mask = png_bytes(make_image(64, 64)), png_bytes(make_mask(64, 64))
            handle = client.edit(image=image, mask=mask, prompt="a hat", seed=1,
                                 num_inference_steps=3)  # fmt: skip
            while not handle.progress:  # mid-run when the signal arrives: drain lets it finish
                assert not handle.future.done(), handle.result()
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            done = handle.result(timeout=120)
            assert (done.width, done.height, done.num_steps) == (64, 64, 3)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert not [p for p in children if Path(f"/proc/{p}").exists()], "orphan processes"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_command_refuses_a_remote_address() -> None:
    proc = _cli("--model", "sd2-inpaint:tiny", "--address", "tcp://0.0.0.0:7701")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "address" in err and "refusing non-local address" in err


def test_worker_command_beyond_loopback_with_curve_keys(tmp_path: Path) -> None:
    """`--address tcp://0.0.0.0:PORT --allow-remote --curve-keys FILE`: clients holding the
    client file's keys are served, others get no answer."""
    from instgenie.cli import main
    from instgenie.curve import CurveKeys, read_client_keys
    from tests.curve_helpers import free_tcp_port

    assert main(["keys", "generate", "-o", str(tmp_path / "w.json")]) == 0
    port = free_tcp_port()
    proc = _cli("--model", "sd2-inpaint:tiny", "--address", f"tcp://0.0.0.0:{port}",
                "--allow-remote", "--curve-keys", str(tmp_path / "w.json"))  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        assert json.loads(line)["address"] == f"tcp://0.0.0.0:{port}"
        address = f"tcp://127.0.0.1:{port}"
        with WorkerClient(address, curve=read_client_keys(tmp_path / "w-client.json")) as client:
            assert client.stats(timeout=30)["ready"] == 1
        with WorkerClient(address, curve=CurveKeys.generate().client_side()) as stranger:
            with pytest.raises(TimeoutError):
                stranger.stats(timeout=3)
        with WorkerClient(address) as plain:
            with pytest.raises(TimeoutError):
                plain.stats(timeout=3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
