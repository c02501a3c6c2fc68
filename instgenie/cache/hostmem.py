"""Host-side helpers of the DRAM tier: process identity (owners of index references) and
page pinning of host memory for DMA."""

from __future__ import annotations

import os
from pathlib import Path

import torch


# ---- process identity --------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) from /proc, None where unavailable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # comm may contain spaces and ')'
    return fields[0], fields[19]


def owner_id(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    st = _proc_stat(pid)
    return f"{pid}:{st[1] if st else 0}"


def owner_alive(owner: str) -> bool:
    try:
        pid_s, start = owner.split(":")
        pid = int(pid_s)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (ValueError, OverflowError):
        return False  # malformed owner (a damaged index)
    st = _proc_stat(pid)
    if st is None:
        return True
    return st[0] not in ("Z", "X") and (start == "0" or st[1] == start)


# ---- pinning ------------------------------------------------------------------------------------
def pin(t: torch.Tensor) -> bool:
    """On CUDA machines, register the tensor's host pages (e.g. a whole shm segment) as pinned:
    H2D copies from it then run as DMA at full PCIe bandwidth and can be asynchronous, with no
    staging copy. A no-op returning False without CUDA. Unpin before the memory is unmapped."""
    return _cudart("cudaHostRegister", t.data_ptr(), t.numel() * t.element_size(), 0)


def unpin(t: torch.Tensor) -> bool:
    return _cudart("cudaHostUnregister", t.data_ptr())


def _cudart(fn: str, *args: int) -> bool:
    if not torch.cuda.is_available():
        return False
    rc = int(getattr(torch.cuda.cudart(), fn)(*args))
    if rc != 0:
        raise RuntimeError(f"{fn} failed with CUDA error {rc}")
    return True
