"""Output files of the commands (`instgenie edit`, `profile`, `client edit`): checked before
any work is done, written whole or not at all.

`PendingOutput(path)` refuses a directory, a parent directory that does not exist (it makes none:
a typo in a path must not silently grow a tree) or a parent that is not a directory
(ValidationError on field "output"), and opens a temporary file next to the target, so an
unusable path fails before the model runs; `commit(data)` writes, fsyncs and renames it over the
target. Leaving the `with` block without a commit (an error, Ctrl-C) removes the temporary file:
a failed command leaves no partial file, and an older file at the path stays as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from instgenie.errors import ValidationError

#: output file suffix -> image format, when no format is named ("" -> png)
SUFFIX_FORMATS = {"": "png", ".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def output_format(path: Path, explicit: str | None) -> str:
    """The image format of an output: the one named, else the one its suffix names."""
    if explicit is not None:
        return explicit
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValidationError(
            "output",
            f"{path.suffix!r} is not an image file suffix: use .png, .jpg, .jpeg or .webp, "
            "or name the format with --format",
        )
    return fmt


class PendingOutput:
    """An output file being prepared (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._tmp: str | None = None

    def __enter__(self) -> PendingOutput:
        try:
            self._prepare()
        except BaseException:
            self.discard()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.discard()

    def _prepare(self) -> None:
        out = self.path
        try:
            if out.is_dir():
                raise ValidationError("output", f"{str(out)!r} is a directory")
            parent = out.parent
            if not os.path.lexists(parent):
                missing = parent
                while not os.path.lexists(missing.parent):
                    missing = missing.parent
                if missing.parent.is_dir():  # else: a file on the way, refused below
                    raise ValidationError(
                        "output",
                        f"cannot write {str(out)!r}: directory {str(parent)!r} does not exist "
                        "(create it first)",
                    )
                parent = missing.parent
            if not parent.is_dir():
                raise ValidationError(
                    "output", f"cannot write {str(out)!r}: {str(parent)!r} is not a directory"
                )
            self._fd, self._tmp = tempfile.mkstemp(
                dir=out.parent, prefix=f".{out.name}.", suffix=".part"
            )
        except OSError as exc:
            raise ValidationError(
                "output", f"cannot write {str(out)!r}: {exc.strerror or exc}"
            ) from None

    def commit(self, data: bytes) -> None:
        assert self._fd is not None and self._tmp is not None
        fd, self._fd = self._fd, None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                umask = os.umask(0o022)
                os.umask(umask)
                os.fchmod(f.fileno(), 0o666 & ~umask)  # as a plain open() would (mkstemp: 0600)
            os.replace(self._tmp, self.path)
        except OSError as exc:
            raise ValidationError(
                "output", f"cannot write {str(self.path)!r}: {exc.strerror or exc}"
            ) from None
        self._tmp = None
        try:  # make the rename durable; best effort
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def discard(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            self._tmp = None
