"""Why a cache read missed (the caller recomputes), and the one accepted key form."""

from __future__ import annotations

import errno
import re
from typing import Any

_KEY = re.compile(r"[0-9a-f]{64}")


class CacheMiss(Exception):
    """The entry is not available: the caller recomputes it."""


class CorruptEntry(CacheMiss):
    """The entry failed verification (or could not be read) and was quarantined."""


class StaleFormat(CacheMiss):
    """The entry was written in an older disk format: removed (counted), never misread; the
    template is captured again."""


class StreamCorrupt(CorruptEntry):
    """A step of an entry streamed from disk failed verification after the edit started: the
    entry was quarantined and the edit reading it cannot finish (it fails with this error)."""


class DiskBusy(CacheMiss):
    """The entry could not be opened now (the process is out of file descriptors or memory):
    a miss for this request, the entry itself is kept."""


#: open() errors that say nothing about the file: never a reason to quarantine it
_TRANSIENT = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS}
)


def check_key(key: Any) -> str:
    """Keys are sha256 hex digests; anything else (paths, NUL, unicode, ...) is refused."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"cache key must be 64 lowercase hex characters, got {key!r:.80}")
    return key
