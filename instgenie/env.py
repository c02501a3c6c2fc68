"""Environment flags. The only place the package reads os.environ; every name has the INSTGENIE_
prefix, except the XDG base directory XDG_CACHE_HOME."""

from __future__ import annotations

import os


def attention_backend() -> str:
    """INSTGENIE_ATTENTION_BACKEND: auto | triton | flash | sdpa (default auto)."""
    return os.environ.get("INSTGENIE_ATTENTION_BACKEND", "auto").strip().lower()


def unet_channels_last() -> bool:
    """INSTGENIE_UNET_CHANNELS_LAST: 1 (default) puts UNets in NHWC (channels_last) on CUDA; 0
    keeps them NCHW (decision 0004)."""
    flag = os.environ.get("INSTGENIE_UNET_CHANNELS_LAST", "1").strip().lower()
    return flag not in ("0", "false", "no", "off")


def cuda_graphs() -> str:
    """INSTGENIE_CUDA_GRAPHS: all (default) | masked | off — which denoising steps replay
    CUDA graphs (engine/graphs.py)."""
    return os.environ.get("INSTGENIE_CUDA_GRAPHS", "all").strip().lower()


def graph_capture() -> str:
    """INSTGENIE_GRAPH_CAPTURE: auto (default: capture a composition's graph only when its
    measured costs say it pays before the batch changes) | always (every eligible composition on
    its second call) — engine/graphs.py."""
    return os.environ.get("INSTGENIE_GRAPH_CAPTURE", "auto").strip().lower()


def cudnn_benchmark() -> bool:
    """INSTGENIE_CUDNN_BENCHMARK: 1 lets cuDNN pick convolution algorithms by timing them
    (torch.backends.cudnn.benchmark) on CUDA; 0 (default) keeps its heuristics."""
    return os.environ.get("INSTGENIE_CUDNN_BENCHMARK", "0").strip() in ("1", "true", "yes")


def _kernel_mode(name: str) -> str:
    mode = os.environ.get(name, "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{name}={mode!r}: expected auto, on or off")
    return mode


def fused_group_norm() -> str:
    """INSTGENIE_FUSED_GROUPNORM: auto (default: the Triton GroupNorm+SiLU kernel on CUDA) | on
    (also elsewhere, e.g. CPU under TRITON_INTERPRET=1) | off (torch's ops, stock diffusers)."""
    return _kernel_mode("INSTGENIE_FUSED_GROUPNORM")


def fused_geglu() -> str:
    """INSTGENIE_FUSED_GEGLU: auto (default: GEGLU's gating as one Triton kernel on CUDA) | on
    (also elsewhere) | off (torch's chunk, gelu and mul: stock diffusers)."""
    return _kernel_mode("INSTGENIE_FUSED_GEGLU")


def fused_conv_bias() -> str:
    """INSTGENIE_FUSED_CONV_BIAS: auto (default: Conv2d biases added by a vectorised Triton
    kernel on CUDA) | on (also elsewhere) | off (torch's biased convolution: stock diffusers)."""
    return _kernel_mode("INSTGENIE_FUSED_CONV_BIAS")


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
