"""Templates and async jobs survive a restart (server/state_db.py): the SQLite file itself
(schema version, WAL, reopen, refusals), the job table over it (commit before visible, TTL,
interrupted jobs), and a real `instgenie serve` stopped with SIGTERM and started again on the
same cache root: the template is back and ready, its edits take the masked path from the cache
that survived, the job's result is there, and DELETE removes the cache from shared memory, the
host index and the state file."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import sqlite3
import time
from pathlib import Path

import pytest

from instgenie.messages import RegisterTemplate
from instgenie.server.jobs import JobTable
from instgenie.server.state_db import (
    MIGRATIONS,
    SCHEMA_VERSION,
    JobState,
    StateDB,
    StateDBError,
    StoredJob,
    StoredTemplate,
)
from tests.server.test_harness import ServerProcess, edit_files, image_png

TID = "ab" * 32


def _template(tid: str = TID, mask: bytes | None = None) -> StoredTemplate:
    msg = RegisterTemplate(template_id=tid, image=b"\x89PNG-bytes\x00", prompt="a shirt",
                           seed=3, num_inference_steps=2, mask=mask)  # fmt: skip
    return StoredTemplate(msg, 64, 48, 1700000000.5)


# ---- the database ------------------------------------------------------------------------------
def test_state_db_is_versioned_wal_and_reopens_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "state" / "server.sqlite3"
    with StateDB(path) as db:
        assert db.version == SCHEMA_VERSION and db.journal_mode == "wal"
        db.put_template(_template())
        db.put_template(_template("cd" * 32, mask=b"mask-bytes"))
        job = StoredJob(
            "job_1", JobState.DONE, 10.0, 12.5, 2, 2, {"id": "e", "image": "AAAA"}, None
        )
        db.put_job(job)
        db.put_job(StoredJob("job_2", JobState.RUNNING, 11.0, None, 1, 2, None, None))
        assert Path(f"{path}-wal").exists()  # committed into the write-ahead log
    with StateDB(path) as db:  # a new process would see the same
        assert db.load_templates() == [_template(), _template("cd" * 32, mask=b"mask-bytes")]
        jobs = db.load_jobs()
        assert jobs[0] == job and jobs[1].status == "running"
        assert db.fail_unfinished(20.0, {"code": "interrupted", "message": "m"}) == 1
        assert db.load_jobs()[1].error == {"code": "interrupted", "message": "m"}
        db.delete_template(TID)
        db.delete_jobs(["job_1", "job_2"])
        assert [t.msg.template_id for t in db.load_templates()] == ["cd" * 32]
        assert db.load_jobs() == []
    raw = sqlite3.connect(path)  # a plain SQLite file: synchronous=FULL is per connection
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()


def test_a_failed_commit_leaves_no_transaction_open(tmp_path: Path) -> None:
    """A COMMIT that fails (here a deferred foreign key; in service a full disk) raises the typed
    error and ends its transaction: the next write begins and commits."""
    with StateDB(tmp_path / "s.sqlite3") as db:
        db._conn.execute("PRAGMA foreign_keys = ON")
        with db._txn() as c:
            c.execute("CREATE TABLE p (id INTEGER PRIMARY KEY)")
            c.execute(
                "CREATE TABLE ch (pid INTEGER REFERENCES p (id) DEFERRABLE INITIALLY DEFERRED)"
            )
        with pytest.raises(StateDBError, match="FOREIGN KEY"), db._txn() as c:
            c.execute("INSERT INTO ch VALUES (5)")  # accepted now, refused at COMMIT
        assert not db._conn.in_transaction
        db.put_job(StoredJob("job_1", JobState.DONE, 10.0, 12.5, 2, 2, None, None))
        assert [j.id for j in db.load_jobs()] == ["job_1"]


def test_state_db_refuses_a_newer_schema_a_non_database_and_a_second_server(
    tmp_path: Path,
) -> None:
    newer = tmp_path / "newer.sqlite3"
    raw = sqlite3.connect(newer)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(StateDBError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        StateDB(newer)

    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StateDBError, match="not a usable database"):
        StateDB(garbage)

    with StateDB(tmp_path / "one.sqlite3"):
        with pytest.raises(StateDBError, match="in use by another running server"):
            StateDB(tmp_path / "one.sqlite3")
    StateDB(tmp_path / "one.sqlite3").close()  # released on close

    old = tmp_path / "old.sqlite3"  # version 0 (e.g. created empty): migrated on open
    sqlite3.connect(old).close()
    with StateDB(old) as db:
        assert db.version == SCHEMA_VERSION and db.load_jobs() == []


def test_a_version_1_file_migrates_and_templates_keep_their_loras(tmp_path: Path) -> None:
    """Version 2 added templates.loras: a version-1 file (rows without it) opens migrated, its
    templates with no LoRAs; a template's LoRAs are written and read back in order."""
    path = tmp_path / "v1.sqlite3"
    raw = sqlite3.connect(path)
    for sql in MIGRATIONS[1]:
        raw.execute(sql)
    m = _template().msg
    raw.execute(
        "INSERT INTO templates VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (m.template_id, m.image, None, m.prompt, None, m.seed, m.num_inference_steps, None,
         m.strength, 64, 48, 1700000000.5),
    )  # fmt: skip
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()
    assert SCHEMA_VERSION == 2
    loras = [("ee" * 32, 0.5), ("11" * 32, -2.0)]
    msg = dataclasses.replace(m, template_id="cd" * 32, loras=loras)
    with_loras = dataclasses.replace(_template("cd" * 32), created=1700000001.0, msg=msg)
    with StateDB(path) as db:
        assert db.version == 2
        assert db.load_templates() == [_template()]  # loras [] from the column's default
        db.put_template(with_loras)
    with StateDB(path) as db:
        assert db.load_templates() == [_template(), with_loras]
        assert db.load_templates()[1].msg.loras == loras
    raw = sqlite3.connect(path)
    rows = dict(raw.execute("SELECT id, loras FROM templates").fetchall())
    raw.close()
    assert rows == {TID: "", "cd" * 32: json.dumps([["ee" * 32, 0.5], ["11" * 32, -2.0]])}


# ---- the job table over it ---------------------------------------------------------------------
def test_jobs_commit_their_end_before_it_is_visible_and_reload_after_a_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "server.sqlite3"

    async def first_run() -> tuple[str, str, str]:
        with StateDB(path) as db:
            table = JobTable(8, 600.0, 2, db)
            done, running, expired = table.new(), table.new(), table.new()
            for job in (done, running, expired):
                job.push("queued", {"position": 0})
                await table.save(job)
            running.push("running", {})
            end = table.finish(
                done, JobState.DONE, result={"id": "e1", "image": "QUJD", "path": "masked"}
            )
            assert done.status == "queued" and done.result is None  # not before the commit
            await end
            assert done.status == "done" and done.events[-1][0] == "done"
            assert db.load_jobs()[0].status == "done"  # stored before it was visible
            await table.finish(expired, JobState.FAILED, error={"code": "timeout", "message": "t"})
            return done.id, running.id, expired.id

    done_id, running_id, expired_id = asyncio.run(first_run())
    with StateDB(path) as db:  # the expired job finished long ago (by its stored wall clock)
        row = next(j for j in db.load_jobs() if j.id == expired_id)
        db.put_job(StoredJob(row.id, row.status, row.created, time.time() - 3600, row.step,
                             row.num_steps, row.result, row.error))  # fmt: skip

    async def second_run() -> None:
        with StateDB(path) as db:
            table = JobTable(8, 600.0, 2, db)
            assert table.load() == 2
            done = table.get(done_id)
            assert done.view()["result"]["image"] == "QUJD"
            assert done.events == [("done", {"result": {"id": "e1", "path": "masked"},
                                             "href": f"/v1/jobs/{done_id}"})]  # fmt: skip
            lost = table.get(running_id)  # running when the server stopped
            assert lost.status == "failed" and lost.error["code"] == "interrupted"
            with pytest.raises(Exception, match="no job"):
                table.get(expired_id)  # past its TTL: gone, from the file too
            table.forget(done_id)
        with StateDB(path) as db:  # close() waited for the deletes
            assert [j.id for j in db.load_jobs()] == [running_id]

    asyncio.run(second_run())


# ---- a real server, restarted ------------------------------------------------------------------
def _index_states(root: Path, prefix: str) -> dict[str, str]:
    """The host cache index's states per tier of the key starting with `prefix` (the index is
    the JSON file under <root>/host)."""
    (index,) = (root / "host").glob("index-*.json")
    entries = json.loads(index.read_text())["entries"]
    return {e["tier"]: e["state"] for e in entries if e["key"].startswith(prefix)}


def _wait(fn, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


def _template_ready(srv: ServerProcess, tid: str) -> dict:
    def ready():
        body = srv.get(f"/v1/templates/{tid}").json()
        assert body["status"] != "failed", body
        return body if body["status"] == "ready" else None

    return _wait(ready, f"template {tid[:12]} never ready")


def _health_cache(srv: ServerProcess) -> dict:
    cache = srv.health()[1]["cache"]
    assert cache["tiers"]["gpu"] == {"budget_bytes": None,
                                     "source": "not reported: no GPU tier above DRAM"}  # fmt: skip
    return cache


def test_templates_and_jobs_survive_a_restart_and_delete_removes_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started without --cache-root, with INSTGENIE_CACHE_ROOT naming the root, then restarted
    with --cache-root: the same cache, templates and jobs; each start derives the budgets it is
    not given from the machine, logs them and reports them in /health."""
    root = (tmp_path / "cache").resolve()
    namespace = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")

    def segments() -> list[Path]:
        return sorted(shm.glob(f"igc_{namespace}_*"))

    image = image_png(seed=21)
    tid = hashlib.sha256(image).hexdigest()
    srv = None
    try:
        monkeypatch.setenv("INSTGENIE_CACHE_ROOT", str(root))  # the default "auto" root
        srv = ServerProcess("--cache-disk-bytes", str(1 << 30))
        monkeypatch.setenv("INSTGENIE_CACHE_ROOT", "")
        assert f"state in {root / 'server.sqlite3'}" in srv.log()
        assert f"activation cache in {root} (INSTGENIE_CACHE_ROOT): DRAM " in srv.log()
        cache = _health_cache(srv)
        assert (cache["root"], cache["root_source"]) == (str(root), "INSTGENIE_CACHE_ROOT")
        dram = cache["tiers"]["dram"]
        assert dram["budget_bytes"] > 0 and dram["budget_bytes"] % (1 << 20) == 0
        assert dram["source"].startswith("auto: ")
        assert cache["tiers"]["disk"] == {"budget_bytes": 1 << 30, "source": "flag"}
        files = {"image": ("t.png", image, "image/png")}
        data = {"prompt": "a person", "seed": "3", "num_inference_steps": "2"}
        r = srv.post("/v1/templates", files=files, data=data)
        assert r.status_code == 202, r.text
        _template_ready(srv, tid)
        edit = {"template_id": tid, "prompt": "a hat", "seed": "5"}
        r = srv.post("/v1/edits", files=edit_files(), data=edit)
        assert (r.json()["path"], r.json()["cache_tier"]) == ("masked", "dram"), r.text
        r = srv.post("/v1/edits?async=true", files=edit_files(), data=edit)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        job = _wait(lambda: (b := srv.get(f"/v1/jobs/{job_id}").json())["status"] == "done" and b,
                    "job never done")  # fmt: skip
        assert srv.stop() == 0  # SIGTERM: drained

        # the cache outlives the server; the template and the job are in the state file
        (segment,) = segments()
        key = segment.name.split("_")[2]  # the cache key's first 40 hex digits
        assert set(_index_states(root, key).values()) == {"ready"}

        srv = ServerProcess("--cache-root", str(root))
        cache = _health_cache(srv)
        assert (cache["root"], cache["root_source"]) == (str(root), "flag")
        disk = cache["tiers"]["disk"]  # derived now; what the cache already holds counts in
        assert disk["budget_bytes"] > 0 and disk["source"].startswith("auto: 50% of the free")
        assert "the cache holds" in disk["source"]
        listed = srv.get("/v1/templates").json()["data"]
        assert [t["id"] for t in listed] == [tid]
        assert listed[0]["prompt"] == "a person" and listed[0]["num_inference_steps"] == 2
        _template_ready(srv, tid)
        r = srv.post("/v1/edits", files=edit_files(), data=edit)
        body = r.json()
        assert (body["path"], body["cache"], body["cache_tier"]) == ("masked", "hit", "dram")
        again = srv.get(f"/v1/jobs/{job_id}").json()
        assert again["status"] == "done" and again["result"] == job["result"]

        assert srv.delete(f"/v1/templates/{tid}").json()["deleted"] is True
        assert srv.get(f"/v1/templates/{tid}").status_code == 404
        # the worker removes the cache from every tier, then its meta file (asynchronously to
        # the answer)
        _wait(lambda: not segments() and not _index_states(root, key)
              and not list((root / "meta").glob("*.json")), "cache not removed", 60)  # fmt: skip
        assert srv.stop() == 0
        with StateDB(root / "server.sqlite3") as db:  # the deletion is durable too
            assert db.load_templates() == [] and [j.id for j in db.load_jobs()] == [job_id]
    finally:
        if srv is not None and srv.proc.poll() is None:  # a failed assertion: stop it now
            srv.proc.kill()
            srv.proc.wait()
        for p in segments():  # a failed run must not leave host shared memory behind
            p.unlink(missing_ok=True)
