"""Host-side helpers of the DRAM tier: process identity (owners of index references) and
page pinning of host memory for DMA."""

from __future__ import annotations

import ctypes
import errno
import mmap
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


# ---- page population ----------------------------------------------------------------------------
#: madvise advice: fault pages in writable, allocating them (Linux 5.14+)
MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def populate(addr: int, nbytes: int) -> bool:
    """Fault the pages under host bytes [addr, addr + nbytes) into this process, writable,
    allocating a shared-memory file's missing pages, without writing them and without any CUDA
    call (so it never holds the driver's lock: bench/pin_stall.py). Where a page cannot be
    allocated (a full /dev/shm) it raises OSError instead of the SIGBUS a write would get.
    Returns False where the kernel lacks the advice (before 5.14: nothing was done)."""
    start = addr // _PAGE * _PAGE
    length = -(-(addr + nbytes - start) // _PAGE) * _PAGE
    if _libc.madvise(start, length, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {length} bytes: {os.strerror(err)}")


# ---- pinning ------------------------------------------------------------------------------------
#: cudaHostRegister flags: portable (pinned for every CUDA context) | mapped (device-addressable)
_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2


def pin(t: torch.Tensor) -> bool:
    """On CUDA machines, register the tensor's host pages (e.g. a whole shm segment) as pinned
    and mapped: H2D copies from it then run as DMA at full PCIe bandwidth and can be
    asynchronous, and kernels can read it in place (`device_view`). A no-op returning False
    without CUDA. Unpin before the memory is unmapped. Costs about a second per 10 GB (every
    page is faulted in and locked): do it once per mapping, never per request."""
    flags = _REGISTER_PORTABLE | _REGISTER_MAPPED
    return _cudart("cudaHostRegister", t.data_ptr(), t.numel() * t.element_size(), flags)


class _DeviceArray:
    """A device pointer presented through __cuda_array_interface__ (torch wraps it, no copy)."""

    def __init__(self, ptr: int, nbytes: int, owner: torch.Tensor) -> None:
        self.owner = owner  # the host tensor whose pages the pointer maps: kept alive with it
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }  # fmt: skip


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over the pinned (pin()) host tensor `t`'s bytes: kernels on `device`
    read the host pages in place over PCIe (unified addressing: the device address of registered
    host memory is its host address on Linux x86-64, checked here on the first bytes). Valid
    while `t` stays pinned and mapped."""
    nbytes = t.numel() * t.element_size()
    with torch.cuda.device(device):
        view = torch.as_tensor(_DeviceArray(t.data_ptr(), nbytes, t), device=device)
    head = min(nbytes, 64)
    if head and not torch.equal(view[:head].cpu(), t.reshape(-1).view(torch.uint8)[:head]):
        raise RuntimeError("registered host memory is not addressable at its host address")
    return view


def unpin(t: torch.Tensor) -> bool:
    return _cudart("cudaHostUnregister", t.data_ptr())


def _cudart(fn: str, *args: int) -> bool:
    if not torch.cuda.is_available():
        return False
    rc = int(getattr(torch.cuda.cudart(), fn)(*args))
    if rc != 0:
        raise RuntimeError(f"{fn} failed with CUDA error {rc}")
    return True
