"""Entry point of a worker's processes, light on imports: the parent-death signal is armed before
torch and diffusers load (seconds), so a process whose parent dies during its start-up never
outlives it.

    python -m instgenie.worker.lifeline supervisor '<json spec>'   # spawned by WorkerHandle
    python -m instgenie.worker.lifeline child '<json spec>'        # spawned by the supervisor

spec["parent"] is the spawner's pid: a process whose parent is already gone when the signal is
armed (reparented) exits at once. Secrets (a supervisor's curve keys, spec["curve_stdin"]) come
on stdin, never in this world-readable argv.

Linux delivers PR_SET_PDEATHSIG when the *thread* that spawned the process exits, not the
process: spawn workers from a thread that lives as long as they should (the main thread, or a
long-lived executor thread).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent (thread) exits (Linux; no-op elsewhere); exit now if
    `parent` is given and is no longer our parent."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent died before the signal was armed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("supervisor", "child"):
        raise SystemExit("usage: python -m instgenie.worker.lifeline supervisor|child '<json>'")
    spec = json.loads(argv[1])
    if argv[0] == "child" or spec.get("die_with_parent"):
        die_with_parent(spec.get("parent"))
    if argv[0] == "child":
        from instgenie.worker.child_runtime import main as child_main
    else:
        from instgenie.worker.supervisor import main as child_main
    return child_main([argv[1]])


if __name__ == "__main__":
    sys.exit(main())
