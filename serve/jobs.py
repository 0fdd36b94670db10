"""JobStore: the embedded SQLite job store behind /v1/videos, /v1/files and /v1/batches.

One database file (WAL mode) under the server's data directory plus result files beside it:

    <data_dir>/jobs.sqlite3        jobs, files, batch_lines
    <data_dir>/files/<file id>     uploaded inputs and batch output/error files
    <data_dir>/results/<job id>.*  video results (MP4 and thumbnail JPEG)

Writes are atomic: a file is written to a temporary name, fsynced and renamed into place
before the row that names it commits, so a crash never leaves a half-written result that reads
as complete. Commits are durable (synchronous=FULL: fsynced), except the ones a caller marks
`durable=False`: a running video's progress and its in_progress/finalizing marks, which recovery
discards anyway (it restarts such a video from the beginning). Those commit without an fsync; WAL
keeps them atomic and a process crash keeps them, only a power loss may roll them back, and the
next durable commit syncs them too. A batch line's result is one row keyed by (batch id, line index): a restart runs
only the lines that have no row, and the output file is composed from the rows at the end, so
every input line has exactly one output line.

The store holds bookkeeping only; serve/job_runner.py decides what runs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.errors import ApiError

JOB_KINDS = ("video", "batch")
STATUSES = ("queued", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")
TERMINAL = ("completed", "failed", "cancelled", "expired")
VIDEO_REQUEST_FIELDS = ("prompt", "negative_prompt", "width", "height", "num_frames", "fps", "num_inference_steps",
                        "guidance_scale", "true_cfg_scale", "seed", "step_cache",
                        "seconds")  # what a video job keeps of VideoRequest

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,               -- video | batch
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,             -- one of STATUSES
    progress INTEGER NOT NULL DEFAULT 0,  -- 0..100
    request TEXT NOT NULL,            -- the validated request, JSON
    result TEXT,                      -- JSON: result paths / output file ids
    created_at INTEGER NOT NULL,
    started_at INTEGER,
    completed_at INTEGER,
    error TEXT,                       -- JSON {"code", "message"} or NULL
    idempotency_key TEXT,
    expires_at INTEGER,
    request_hash TEXT                 -- request_digest of the body that created it (NULL: made before hashes)
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, kind, idempotency_key);
CREATE INDEX IF NOT EXISTS jobs_listing ON jobs (tenant, kind, created_at);
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    path TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line_index INTEGER NOT NULL,
    custom_id TEXT,
    ok INTEGER NOT NULL,              -- 1: goes to the output file, 0: to the error file
    record TEXT NOT NULL,             -- the output/error line, JSON
    PRIMARY KEY (batch_id, line_index)
);
"""


@dataclass(frozen=True)
class Job:
    id: str
    kind: str  # video | batch
    tenant: str
    status: str  # one of STATUSES
    progress: int  # 0..100
    request: dict[str, Any]  # the validated request
    result: dict[str, Any] | None  # paths / file ids once completed
    created_at: int
    started_at: int | None
    completed_at: int | None
    error: dict[str, Any] | None  # {"code", "message"}
    idempotency_key: str | None
    expires_at: int | None
    request_hash: str | None = None  # request_digest of the creating body: a reused key must bring the same body


class IdempotencyKeyReused(ApiError):
    """An Idempotency-Key sent again with a different body. 422, as the IETF idempotency-key draft answers
    (Stripe: 400 idempotency_error): the key names one request, so the first job is not silently returned."""

    def __init__(self, key: str, job: Job):
        super().__init__(422, f"Idempotency-Key {key!r} was already used for {job.kind} {job.id} with a different "
                              f"request body; resend that body to get the same {job.kind}, or use a new key",
                         param="Idempotency-Key", code="idempotency_key_reused")


class StorageFull(ApiError):
    """The job store's disk (or quota) is full. 507, as WebDAV answers it: nothing was stored, nothing stored before
    is touched, and the same request succeeds once space is freed."""

    def __init__(self, where: Path):
        super().__init__(507, f"the job store ({where}) is out of disk space; nothing was stored. Retry once space "
                              "is freed (delete files or jobs, or grow the disk)", code="insufficient_storage",
                         retry_after_s=30)


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


MAX_IDEMPOTENCY_KEY_CHARS = 255  # as Stripe allows


def idempotency_key(headers) -> str | None:
    """The request's Idempotency-Key, or None: an empty or all-whitespace header is no key (else every such request
    of a tenant would be tied to the first one). Raises ApiError (400) for a key over 255 characters."""
    key = (headers.get("idempotency-key") or "").strip()
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise ApiError(400, f"Idempotency-Key is {len(key)} characters; the limit is {MAX_IDEMPOTENCY_KEY_CHARS}",
                       param="Idempotency-Key", code="invalid_value")
    return key or None


def request_digest(body: dict[str, Any], *blobs: bytes) -> str:
    """The identity of a request body: SHA-256 of its canonical JSON (sorted keys, no whitespace) and of each
    uploaded blob. Equal for the same fields however they were spelled (key order, JSON or multipart)."""
    h = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode())
    for blob in blobs:
        h.update(hashlib.sha256(blob).digest())
    return h.hexdigest()


@dataclass(frozen=True)
class StoredFile:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    path: Path
    created_at: int
    expires_at: int | None


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees either nothing or all of it (tmp + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # a partial file would keep the space a full disk needs back
        if e.errno in _FULL_ERRNOS:
            raise StorageFull(path.parent) from e
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


class JobStore:
    """Jobs, files and batch line results in one SQLite file. Thread-safe (one connection, one lock)."""

    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir).expanduser()
        self.files_dir = self.data_dir / "files"
        self.results_dir = self.data_dir / "results"
        for d in (self.files_dir, self.results_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.data_dir / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed row survives a crash
        self._db.executescript(_SCHEMA)
        columns = {r["name"] for r in self._db.execute("PRAGMA table_info(jobs)")}
        if "request_hash" not in columns:  # a store made before request hashes: its jobs keep NULL (no check)
            self._db.execute("ALTER TABLE jobs ADD COLUMN request_hash TEXT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple = (), *, durable: bool = True) -> list[sqlite3.Row]:
        try:
            return self._exec_locked(sql, args, durable=durable)
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:  # the statement was rolled back
                raise StorageFull(self.data_dir) from e
            raise

    def _exec_locked(self, sql: str, args: tuple, *, durable: bool) -> list[sqlite3.Row]:
        with self._lock:
            if durable:
                return self._db.execute(sql, args).fetchall()
            # One commit without its fsync (a FULL one waits ~0.5 ms for it here, up to 12 ms on a loaded host).
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                return self._db.execute(sql, args).fetchall()
            finally:
                self._db.execute("PRAGMA synchronous=FULL")

    # -- jobs -----------------------------------------------------------------------------

    def create_job(self, kind: str, tenant: str, request: dict[str, Any], *, prefix: str,
                   idempotency_key: str | None = None, request_hash: str | None = None,
                   ttl_s: int | None = None) -> tuple[Job, bool]:
        """A new queued job, or (with the same tenant, kind and idempotency key) the existing one, when its
        request_hash is the same (IdempotencyKeyReused when it differs). Returns (job, created)."""
        assert kind in JOB_KINDS, kind
        now = int(time.time())
        job_id = f"{prefix}_{uuid.uuid4().hex}"
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO jobs (id, kind, tenant, status, request, created_at, idempotency_key, expires_at,"
                    " request_hash) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?)",
                    (job_id, kind, tenant, json.dumps(request), now, idempotency_key,
                     now + ttl_s if ttl_s else None, request_hash))
                created = True
            except sqlite3.IntegrityError:  # the idempotency key was used before: the same job, if the same body
                row = self._db.execute("SELECT id FROM jobs WHERE tenant=? AND kind=? AND idempotency_key=?",
                                       (tenant, kind, idempotency_key)).fetchone()
                job_id, created = row["id"], False
        job = self.get_job(job_id)
        if not created:
            _same_body(job, idempotency_key, request_hash)
        return job, created

    def get_job(self, job_id: str, tenant: str | None = None, kind: str | None = None) -> Job | None:
        rows = self._exec("SELECT * FROM jobs WHERE id=?", (job_id,))
        if not rows:
            return None
        job = _job(rows[0])
        if (tenant is not None and job.tenant != tenant) or (kind is not None and job.kind != kind):
            return None  # another tenant's job does not exist for this caller
        return job

    def find_by_key(self, tenant: str, kind: str, key: str, request_hash: str | None = None) -> Job | None:
        """The job this tenant created with `key`, or None; IdempotencyKeyReused when `request_hash` is given
        and differs from the creating body's."""
        rows = self._exec("SELECT id FROM jobs WHERE tenant=? AND kind=? AND idempotency_key=?", (tenant, kind, key))
        job = self.get_job(rows[0]["id"]) if rows else None
        if job is not None:
            _same_body(job, key, request_hash)
        return job

    def list_jobs(self, kind: str, tenant: str, *, limit: int, after: str | None = None) -> list[Job]:
        """Newest first; `after` is the id of the last job of the previous page."""
        if after is not None:
            anchor = self.get_job(after, tenant, kind)
            if anchor is None:
                return []
            rows = self._exec("SELECT * FROM jobs WHERE kind=? AND tenant=? AND (created_at, id) < (?, ?) "
                              "ORDER BY created_at DESC, id DESC LIMIT ?",
                              (kind, tenant, anchor.created_at, anchor.id, limit))
        else:
            rows = self._exec("SELECT * FROM jobs WHERE kind=? AND tenant=? ORDER BY created_at DESC, id DESC LIMIT ?",
                              (kind, tenant, limit))
        return [_job(r) for r in rows]

    def jobs_with_status(self, *statuses: str) -> list[Job]:
        marks = ",".join("?" * len(statuses))
        return [_job(r) for r in self._exec(f"SELECT * FROM jobs WHERE status IN ({marks}) ORDER BY created_at, id",
                                            statuses)]

    def count_active(self, tenant: str, kind: str) -> int:
        rows = self._exec("SELECT COUNT(*) AS n FROM jobs WHERE tenant=? AND kind=? AND status IN "
                          "('queued', 'in_progress', 'finalizing', 'cancelling')", (tenant, kind))
        return rows[0]["n"]

    def update_job(self, job_id: str, *, durable: bool = True, **fields: Any) -> None:
        """Set columns of one job; dict values are stored as JSON. `durable=False`: a write recovery does not
        depend on (see the module docstring), committed without an fsync."""
        assert fields and set(fields) <= {"status", "progress", "result", "started_at", "completed_at", "error",
                                          "expires_at"}, fields
        values = [json.dumps(v) if isinstance(v, dict) else v for v in fields.values()]
        self._exec(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in fields)} WHERE id=?", (*values, job_id),
                   durable=durable)

    def finish_job(self, job_id: str, status: str, *, result: dict | None = None, error: dict | None = None,
                   ttl_s: int | None = None) -> None:
        assert status in TERMINAL, status
        now = int(time.time())
        fields: dict[str, Any] = dict(status=status, completed_at=now, error=error)
        if result is not None:
            fields["result"] = result
        if status == "completed":
            fields["progress"] = 100
        if ttl_s:
            fields["expires_at"] = now + ttl_s
        self.update_job(job_id, **fields)

    def delete_job(self, job_id: str) -> None:
        """Forget a finished job: its row, its line results and its result files."""
        self._exec("DELETE FROM batch_lines WHERE batch_id=?", (job_id,))
        self._exec("DELETE FROM jobs WHERE id=?", (job_id,))
        for path in self.results_dir.glob(f"{job_id}.*"):
            path.unlink(missing_ok=True)

    # -- files ----------------------------------------------------------------------------

    def add_file(self, tenant: str, purpose: str, filename: str, data: bytes, *,
                 ttl_s: int | None = None) -> StoredFile:
        file_id = f"file-{uuid.uuid4().hex}"
        path = self.files_dir / file_id
        write_atomic(path, data)  # the bytes are on disk before the row that names them
        now = int(time.time())
        try:
            self._exec("INSERT INTO files (id, tenant, purpose, filename, bytes, path, created_at, expires_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (file_id, tenant, purpose, filename, len(data), str(path), now, now + ttl_s if ttl_s else None))
        except StorageFull:
            path.unlink(missing_ok=True)  # no row names it: it would only hold space
            raise
        return self.get_file(file_id)

    def get_file(self, file_id: str, tenant: str | None = None) -> StoredFile | None:
        rows = self._exec("SELECT * FROM files WHERE id=?", (file_id,))
        if not rows or (tenant is not None and rows[0]["tenant"] != tenant):
            return None
        r = rows[0]
        return StoredFile(r["id"], r["tenant"], r["purpose"], r["filename"], r["bytes"], Path(r["path"]),
                          r["created_at"], r["expires_at"])

    def list_files(self, tenant: str, purpose: str | None = None) -> list[StoredFile]:
        rows = self._exec("SELECT id FROM files WHERE tenant=? AND (? IS NULL OR purpose=?) ORDER BY created_at DESC",
                          (tenant, purpose, purpose))
        return [self.get_file(r["id"]) for r in rows]

    def delete_file(self, file_id: str) -> None:
        f = self.get_file(file_id)
        try:
            self._exec("DELETE FROM files WHERE id=?", (file_id,))
        except StorageFull:
            if f is None:
                raise
            # A full disk leaves SQLite no room to log even a delete: free the bytes first, then drop the row.
            f.path.unlink(missing_ok=True)
            self._exec("DELETE FROM files WHERE id=?", (file_id,))
        if f is not None:
            f.path.unlink(missing_ok=True)

    # -- batch lines ----------------------------------------------------------------------

    def put_line(self, batch_id: str, line_index: int, custom_id: str | None, ok: bool, record: dict) -> None:
        """Record one line's result; a line already recorded keeps its first result (no duplicates)."""
        self._exec("INSERT OR IGNORE INTO batch_lines (batch_id, line_index, custom_id, ok, record) "
                   "VALUES (?, ?, ?, ?, ?)", (batch_id, line_index, custom_id, int(ok), json.dumps(record)))

    def done_lines(self, batch_id: str) -> set[int]:
        return {r["line_index"] for r in self._exec("SELECT line_index FROM batch_lines WHERE batch_id=?", (batch_id,))}

    def line_counts(self, batch_id: str) -> tuple[int, int]:
        """(succeeded, failed) lines so far."""
        rows = self._exec("SELECT ok, COUNT(*) AS n FROM batch_lines WHERE batch_id=? GROUP BY ok", (batch_id,))
        counts = {r["ok"]: r["n"] for r in rows}
        return counts.get(1, 0), counts.get(0, 0)

    def lines(self, batch_id: str, ok: bool) -> list[dict]:
        rows = self._exec("SELECT record FROM batch_lines WHERE batch_id=? AND ok=? ORDER BY line_index",
                          (batch_id, int(ok)))
        return [json.loads(r["record"]) for r in rows]

    # -- expiry ---------------------------------------------------------------------------

    def expire(self, now: int | None = None) -> int:
        """Drop files and job results past their expiry; returns how many were dropped."""
        now = int(time.time()) if now is None else now
        dropped = 0
        for r in self._exec("SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at < ?", (now,)):
            self.delete_file(r["id"])
            dropped += 1
        for r in self._exec("SELECT id FROM jobs WHERE status='completed' AND expires_at IS NOT NULL "
                            "AND expires_at < ?", (now,)):
            for path in self.results_dir.glob(f"{r['id']}.*"):
                path.unlink(missing_ok=True)
            self.update_job(r["id"], status="expired")
            dropped += 1
        return dropped


def _same_body(job: Job, key: str, request_hash: str | None) -> None:
    """A reused key must come with the body it was first sent with (unknown on either side: not checked)."""
    if request_hash is not None and job.request_hash is not None and job.request_hash != request_hash:
        raise IdempotencyKeyReused(key, job)


def _job(r: sqlite3.Row) -> Job:
    return Job(r["id"], r["kind"], r["tenant"], r["status"], r["progress"], json.loads(r["request"]),
               json.loads(r["result"]) if r["result"] else None, r["created_at"], r["started_at"], r["completed_at"],
               json.loads(r["error"]) if r["error"] else None, r["idempotency_key"], r["expires_at"],
               r["request_hash"])
