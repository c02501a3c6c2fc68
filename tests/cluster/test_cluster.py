"""Cluster mode on a real local Ray cluster (ray.cluster_utils.Cluster: a head node and worker
nodes, each its own raylet on this machine) with `instgenie serve --cluster`, tiny model, CPU.

Each node has its own cache root (INSTGENIE_CACHE_ROOT in its environment) and its own fault
gate (INSTGENIE_FAULT_GATE): an edit with the "HOLD" prompt holds a node's loop while that
node's gate file exists, so a request can be kept in flight on one chosen node.
The tests run in file order and share one cluster and one server: serve on both nodes, route a
template's edits to the node holding its cache, refuse a peer without the Curve key, fail over
when a node leaves mid-request, give work to a node that joins, and shut down cleanly.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
import zmq  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from instgenie.cache.budgets import cache_namespace  # noqa: E402
from instgenie.cache.shm_segment import cleanup  # noqa: E402
from instgenie.curve import CurveKeys  # noqa: E402
from instgenie.messages import GetStats  # noqa: E402
from instgenie.wire import encode  # noqa: E402
from instgenie.worker.client import WorkerClient  # noqa: E402
from tests.server.test_harness import (  # noqa: E402
    FAULT_PROMPTS,
    ROOT,
    ServerProcess,
    decoded,
    edit_files,
    image_png,
)

#: GCS health checks fast enough that a removed node is declared dead within ~2 s
SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
}


class Nodes:
    """The local Ray cluster and each node's directory (cache root, gate file)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="igc-cluster-"))
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args=self.args("a") | {"_system_config": SYSTEM_CONFIG},
        )
        self.b = self.cluster.add_node(**self.args("b"))
        self.c = None

    def args(self, name: str) -> dict:
        (self.dir / name).mkdir(exist_ok=True)
        env = {
            "INSTGENIE_CACHE_ROOT": str(self.dir / name / "cache"),
            "INSTGENIE_FAULTS": ",".join(f"{k}={v}" for k, v in FAULT_PROMPTS.items()),
            "INSTGENIE_FAULT_GATE": str(self.gate(name)),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        }
        return {"num_cpus": 2, "object_store_memory": 80 << 20, "env_vars": env,
                "include_dashboard": False}  # fmt: skip

    def gate(self, name: str) -> Path:
        return self.dir / name / "gate"

    def shutdown(self) -> None:
        self.cluster.shutdown()
        # each node's DRAM tier outlives its workers by design (a restart reads it again); a
        # node removed mid-request left its entries: drop every node's, with its cache root
        for name in ("a", "b", "c"):
            cleanup(cache_namespace(str(self.dir / name / "cache")))
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes():
    n = Nodes()
    yield n
    n.shutdown()


@pytest.fixture(scope="module")
def srv(nodes: Nodes):
    s = ServerProcess(
        "--cluster",
        nodes.cluster.address,
        "--devices",
        "cpu",
        "--cluster-poll-s",
        "0.5",
        "--max-batch",
        "2",
    )
    yield s
    if s.proc.poll() is None:
        s.stop()


def up_workers(srv: ServerProcess) -> list[dict]:
    return [w for w in srv.health()[1]["workers"] if w["healthy"]]


def wait_workers(srv: ServerProcess, nodes: set[str] | int, timeout: float = 240.0) -> list[dict]:
    """Wait until healthy workers run on exactly `nodes` (ids), or on that many nodes."""
    deadline = time.monotonic() + timeout
    while True:
        ws = up_workers(srv)
        have = {w["node"] for w in ws}
        if (have == nodes) if isinstance(nodes, set) else (len(have) == nodes):
            return ws
        assert time.monotonic() < deadline, f"workers never on {nodes}: {srv.health()[1]}"
        time.sleep(0.25)


def edit(srv: ServerProcess, seed: int, prompt: str = "a hat", **data) -> dict:
    """An edit of `data`'s template_id, else of an uploaded image."""
    image = None if "template_id" in data else image_png(seed=1)
    r = srv.post("/v1/edits", files=edit_files(image),
                 data={"prompt": prompt, "seed": str(seed), **data})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_workers_on_both_nodes_serve_edits(nodes: Nodes, srv: ServerProcess) -> None:
    ws = wait_workers(srv, 2)
    assert len(ws) == 2 and all(w["node"] != "local" and w["node_ip"] for w in ws)
    assert all(w["address"].startswith("tcp://") for w in ws)
    body = srv.health()[1]
    assert sorted(len(n["workers"]) for n in body["nodes"]) == [1, 1]
    assert all(n["alive"] for n in body["nodes"])
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda s: edit(srv, s, num_inference_steps="8"), range(4)))
    assert {o["node"] for o in outs} == {w["node"] for w in ws}, "one node got no edit"
    # metrics carry the node
    node = outs[0]["node"]
    assert srv.metric("instgenie_worker_up", worker=str(outs[0]["worker"]), node=node) == 1


def test_template_edits_go_to_the_node_holding_its_cache(srv: ServerProcess) -> None:
    r = srv.post("/v1/templates", files={"image": ("t.png", image_png(seed=7), "image/png")},
                 data={"prompt": "a person", "seed": "3", "num_inference_steps": "2"})  # fmt: skip
    assert r.status_code == 202, r.text
    tid = r.json()["id"]
    deadline = time.monotonic() + 120
    while srv.get(f"/v1/templates/{tid}").json()["status"] != "ready":
        assert time.monotonic() < deadline, srv.get(f"/v1/templates/{tid}").json()
        time.sleep(0.2)
    outs = [edit(srv, s, template_id=tid) for s in range(4)]
    assert all((o["path"], o["cache"]) == ("masked", "hit") for o in outs), outs
    assert len({o["node"] for o in outs}) == 1, "a template's edits left the node holding it"


def test_a_peer_without_the_curve_key_gets_nothing(srv: ServerProcess) -> None:
    """A worker's socket, bound on the node's address, answers only the server's Curve client
    key: a stranger's keys and a plain (no curve) socket get no answer."""
    address = up_workers(srv)[0]["address"]
    with WorkerClient(address, curve=CurveKeys.generate().client_side()) as stranger:
        with pytest.raises(TimeoutError):
            stranger.stats(timeout=3.0)
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    try:
        plain.connect(address)
        plain.send(encode(GetStats()))
        assert plain.poll(3000) == 0, "a peer without curve got an answer"
    finally:
        plain.close()
    assert up_workers(srv)[0]["address"] == address  # the worker itself is unharmed


def test_node_leaving_mid_request_reruns_it_elsewhere(nodes: Nodes, srv: ServerProcess) -> None:
    b_node = nodes.b.node_id
    hold = FAULT_PROMPTS["hold"]
    reference = edit(srv, 11, prompt=hold, num_inference_steps="4")  # no gate yet: runs through
    # both nodes hold the edit: least-loaded sends one of two concurrent edits to each
    nodes.gate("a").touch()
    nodes.gate("b").touch()
    try:
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(edit, srv, 11, hold, num_inference_steps="4") for _ in range(2)]
            deadline = time.monotonic() + 120
            while not all(w["in_flight"] for w in srv.health()[1]["workers"]):
                assert time.monotonic() < deadline, f"not one edit per node: {srv.health()[1]}"
                time.sleep(0.1)
            # node a's edit finishes first (alone: batch composition may change float results
            # on CPU, so the re-run below runs alone too), then node b leaves mid-request
            nodes.gate("a").unlink()
            while any(w["in_flight"] for w in srv.health()[1]["workers"] if w["node"] != b_node):
                assert time.monotonic() < deadline, "node a's edit never finished"
                time.sleep(0.1)
            t0 = time.monotonic()
            nodes.cluster.remove_node(nodes.b)
            outs = [f.result(timeout=180) for f in futs]
    finally:
        nodes.gate("a").unlink(missing_ok=True)
    assert time.monotonic() - t0 < 120, "the failover hung"
    retried = [o for o in outs if o["retried"]]
    assert retried, outs
    assert all(o["node"] != b_node for o in outs)
    want = decoded(reference["image"]).tobytes()
    assert all(decoded(o["image"]).tobytes() == want for o in outs), "a re-run changed the image"
    ws = wait_workers(srv, 1)
    assert all(w["node"] != b_node for w in ws)
    assert srv.metric("instgenie_edit_retries_total") >= 1


def test_node_joining_later_gets_work(nodes: Nodes, srv: ServerProcess) -> None:
    nodes.c = nodes.cluster.add_node(**nodes.args("c"))
    c_node = nodes.c.node_id
    ws = wait_workers(srv, 2)
    assert c_node in {w["node"] for w in ws}
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda s: edit(srv, s, num_inference_steps="8"), range(4)))
    assert c_node in {o["node"] for o in outs}, "the node that joined got no edit"


def test_shutdown_leaves_no_actor_process_or_shared_memory(srv: ServerProcess) -> None:
    srv.health()  # every supervisor pid seen: stop() checks they and their shm are gone
    assert srv.stop() == 0, srv.log()[-3000:]
    deadline = time.monotonic() + 30
    while actor_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert actor_processes() == [], "worker actors outlived the server"


def actor_processes() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"WorkerActor" in cmd:
                out.append(int(d.name))
    return out
