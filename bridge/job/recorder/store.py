"""The flight recorder's on-disk store: one SQLite file in WAL mode, written by one thread.

Invariants: only the recorder's writer thread writes (``Store``), one transaction per
batch, so a crash or a full disk leaves the last committed state; a reader
(``open_reader``: read-only, with an ``immutable`` fallback for a store in a read-only
place) sees the last commit of a running bridge without blocking its writer. The store
keeps the last ``max_cycles`` cycles or ``max_bytes``, whichever is reached first
(``enforce_bounds``: the oldest cycles go, their pages back to the file system).
``synchronous=NORMAL``: durable against a crash of the bridge, at worst the last
transactions lost on a power cut; the bridge's work never waits for an fsync.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cycles (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,          -- the bridge's own id: cycles without a ClusterD uuid have one too
    job TEXT NOT NULL,
    uuid TEXT,                         -- ClusterD's cycle uuid (the latest, when it changed)
    uuids TEXT NOT NULL DEFAULT '[]',  -- every uuid the cycle carried, in order (JSON)
    opened_by TEXT NOT NULL,           -- fault | signal
    started REAL NOT NULL,             -- Unix time
    ended REAL,                        -- NULL while open
    outcome TEXT,                      -- success | isolated | failed | exit | not_forwarded | unfinished | interrupted
    strategy TEXT,
    summary TEXT,                      -- analysis at close (JSON): faults, phases, waits
    events_dropped INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS cycles_uuid ON cycles (uuid);
CREATE TABLE IF NOT EXISTS events (
    cycle_id INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    t REAL NOT NULL,                   -- Unix time
    kind TEXT NOT NULL,
    data TEXT NOT NULL,                -- JSON
    PRIMARY KEY (cycle_id, seq)
) WITHOUT ROWID;
"""


_SQLITE_PERM, _SQLITE_READONLY, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 3, 8, 11, 13, 14, 26


class StoreError(Exception):
    """A store operation failed; ``reason`` is the metric label (disk_full, unwritable, ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def classify(error: BaseException) -> str:
    """The ``tft_bridge_recorder_errors_total`` reason for a failed store operation."""
    text = str(error).lower()
    if isinstance(error, sqlite3.Error):
        # Primary result codes (sqlite3.SQLITE_* and sqlite_errorcode exist from Python 3.11).
        code = (getattr(error, "sqlite_errorcode", None) or 0) & 0xFF
        if code == _SQLITE_FULL or "disk is full" in text:
            return "disk_full"
        if code in (_SQLITE_READONLY, _SQLITE_CANTOPEN, _SQLITE_PERM) or "readonly" in text \
                or "unable to open" in text or "read-only" in text:
            return "unwritable"
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "malformed" in text or "not a database" in text:
            return "corrupt"
        return "write_failed"
    if isinstance(error, OSError):
        import errno

        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk_full"
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR):
            return "unwritable"
    return "write_failed"


@dataclass
class CycleRow:
    id: int
    key: str
    job: str
    uuid: str | None
    uuids: list[str]
    opened_by: str
    started: float
    ended: float | None
    outcome: str | None
    strategy: str | None
    summary: dict[str, Any] | None
    events_dropped: int
    events: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "job": self.job, "uuid": self.uuid, "uuids": self.uuids, "opened_by": self.opened_by,
            "started": self.started, "ended": self.ended, "outcome": self.outcome, "strategy": self.strategy,
            "summary": self.summary, "events_dropped": self.events_dropped,
        }


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


class Store:
    """The writer's handle. Every method raises ``StoreError`` (never sqlite3.Error)."""

    def __init__(self, directory: Path, max_cycles: int, max_bytes: int) -> None:
        self.directory = directory
        self.path = directory / "recorder.sqlite3"
        self.max_cycles = max_cycles
        self.max_bytes = max_bytes
        self._db: sqlite3.Connection | None = None
        self.trimmed = 0  # cycles deleted to honour the bounds (for tests and logs)

    # ------------------------------------------------------------------ open / close
    def open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o750)
            db = sqlite3.connect(self.path, timeout=1.0, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as error:
            raise StoreError(classify(error), f"{self.path}: {error}") from None
        try:
            # auto_vacuum must be chosen before the first table exists (a new file).
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA journal_size_limit=4194304")  # the WAL file is truncated back to 4 MB
            db.executescript(_SCHEMA)
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            # Cycles a previous run left open (a crash, a kill) can never close now.
            db.execute(
                "UPDATE cycles SET outcome='interrupted', ended=COALESCE("
                "(SELECT MAX(t) FROM events WHERE cycle_id=cycles.id), started) WHERE ended IS NULL")
        except sqlite3.Error as error:
            db.close()
            raise StoreError(classify(error), f"{self.path}: {error}") from None
        self._db = db

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def close(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None

    # ------------------------------------------------------------------ writing (one transaction per batch)
    def write(self, opens: Iterable[tuple[str, str, str, float]],
              events: Iterable[tuple[str, int, float, str, dict[str, Any]]],
              updates: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """One batch in one transaction: cycles opened (key, job, opened_by, started),
        events (key, seq, t, kind, data), cycle updates (key, columns)."""
        db = self._require()
        try:
            db.execute("BEGIN")
            db.executemany("INSERT OR IGNORE INTO cycles (key, job, opened_by, started) VALUES (?, ?, ?, ?)", opens)
            db.executemany(
                "INSERT OR REPLACE INTO events (cycle_id, seq, t, kind, data) "
                "SELECT id, ?, ?, ?, ? FROM cycles WHERE key=?",
                ((seq, t, kind, _dumps(data), key) for key, seq, t, kind, data in events))
            for key, columns in updates:
                names = list(columns)
                values = [_dumps(v) if isinstance(v, (dict, list)) else v for v in columns.values()]
                db.execute(f"UPDATE cycles SET {', '.join(f'{n}=?' for n in names)} WHERE key=?", (*values, key))
            db.execute("COMMIT")
        except sqlite3.Error as error:
            self._rollback()
            raise StoreError(classify(error), str(error)) from None

    def enforce_bounds(self) -> int:
        """Delete the oldest cycles beyond ``max_cycles`` or ``max_bytes``; the number deleted."""
        db = self._require()
        deleted = 0
        try:
            (count,) = db.execute("SELECT COUNT(*) FROM cycles").fetchone()
            if count > self.max_cycles:
                deleted += self._delete_oldest(count - self.max_cycles)
                count -= deleted
            while count > 1 and self.used_bytes() > self.max_bytes:
                step = max(1, count // 10)
                removed = self._delete_oldest(step)
                if not removed:
                    break
                deleted += removed
                count -= removed
            if deleted:
                db.execute("PRAGMA incremental_vacuum")
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as error:
            self._rollback()
            raise StoreError(classify(error), str(error)) from None
        self.trimmed += deleted
        return deleted

    def used_bytes(self) -> int:
        """Bytes the live data takes (file pages minus free pages), WAL excluded."""
        db = self._require()
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        (free,) = db.execute("PRAGMA freelist_count").fetchone()
        (size,) = db.execute("PRAGMA page_size").fetchone()
        return int((pages - free) * size)

    def _delete_oldest(self, n: int) -> int:
        db = self._require()
        ids = [row[0] for row in db.execute("SELECT id FROM cycles ORDER BY id LIMIT ?", (n,))]
        if not ids:
            return 0
        marks = ",".join("?" * len(ids))
        db.execute("BEGIN")
        db.execute(f"DELETE FROM events WHERE cycle_id IN ({marks})", ids)
        db.execute(f"DELETE FROM cycles WHERE id IN ({marks})", ids)
        db.execute("COMMIT")
        return len(ids)

    def _rollback(self) -> None:
        if self._db is not None and self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    def _require(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("unwritable", f"{self.path} is not open")
        return self._db


# ---------------------------------------------------------------------- reading (history)

def open_reader(path: Path) -> sqlite3.Connection:
    """A read-only connection to a running or stopped bridge's store.

    ``mode=ro`` shares the running writer's WAL; it needs the ``-shm`` file or a writable
    directory, so a stopped bridge's store in a place the reader cannot write is opened
    ``immutable`` instead (safe: nobody writes it)."""
    if not path.is_file():
        raise FileNotFoundError(f"no flight-recorder store at {path}")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=2.0)
        db.execute("SELECT COUNT(*) FROM cycles").fetchone()
        return db
    except sqlite3.OperationalError:
        wal = path.with_name(path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise
        db = sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True)
        db.execute("SELECT COUNT(*) FROM cycles").fetchone()
        return db


_COLUMNS = "id, key, job, uuid, uuids, opened_by, started, ended, outcome, strategy, summary, events_dropped"


def _row(values: tuple[Any, ...]) -> CycleRow:
    (id_, key, job, uuid, uuids, opened_by, started, ended, outcome, strategy, summary, dropped) = values
    return CycleRow(id_, key, job, uuid, json.loads(uuids or "[]"), opened_by, started, ended, outcome, strategy,
                    json.loads(summary) if summary else None, dropped)


def last_cycles(db: sqlite3.Connection, limit: int) -> list[CycleRow]:
    """The newest ``limit`` cycles, oldest first, with their events (for the analysis of
    cycles still open; closed ones carry their summary)."""
    rows = [_row(r) for r in db.execute(f"SELECT {_COLUMNS} FROM cycles ORDER BY id DESC LIMIT ?", (limit,))]
    rows.reverse()
    for row in rows:
        if row.summary is None:
            row.events = events_of(db, row.id)
    return rows


def find_cycle(db: sqlite3.Connection, ident: str) -> list[CycleRow]:
    """Cycles whose uuid (current or earlier) or key equals ``ident``, else starts with it."""
    found = [_row(r) for r in db.execute(
        f"SELECT {_COLUMNS} FROM cycles WHERE uuid=? OR key=? ORDER BY id", (ident, ident))]
    if not found:
        like = ident.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        found = [_row(r) for r in db.execute(
            f"SELECT {_COLUMNS} FROM cycles WHERE uuid LIKE ? ESCAPE '\\' OR key LIKE ? ESCAPE '\\' "
            f"OR uuids LIKE ? ESCAPE '\\' ORDER BY id", (like, like, f'%"{like}'))]
    for row in found:
        row.events = events_of(db, row.id)
    return found


def events_of(db: sqlite3.Connection, cycle_id: int) -> list[dict[str, Any]]:
    return [{"t": t, "kind": kind, **json.loads(data)}
            for t, kind, data in db.execute("SELECT t, kind, data FROM events WHERE cycle_id=? ORDER BY seq",
                                            (cycle_id,))]
