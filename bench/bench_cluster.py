"""GPU benchmark: cluster mode on one machine with N GPUs run as N Ray nodes (one GPU, its own
cache root and DRAM tier each), one `instgenie serve --cluster` per routing policy under the same
open-loop Poisson traffic from `instgenie loadtest`. Not a test. Results:
docs/benchmarks/cluster-*.md (with the simulator's prediction, bench/report_cluster.py).

    python bench/bench_cluster.py --out out/cluster --gpus 2 --templates 4 --rate 0.8 \
        --requests 60 --dram-bytes 20GiB --policies cache-aware mask-aware least-loaded

Every policy starts from empty caches (each node's cache root is wiped), so each run pays the
same registrations and its own misses. The disk tier is off (--cache-disk-bytes 0): a template
evicted from a node's DRAM is gone from it (captured again on a miss).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[1]
_SERVING = re.compile(r"serving \S+ on (http://\S+) with")


def start_cluster(nodes: int, base: Path, gpu: bool) -> Cluster:
    """`nodes` Ray nodes on this machine; on GPU node i sees only GPU i (CUDA_VISIBLE_DEVICES),
    and every node has its own cache root."""
    env_common = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}

    def node(i: int) -> dict:
        env = env_common | {"INSTGENIE_CACHE_ROOT": str(base / f"node{i}")}
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        return {"num_cpus": 4, "num_gpus": 1 if gpu else 0, "env_vars": env}

    cluster = Cluster(initialize_head=True, head_node_args=node(0) | {"include_dashboard": False})
    for i in range(1, nodes):
        cluster.add_node(**node(i))
    return cluster


def wait_url(proc: subprocess.Popen, log: Path, timeout: float = 900) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _SERVING.search(log.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    raise SystemExit("server did not start")


def wait_workers(url: str, n: int, timeout: float = 900) -> None:
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())
            if sum(w["healthy"] for w in body["workers"]) >= n:
                return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{n} workers never healthy")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/cluster")
    ap.add_argument("--gpus", type=int, default=2, help="nodes, one GPU each")
    ap.add_argument("--devices", default="cuda", help="cuda, or cpu (a dry run, tiny model)")
    ap.add_argument("--model", default="sdxl-inpaint:full")
    ap.add_argument("--profile", default="profiles/sdxl-inpaint-full-h200.json")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--templates", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--dram-bytes", default="20GiB")
    ap.add_argument("--mask-ratios", default="hist:traces/mask_ratios_mean019.json")
    ap.add_argument("--slo-ms", type=float, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0,
                    help="edits sent one at a time before the measured phase (loadtest "
                    "--warmup): each worker's cold start out of it")  # fmt: skip
    ap.add_argument("--policies", nargs="+",
                    default=["cache-aware", "mask-aware", "least-loaded"])  # fmt: skip
    ap.add_argument("--cache-base", default="/tmp/igc-bench")
    ap.add_argument("--serve-args", default="", help="extra `serve` flags")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.cache_base)
    cluster = start_cluster(args.gpus, base, args.devices != "cpu")
    try:
        for policy in args.policies:
            shutil.rmtree(base, ignore_errors=True)
            for i in range(args.gpus):
                (base / f"node{i}").mkdir(parents=True)
            log = out / f"server-{policy}.log"
            cmd = [sys.executable, "-m", "instgenie.server", "serve", "--cluster",
                   cluster.address, "--devices", args.devices, "--model", args.model,
                   "--port", "0", "--cache-gpu-bytes", "0",
                   "--routing", policy, "--default-steps", str(args.steps),
                   "--cache-dram-bytes", args.dram_bytes, "--cache-disk-bytes", "0",
                   "--state-db", "none",
                   "--step-log", str((out / f"steps-{policy}.jsonl").resolve())]  # fmt: skip
            if args.profile:
                cmd += ["--profile", args.profile]
            cmd += args.serve_args.split()
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
            try:
                url = wait_url(proc, log)
                wait_workers(url, args.gpus)
                lt = [sys.executable, "-m", "instgenie.cli", "loadtest", "--server", url,
                      "--size", str(args.size), "--steps", str(args.steps),
                      "--templates", str(args.templates), "--rate", str(args.rate),
                      "--requests", str(args.requests), "--mask-ratios", args.mask_ratios,
                      "--slo-ms", str(args.slo_ms), "--seed", str(args.seed),
                      "--warmup", str(args.warmup),
                      "--out", str(out / f"{policy}.json")]  # fmt: skip
                t0 = time.monotonic()
                rc = subprocess.call(lt, cwd=ROOT)
                print(f"{policy}: loadtest rc={rc} in {time.monotonic() - t0:.0f} s", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
