"""The server's durable state: registered templates and async jobs, in one SQLite file.

The file is `ServerConfig.state_db` (default `<cache-root>/server.sqlite3`). WAL journal, so a
write never blocks the start-up reads and a crash mid-write leaves the last committed state;
`synchronous=FULL`: every commit is fsynced before it returns, so what the API has answered (a
registration, a deletion, a finished job) survives a power loss too, not only a process restart
(NORMAL could lose the last commits then). Commits cost one fsync each, a few ms; they are few
(one per registration or deletion, two per async job) and run on this module's writer thread,
never on the event loop (a template row holds its image, a job row its result: up to tens of MB,
up to ~200 ms to write).

Schema versioned by `PRAGMA user_version`: opening an older file migrates it in one transaction
per step; a file of a newer version (written by a newer server) is refused with StateDBError, as
is a file that is not a database, and one another running server holds (an exclusive flock on
`<file>.lock` for the life of this object: two servers must not share one state).
Invariant: every write is one transaction (committed or rolled back whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from instgenie.errors import InstGenIEError
from instgenie.messages import RegisterTemplate

#: the schema this code writes; MIGRATIONS[v] takes a file from version v - 1 to v
SCHEMA_VERSION = 2  # 2: templates.loras
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE templates (
            id TEXT PRIMARY KEY,            -- RegisterTemplate.template_id (sha256 hex of image)
            image BLOB NOT NULL,            -- encoded template image
            mask BLOB,                      -- encoded mask, or NULL (whole image)
            prompt TEXT NOT NULL,
            negative_prompt TEXT,
            seed INTEGER NOT NULL,
            num_inference_steps INTEGER,
            guidance_scale REAL,
            strength REAL NOT NULL,
            width INTEGER NOT NULL,         -- template image size, pixels
            height INTEGER NOT NULL,
            created REAL NOT NULL           -- unix s
        )""",
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            status TEXT NOT NULL,           -- queued | running | done | failed | cancelled
            created REAL NOT NULL,          -- unix s
            finished REAL,                  -- unix s, once terminal
            step INTEGER NOT NULL,          -- denoise steps done
            num_steps INTEGER,
            result TEXT,                    -- JSON: the edit response (done)
            error TEXT                      -- JSON: {"code", "message", "field"?}
        )""",
        "CREATE INDEX jobs_created ON jobs (created)",
    ),
    2: (
        # JSON [[id, scale], ...]: RegisterTemplate.loras; "" = none (every version-1 row)
        "ALTER TABLE templates ADD COLUMN loras TEXT NOT NULL DEFAULT ''",
    ),
}
DEFAULT_NAME = "server.sqlite3"  # under the cache root


class StateDBError(InstGenIEError):
    """The state database cannot be opened or written (path, version, corruption, in use)."""

    code = "state_unavailable"


@dataclass(frozen=True)
class StoredTemplate:
    msg: RegisterTemplate  # what every worker is sent
    width: int  # template image size, pixels
    height: int
    created: float  # unix s


class JobState(StrEnum):  # an async job's status (the API's "status", the jobs.status column)
    QUEUED = "queued"  # accepted, waiting for a worker
    RUNNING = "running"  # its worker reported a first stage
    DONE = "done"  # terminal: result kept until its TTL
    FAILED = "failed"  # terminal: error kept (also a job the server stopped under: interrupted)
    CANCELLED = "cancelled"  # terminal: DELETE /v1/jobs/{id}


@dataclass(frozen=True)
class StoredJob:
    id: str
    status: JobState
    created: float  # unix s
    finished: float | None  # unix s
    step: int
    num_steps: int | None
    result: dict | None
    error: dict | None


class StateDB:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StateDBError(f"state_db: cannot open {self.path}: {e}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise StateDBError(
                f"state_db: {self.path} is in use by another running server; give this one "
                "its own --state-db (or --cache-root)"
            ) from None
        self._mutex = threading.Lock()  # one statement sequence at a time on the connection
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-db")
        try:
            # autocommit mode: transactions are explicit (BEGIN IMMEDIATE ... COMMIT)
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            self._release()
            raise StateDBError(f"state_db: cannot open {self.path}: {e}") from None
        try:
            self._setup()
        except BaseException:
            self._conn.close()
            self._release()
            raise

    def _setup(self) -> None:
        try:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._conn.execute("PRAGMA synchronous=FULL")
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise StateDBError(f"state_db: {self.path} is not a usable database: {e}") from None
        if mode != "wal":
            raise StateDBError(f"state_db: {self.path}: WAL journal refused (got {mode!r})")
        if version > SCHEMA_VERSION:
            raise StateDBError(
                f"state_db: {self.path} has schema version {version}, newer than this server's "
                f"{SCHEMA_VERSION} (written by a newer instgenie); upgrade, or use another file"
            )
        for v in range(version + 1, SCHEMA_VERSION + 1):
            with self._txn() as c:
                for sql in MIGRATIONS[v]:
                    c.execute(sql)
                c.execute(f"PRAGMA user_version = {v}")

    @contextlib.contextmanager
    def _txn(self):
        """One write transaction: committed on success, rolled back on any error; sqlite3 errors
        become StateDBError."""
        with self._mutex:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                # a failed COMMIT (disk full, I/O error) leaves the transaction open: end it, so
                # the next write can begin one
                if self._conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                raise StateDBError(f"state_db: {self.path}: {e}") from None

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._mutex:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise StateDBError(f"state_db: {self.path}: {e}") from None

    # ---- info ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._read("PRAGMA user_version")[0][0]

    @property
    def journal_mode(self) -> str:
        return self._read("PRAGMA journal_mode")[0][0]

    # ---- templates -------------------------------------------------------------------------
    def load_templates(self) -> list[StoredTemplate]:
        """Every stored template, oldest first."""
        rows = self._read(
            "SELECT id, image, mask, prompt, negative_prompt, seed, num_inference_steps, "
            "guidance_scale, strength, width, height, created, loras FROM templates "
            "ORDER BY created"
        )
        out = []
        for (tid, image, mask, prompt, neg, seed, steps, guidance, strength, w, h, created,
             loras) in rows:  # fmt: skip
            msg = RegisterTemplate(
                template_id=tid, image=bytes(image), mask=None if mask is None else bytes(mask),
                prompt=prompt, negative_prompt=neg, seed=seed, num_inference_steps=steps,
                guidance_scale=guidance, strength=strength,
                loras=[(str(i), float(s)) for i, s in json.loads(loras)] if loras else [],
            )  # fmt: skip
            out.append(StoredTemplate(msg, w, h, created))
        return out

    def put_template(self, t: StoredTemplate) -> None:
        m = t.msg
        with self._txn() as c:
            c.execute(
                "INSERT OR REPLACE INTO templates (id, image, mask, prompt, negative_prompt, "
                "seed, num_inference_steps, guidance_scale, strength, width, height, created, "
                "loras) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (m.template_id, m.image, m.mask, m.prompt, m.negative_prompt, m.seed,
                 m.num_inference_steps, m.guidance_scale, m.strength, t.width, t.height,
                 t.created, json.dumps([[i, s] for i, s in m.loras]) if m.loras else ""),
            )  # fmt: skip

    def delete_template(self, template_id: str) -> None:
        with self._txn() as c:
            c.execute("DELETE FROM templates WHERE id = ?", (template_id,))

    # ---- jobs ------------------------------------------------------------------------------
    def load_jobs(self) -> list[StoredJob]:
        """Every stored job, oldest first."""
        rows = self._read(
            "SELECT id, status, created, finished, step, num_steps, result, error FROM jobs "
            "ORDER BY created, rowid"
        )
        return [
            StoredJob(
                jid,
                JobState(status),
                created,
                finished,
                step,
                num_steps,
                _loads(result),
                _loads(error),
            )
            for jid, status, created, finished, step, num_steps, result, error in rows
        ]

    def put_job(self, j: StoredJob) -> None:
        with self._txn() as c:
            c.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (j.id, j.status.value, j.created, j.finished, j.step, j.num_steps,
                 _dumps(j.result), _dumps(j.error)),
            )  # fmt: skip

    def delete_jobs(self, ids: list[str]) -> None:
        with self._txn() as c:
            c.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])

    def fail_unfinished(self, finished: float, error: dict) -> int:
        """Mark every queued/running job failed with `error` (the server that ran them is gone);
        returns how many."""
        with self._txn() as c:
            cur = c.execute(
                "UPDATE jobs SET status = 'failed', finished = ?, error = ? "
                "WHERE status IN ('queued', 'running')",
                (finished, _dumps(error)),
            )
            return cur.rowcount

    # ---- writer thread ---------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run a write (a method of this object) on the writer thread; writes run one at a time
        in submission order. The future raises StateDBError if the write failed."""
        return self._writer.submit(fn, *args)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`submit` and wait for it without blocking the event loop. Cancelling the caller does
        not cancel the write: it completes (or fails) on its thread all the same."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn, *args)))

    def close(self) -> None:
        """Finish the submitted writes, close the file and release it."""
        if self._lock_fd < 0:
            return
        self._writer.shutdown(wait=True)
        with self._mutex:
            self._conn.close()
        self._release()

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1

    def __enter__(self) -> StateDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dumps(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value)


def _loads(text: str | None) -> dict | None:
    return None if text is None else json.loads(text)
