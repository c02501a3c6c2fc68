"""Logging setup of the package's processes (CLI, worker supervisor and children)."""

from __future__ import annotations

import logging

from instgenie.env import log_level


def quiet_libraries() -> None:
    """diffusers/transformers log advisory warnings (torchvision absent, dtype casts) on every
    import; our processes print only their own results and errors."""
    import diffusers
    import transformers

    transformers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.set_verbosity_error()


def setup_process(tag: str) -> None:
    """Log lines `time tag[pid] LEVEL message` at INSTGENIE_LOG_LEVEL, to stderr."""
    logging.basicConfig(
        level=log_level(),
        format=f"%(asctime)s {tag}[%(process)d] %(levelname)s %(message)s",
    )
