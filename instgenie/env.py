"""Environment flags. The only place the package reads os.environ; every name has the INSTGENIE_
prefix, except the XDG base directory XDG_CACHE_HOME. Nothing is read at import: each function
reads when called, and the execution settings only once, at start (`exec_environ`)."""

from __future__ import annotations

import dataclasses
import os


def exec_environ() -> dict[str, str]:
    """The INSTGENIE_* variables that override execution settings (the `env` of each
    config.ExecConfig field: INSTGENIE_ATTENTION_BACKEND, INSTGENIE_UNET_CHANNELS_LAST,
    INSTGENIE_CUDA_GRAPHS, INSTGENIE_GRAPH_CAPTURE, INSTGENIE_CUDNN_BENCHMARK,
    INSTGENIE_FUSED_GROUPNORM, INSTGENIE_FUSED_GEGLU, INSTGENIE_FUSED_CONV_BIAS), those set.
    Read once, when a command builds its config at start (config.dataclass_from_args); a flag
    given wins over them. Worker processes get the values in their config, never from here."""
    from instgenie.config import ExecConfig

    names = {f.metadata["env"] for f in dataclasses.fields(ExecConfig)}
    return {k: v for k, v in os.environ.items() if k in names}


def log_level() -> str:
    """INSTGENIE_LOG_LEVEL: logging level of worker processes (default WARNING)."""
    return os.environ.get("INSTGENIE_LOG_LEVEL", "WARNING").strip().upper()


def faults() -> dict[str, str]:
    """INSTGENIE_FAULTS: "kind=prompt,..." fault injection for reliability tests (faults.py);
    unset or empty: none."""
    spec = os.environ.get("INSTGENIE_FAULTS", "").strip()
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, prompt = item.partition("=")
        out[kind.strip()] = prompt
    return out


def fault_gate() -> str:
    """INSTGENIE_FAULT_GATE: a file path; the "hold" and "slowenc" faults hold the loop while it
    exists."""
    return os.environ.get("INSTGENIE_FAULT_GATE", "")


def cache_root() -> str | None:
    """INSTGENIE_CACHE_ROOT: the host activation cache's root where --cache-root is "auto" (the
    default; cache/budgets.py); set and empty = no host cache (templates in the loop's device
    memory); None when unset."""
    return os.environ.get("INSTGENIE_CACHE_ROOT")


def xdg_cache_home() -> str:
    """XDG_CACHE_HOME: the user's cache directory (XDG base directories), "" when unset."""
    return os.environ.get("XDG_CACHE_HOME", "").strip()
