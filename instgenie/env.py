"""Environment flags. The only place the package reads os.environ; every name has the INSTGENIE_
prefix."""

from __future__ import annotations

import os


def attention_backend() -> str:
    """INSTGENIE_ATTENTION_BACKEND: auto | triton | flash | sdpa (default auto)."""
    return os.environ.get("INSTGENIE_ATTENTION_BACKEND", "auto").strip().lower()


def unet_channels_last() -> bool:
    """INSTGENIE_UNET_CHANNELS_LAST: 1 puts UNets in NHWC on CUDA; 0 (default) keeps NCHW."""
    return os.environ.get("INSTGENIE_UNET_CHANNELS_LAST", "0").strip() in ("1", "true", "yes")
