"""CurveZMQ keys: what a ZMQ socket bound beyond loopback authenticates and encrypts with.

One `CurveKeys` per cluster: a server keypair (every worker's ROUTER) and a client keypair (every
process that talks to workers). `server_side()` is what a binding process needs (its keypair and
the client public keys it accepts), `client_side()` what a connecting one needs (its keypair and
the server's public key). Keys are z85 text (40 characters, 32 bytes).

Invariants (RELIABILITY.md item 14):
- Keys are made in memory (`CurveKeys.generate`) by the process that starts a cluster and handed
  on in memory (to_dict/from_dict: Ray actor arguments, a worker supervisor's stdin pipe); never
  in argv (/proc/<pid>/cmdline is world-readable) nor in the environment.
- A key file (`instgenie keys generate`) is written atomically with mode 0600, and read only when
  it is a regular file owned by this user that no group or other user may read or write
  (`ValidationError("curve_keys", ...)` otherwise).
- Secret keys never appear in a repr (logs, tracebacks).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from instgenie.errors import ValidationError

KEY_CHARS = 40  # z85 text of a 32-byte curve25519 key
KEY_FILE_MODE = 0o600  # a key file's permissions: owner read/write, nobody else


def _key(name: str, value: Any) -> str:
    """`value` if it is a z85 curve key; else ValueError naming `name` (never the value)."""
    if not isinstance(value, str) or len(value) != KEY_CHARS:
        raise ValueError(f"{name} must be a {KEY_CHARS}-character z85 curve key")
    try:
        if len(z85.decode(value.encode("ascii"))) != 32:
            raise ValueError
    except (ValueError, UnicodeEncodeError, KeyError, IndexError):
        raise ValueError(f"{name} must be a {KEY_CHARS}-character z85 curve key") from None
    return value


def _pair(role: str, public: Any, secret: Any) -> None:
    """ValueError unless `secret` is the secret key of `public`."""
    _key(f"{role} public key", public)
    _key(f"{role} secret key", secret)
    if zmq.curve_public(secret.encode("ascii")).decode("ascii") != public:
        raise ValueError(f"the {role} secret key does not match its public key")


@dataclass(frozen=True)
class ServerCurve:
    """A bound socket's curve settings: its keypair and the client public keys it accepts."""

    public: str
    secret: str = field(repr=False)
    #: the only client public keys the socket's ZAP handler lets in (exact match)
    clients: tuple[str, ...]

    def __post_init__(self) -> None:
        _pair("server", self.public, self.secret)
        object.__setattr__(self, "clients", tuple(self.clients))
        if not self.clients:
            raise ValueError("a curve server needs at least one allowed client public key")
        for k in self.clients:
            _key("allowed client public key", k)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "server", "public": self.public, "secret": self.secret,
                "clients": list(self.clients)}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServerCurve:
        _kind(d, "server")
        return cls(public=d["public"], secret=d["secret"], clients=tuple(d["clients"]))


@dataclass(frozen=True)
class ClientCurve:
    """A connecting socket's curve settings: its keypair and the server's public key."""

    public: str
    secret: str = field(repr=False)
    server: str  # the public key the server must prove it holds the secret of

    def __post_init__(self) -> None:
        _pair("client", self.public, self.secret)
        _key("server public key", self.server)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "client", "public": self.public, "secret": self.secret,
                "server": self.server}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClientCurve:
        _kind(d, "client")
        return cls(public=d["public"], secret=d["secret"], server=d["server"])


def _kind(d: Any, kind: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"curve {kind} keys must be a JSON object")
    if d.get("kind") != kind:
        raise ValueError(f"expected curve {kind} keys, got kind {d.get('kind')!r}")
    missing = {"server": {"public", "secret", "clients"},
               "client": {"public", "secret", "server"}}[kind] - d.keys()  # fmt: skip
    if missing:
        raise ValueError(f"curve {kind} keys lack {sorted(missing)}")


@dataclass(frozen=True)
class CurveKeys:
    """A cluster's keys: the workers' (server) keypair and their clients' keypair."""

    server_public: str
    server_secret: str = field(repr=False)
    client_public: str
    client_secret: str = field(repr=False)

    def __post_init__(self) -> None:
        _pair("server", self.server_public, self.server_secret)
        _pair("client", self.client_public, self.client_secret)

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh keypairs, in memory only."""
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(server_public=sp.decode("ascii"), server_secret=ss.decode("ascii"),
                   client_public=cp.decode("ascii"), client_secret=cs.decode("ascii"))  # fmt: skip

    def server_side(self) -> ServerCurve:
        return ServerCurve(public=self.server_public, secret=self.server_secret,
                           clients=(self.client_public,))  # fmt: skip

    def client_side(self) -> ClientCurve:
        return ClientCurve(public=self.client_public, secret=self.client_secret,
                           server=self.server_public)  # fmt: skip

    def to_dict(self) -> dict[str, str]:
        return {
            "server_public": self.server_public,
            "server_secret": self.server_secret,
            "client_public": self.client_public,
            "client_secret": self.client_secret,
        }

    @classmethod
    def from_dict(cls, d: dict[str, str]) -> CurveKeys:
        return cls(**{k: d[k] for k in ("server_public", "server_secret", "client_public",
                                        "client_secret")})  # fmt: skip


# ---- key files ----------------------------------------------------------------------------------
def write_key_file(path: str | Path, keys: ServerCurve | ClientCurve) -> Path:
    """Write `keys` as JSON to `path`, mode 0600, atomically (a temporary file in the same
    directory, created 0600, fsynced, renamed over). An existing `path` is refused
    (ValidationError): keys are never overwritten by accident."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise ValidationError("output", f"{str(path)!r} exists; keys are never overwritten")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, KEY_FILE_MODE)
    except OSError as exc:
        raise ValidationError("output", f"cannot write {str(path)!r}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), KEY_FILE_MODE)  # whatever the umask
            json.dump(keys.to_dict(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _read_private(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`, checked on the open file (no race with a chmod or rename): a
    regular file owned by this user with no group/other permission bits."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ValidationError("curve_keys", f"cannot read {str(path)!r}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValidationError("curve_keys", f"{str(path)!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_uid != os.getuid():
            raise ValidationError("curve_keys", f"{str(path)!r} is not owned by this user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ValidationError(
                "curve_keys", f"{str(path)!r} has mode {stat.S_IMODE(st.st_mode):04o}; a key "
                f"file must be readable by its owner only (chmod 600)",
            )  # fmt: skip
        data = f.read(1 << 16)
    try:
        return json.loads(data)
    except ValueError:
        raise ValidationError("curve_keys", f"{str(path)!r} is not JSON") from None


def read_server_keys(path: str | Path) -> ServerCurve:
    """A worker's keys from a file of `instgenie keys generate` (ValidationError if unsafe or
    not server keys)."""
    try:
        return ServerCurve.from_dict(_read_private(path))
    except (ValueError, TypeError) as exc:
        raise ValidationError("curve_keys", f"{str(path)!r}: {exc}") from None


def read_client_keys(path: str | Path) -> ClientCurve:
    """A client's keys from the client file of `instgenie keys generate`."""
    try:
        return ClientCurve.from_dict(_read_private(path))
    except (ValueError, TypeError) as exc:
        raise ValidationError("curve_keys", f"{str(path)!r}: {exc}") from None
