"""The host cache's defaults derived from the machine: its root and the DRAM and disk tiers'
budgets (WorkerConfig.cache_root = "auto", cache_dram_bytes / cache_disk_bytes = -1).

`resolve_cache` turns a WorkerConfig with "auto" values into one with concrete values, and says
how each was derived (`CacheDefaults`). `instgenie serve` resolves once, before any worker starts,
so every worker, the start-up log line and /health show the same values; a Supervisor resolves a
config that reaches it unresolved (`instgenie worker`, an in-process start_worker). A resolved
config resolves to itself without probing anything.

Every fact about the machine comes from a probe of `Machine` (tests pass fakes); this module
imports no torch.

- root: $INSTGENIE_CACHE_ROOT when set ("" there = no host cache), else
  $XDG_CACHE_HOME/instgenie/activations, else ~/.cache/instgenie/activations. An auto root that
  cannot be created or written falls back to no host cache (said in the sources), never to a
  failed start.
- DRAM: DRAM_SHARE of (MemAvailable + the bytes this root's DRAM segments already hold), capped
  by the shared-memory filesystem the segments live in (shm_segment.SHM_DIR): its free space plus
  those segments, less a reserve for the workers' request tensors (tensorshm.py) and others.
- disk: DISK_SHARE of (the free space of the root's filesystem + the bytes already under the
  root), measured at the root's nearest existing directory.
What the cache already holds is added back so that a restart on a full cache derives the same
budget as the start that filled it (its segments are not MemAvailable, its files not free).
Budgets are rounded down to MiB.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from instgenie import env
from instgenie.config import AUTO_BYTES, AUTO_ROOT, WorkerConfig

MIB = 1 << 20
GIB = 1 << 30
#: share of the host's available memory (MemAvailable + this cache's segments) the DRAM tier may
#: use, fraction
DRAM_SHARE = 0.5
#: bytes of the shared-memory filesystem left free: the smaller of this ...
SHM_RESERVE_BYTES = 1 << 30
#: ... and this share of the filesystem's size (a container's 64 MiB /dev/shm keeps 16 MiB)
SHM_RESERVE_SHARE = 0.25
#: DRAM budget where the host's memory cannot be read (no /proc/meminfo), bytes; still capped
#: by the shared-memory filesystem
DRAM_FALLBACK_BYTES = 8 << 30
#: share of the cache root filesystem's space (free + this cache's files) the disk tier may
#: use, fraction
DISK_SHARE = 0.5
#: the least DRAM budget, bytes (WorkerConfig needs >= 1; templates larger go to the disk tier)
DRAM_MIN_BYTES = MIB
#: where the shared-memory segments of the DRAM tier live (cache/shm_segment.py: SharedMemory names)
SHM_DIR = "/dev/shm"


# ---- probes ------------------------------------------------------------------------------------
def read_meminfo() -> str:
    """/proc/meminfo's text; "" where there is none."""
    try:
        return Path("/proc/meminfo").read_text()
    except OSError:
        return ""


def tree_bytes(path: str) -> int:
    """Bytes allocated to the regular files under `path` (st_blocks), 0 where it does not exist."""
    total = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue
    return total


def segments_bytes(shm_dir: str, prefix: str) -> int:
    """Bytes allocated to the files in `shm_dir` whose name starts with `prefix`."""
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return 0
    total = 0
    for e in entries:
        if e.name.startswith(prefix):
            try:
                total += e.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue
    return total


def make_writable(path: str) -> str:
    """Create directory `path` (and its parents); "" when it is a writable directory, else why
    not."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return "not writable"
    return ""


def disk_usage(path: str) -> tuple[int, int]:
    """(total, free) bytes of the filesystem that holds `path`, or would hold it (measured at
    its nearest existing ancestor); OSError where it cannot be read."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    usage = shutil.disk_usage(p)
    return usage.total, usage.free


@dataclass(frozen=True)
class Machine:
    """The probes the defaults are derived from (tests replace them)."""

    #: $INSTGENIE_CACHE_ROOT, None when unset
    env_root: Callable[[], str | None] = env.cache_root
    #: $XDG_CACHE_HOME, "" when unset
    xdg_cache_home: Callable[[], str] = env.xdg_cache_home
    #: the user's home directory
    home: Callable[[], str] = field(default=lambda: os.path.expanduser("~"))
    #: text of /proc/meminfo ("" where there is none)
    meminfo: Callable[[], str] = read_meminfo
    #: (total, free) bytes of the filesystem that holds (or would hold) a path; OSError if
    #: unreadable
    disk_usage: Callable[[str], tuple[int, int]] = disk_usage
    #: bytes allocated under a directory (0 where it does not exist)
    tree_bytes: Callable[[str], int] = tree_bytes
    #: bytes allocated to the segments in a directory whose names start with a prefix
    segments_bytes: Callable[[str, str], int] = segments_bytes
    #: create a directory; "" if it is writable, else why not
    make_writable: Callable[[str], str] = make_writable
    #: the directory of the DRAM tier's shared-memory segments
    shm_dir: str = SHM_DIR


# ---- the result --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    #: the tier's budget, bytes; None: the tier is not used (no host cache)
    nbytes: int | None
    #: how it was derived: "flag" (given), "auto: ..." (from the machine), or why there is none
    source: str
    #: what the budget is a share of, for people: e.g. "of 125.6 GiB RAM" ("" when unknown)
    context: str = ""

    def to_dict(self) -> dict:
        return {"budget_bytes": self.nbytes, "source": self.source}


@dataclass(frozen=True)
class CacheDefaults:
    """A resolved host cache: its root ("" = templates in each loop's device memory) and its
    tiers' budgets, each with how it was derived."""

    root: str
    root_source: str
    dram: Budget
    disk: Budget

    def to_dict(self) -> dict:
        """/health's "cache" object without its "gpu" tier (server/health.py adds it)."""
        root = os.path.abspath(self.root) if self.root else None
        return {"root": root, "root_source": self.root_source,
                "tiers": {"dram": self.dram.to_dict(), "disk": self.disk.to_dict()}}  # fmt: skip

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.root:
            return (f"templates cached in each worker's device memory ({self.root_source}): "
                    "lost, and re-captured, when a worker restarts")  # fmt: skip
        parts = []
        for name, b in (("DRAM", self.dram), ("disk", self.disk)):
            if not b.nbytes:
                parts.append(f"{name} off ({b.source})")
            else:
                of = f" {b.context}" if b.context else ""
                parts.append(f"{name} {human_bytes(b.nbytes)}{of} ({b.source})")
        return (f"activation cache in {os.path.abspath(self.root)} ({self.root_source}): "
                + ", ".join(parts))  # fmt: skip


def human_bytes(n: float) -> str:
    """1.5 GiB, 512 MiB, 12 KiB, 0 B (binary units, 3 significant digits)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


# ---- derivation --------------------------------------------------------------------------------
def cache_namespace(root: str) -> str:
    """The host cache namespace of a cache root (its DRAM segments are `igc_<namespace>_*`)."""
    return hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:12]


def is_resolved(w: WorkerConfig) -> bool:
    return w.cache_root != AUTO_ROOT and (
        not w.cache_root or AUTO_BYTES not in (w.cache_dram_bytes, w.cache_disk_bytes)
    )


def resolve_cache(
    w: WorkerConfig, machine: Machine | None = None
) -> tuple[WorkerConfig, CacheDefaults]:
    """`w` with its auto cache settings replaced by values derived from the machine, and how
    each setting was derived."""
    m = machine or Machine()
    root, root_source = _root(w.cache_root, m)
    if not root:
        none = Budget(None, "no host cache")
        return dataclasses.replace(w, cache_root=""), CacheDefaults("", root_source, none, none)
    held_shm = m.segments_bytes(m.shm_dir, f"igc_{cache_namespace(root)}_")
    dram = _dram(w.cache_dram_bytes, m, held_shm)
    disk = _disk(w.cache_disk_bytes, root, m)
    resolved = dataclasses.replace(w, cache_root=root, cache_dram_bytes=dram.nbytes,
                                   cache_disk_bytes=disk.nbytes)  # fmt: skip
    return resolved, CacheDefaults(root, root_source, dram, disk)


def _root(value: str, m: Machine) -> tuple[str, str]:
    if value != AUTO_ROOT:
        return value, "flag" if value else 'flag: --cache-root ""'
    env_root = m.env_root()
    if env_root is not None:
        if not env_root:
            return "", "INSTGENIE_CACHE_ROOT is empty"
        return env_root, "INSTGENIE_CACHE_ROOT"
    xdg = m.xdg_cache_home()
    if xdg and os.path.isabs(xdg):  # the XDG spec ignores a relative value
        root, where = os.path.join(xdg, "instgenie", "activations"), "$XDG_CACHE_HOME"
    else:
        root, where = os.path.join(m.home(), ".cache", "instgenie", "activations"), "~/.cache"
    why = m.make_writable(root)
    if why:
        return "", f"auto: {root} cannot be used ({why}): no host cache"
    return root, f"auto: {where}/instgenie/activations"


def _meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as {name: bytes} (its values are kB = KiB)."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            out[name.strip()] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return out


def _floor_mib(n: float) -> int:
    return int(n) // MIB * MIB


def _dram(value: int, m: Machine, held: int) -> Budget:
    info = _meminfo(m.meminfo())
    total = info.get("MemTotal", 0)
    context = f"of {human_bytes(total)} RAM" if total else ""
    if value != AUTO_BYTES:
        return Budget(value, "flag", context)
    if "MemAvailable" in info:
        budget = DRAM_SHARE * (info["MemAvailable"] + held)
        source = f"auto: {DRAM_SHARE:.0%} of MemAvailable"
    else:
        budget, source = DRAM_FALLBACK_BYTES, "auto: fixed, no MemAvailable in /proc/meminfo"
    try:
        shm_total, shm_free = m.disk_usage(m.shm_dir)
    except OSError:
        shm_total = 0  # no such filesystem here: no cap
    if shm_total:
        reserve = min(SHM_RESERVE_BYTES, SHM_RESERVE_SHARE * shm_total)
        cap = shm_free + held - reserve
        if cap < budget:
            budget = cap
            source = (f"auto: free space of {m.shm_dir} ({human_bytes(shm_free + held)}) "
                      f"less a {human_bytes(reserve)} reserve")  # fmt: skip
    if budget < DRAM_MIN_BYTES:
        return Budget(DRAM_MIN_BYTES, f"{source}: under the minimum, {human_bytes(DRAM_MIN_BYTES)}",
                      context)  # fmt: skip
    return Budget(_floor_mib(budget), source, context)


def _disk(value: int, root: str, m: Machine) -> Budget:
    try:
        _, free = m.disk_usage(root)
    except OSError as exc:
        free = None
        why = f"{type(exc).__name__}: {exc.strerror or exc}"
    context = f"of {human_bytes(free)} free" if free is not None else ""
    if value != AUTO_BYTES:
        return Budget(value, "flag" if value else "flag: 0 = no disk tier", context)
    if free is None:
        return Budget(0, f"auto: the free space under {root} cannot be read ({why}): no disk tier")
    held = m.tree_bytes(root)
    budget = _floor_mib(DISK_SHARE * (free + held))
    source = f"auto: {DISK_SHARE:.0%} of the free space on its filesystem"
    if held:
        source += f" (+ the {human_bytes(held)} the cache holds)"
    return Budget(budget, source if budget else f"{source}: none left, no disk tier", context)
