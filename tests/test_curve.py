"""CurveKeys: generated in memory, split into server/client views, secrets kept out of reprs; key
files written 0600 atomically and read only when private to this user."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from instgenie.curve import (
    ClientCurve,
    CurveKeys,
    ServerCurve,
    read_client_keys,
    read_server_keys,
    write_key_file,
)
from instgenie.errors import ValidationError


def test_keys_views_and_round_trips() -> None:
    keys = CurveKeys.generate()
    assert keys != CurveKeys.generate()
    server, client = keys.server_side(), keys.client_side()
    assert (server.public, server.secret, server.clients) == (
        keys.server_public, keys.server_secret, (keys.client_public,))  # fmt: skip
    assert (client.public, client.secret, client.server) == (
        keys.client_public, keys.client_secret, keys.server_public)  # fmt: skip
    assert CurveKeys.from_dict(json.loads(json.dumps(keys.to_dict()))) == keys
    assert ServerCurve.from_dict(server.to_dict()) == server
    assert ClientCurve.from_dict(client.to_dict()) == client
    for secret in (keys.server_secret, keys.client_secret):
        assert secret not in repr(keys) + repr(server) + repr(client) + str(keys)


def test_invalid_keys_are_refused_without_echoing_them() -> None:
    keys, other = CurveKeys.generate(), CurveKeys.generate()
    with pytest.raises(ValueError, match="does not match"):
        CurveKeys(server_public=keys.server_public, server_secret=other.server_secret,
                  client_public=keys.client_public, client_secret=keys.client_secret)  # fmt: skip
    with pytest.raises(ValueError, match="40-character z85") as e:
        ClientCurve(public=keys.client_public, secret="x" * 39, server=keys.server_public)
    assert "x" * 39 not in str(e.value)
    with pytest.raises(ValueError, match="at least one allowed client"):
        ServerCurve(public=keys.server_public, secret=keys.server_secret, clients=())
    with pytest.raises(ValueError, match="expected curve server keys"):
        ServerCurve.from_dict(keys.client_side().to_dict())


def test_key_files_are_written_private_and_atomically(tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    old = os.umask(0o000)  # the most permissive umask: the file is 0600 anyway
    try:
        path = write_key_file(tmp_path / "worker.json", keys.server_side())
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["worker.json"]  # no temporary left
    assert read_server_keys(path) == keys.server_side()
    with pytest.raises(ValidationError, match="never overwritten"):
        write_key_file(path, CurveKeys.generate().server_side())
    assert read_server_keys(path) == keys.server_side()
    with pytest.raises(ValidationError) as e:  # a server file is not a client file
        read_client_keys(path)
    assert e.value.field == "curve_keys"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666])
def test_key_files_readable_by_others_are_refused(tmp_path: Path, mode: int) -> None:
    path = write_key_file(tmp_path / "client.json", CurveKeys.generate().client_side())
    path.chmod(mode)
    with pytest.raises(ValidationError, match="chmod 600") as e:
        read_client_keys(path)
    assert e.value.field == "curve_keys"
    path.chmod(0o400)  # tighter than 0600 is fine
    assert read_client_keys(path).public


def test_key_files_of_another_user_are_refused(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "worker.json", CurveKeys.generate().server_side())
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(path, 65534, 65534)
    with pytest.raises(ValidationError, match="not owned by this user"):
        read_server_keys(path)


def test_key_files_must_be_regular_json_files(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not a regular file"):
        read_server_keys(tmp_path)
    with pytest.raises(ValidationError, match="cannot read"):
        read_server_keys(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    bad.chmod(0o600)
    with pytest.raises(ValidationError, match="not JSON"):
        read_server_keys(bad)
