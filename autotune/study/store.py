"""The study: a folder with a SQLite database of every trial, one folder per trial,
and the files written for users (best_ds_config.json, summary.json).

The controller opens it for writing (`Study.open`, one controller at a time: `lock`);
every reader opens it read-only (`open_study_readonly`, or `stored_meta` for one value
before a run starts), which a live run holding the study does not block.

SQLite in WAL mode with one transaction per state change, so a controller
killed at any moment leaves a consistent database; user-facing files are
written atomically (temp file + rename).
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.errors import StudyError
from autotune.core.space import TrialConfig
from autotune.core.trial_kind import TrialKind
from autotune.core.trial_result import STATUS_FAILED, STATUS_OK

STUDY_FORMAT = 1
DB_NAME = "study.db"

STATUS_RUNNING = "running"
# a finished trial's two statuses are the data model's (what the search is told)
STATUS_INTERRUPTED = "interrupted"
COUNTED = (STATUS_OK, STATUS_FAILED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    number INTEGER NOT NULL,
    status TEXT NOT NULL,
    source TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    micro_batch_size INTEGER NOT NULL,
    gradient_accumulation_steps INTEGER NOT NULL,
    reduce_bucket_size INTEGER,
    activation_checkpoint_interval INTEGER NOT NULL DEFAULT 0,
    samples_per_second REAL,
    failure_reason TEXT,
    failure_detail TEXT,
    summary_json TEXT,
    rules_fired TEXT,
    started REAL NOT NULL,
    finished REAL,
    wall_seconds REAL,
    pgid INTEGER,
    master_port INTEGER
);
"""


@dataclass(kw_only=True, slots=True)
class TrialRow:
    id: int
    number: int
    status: str
    source: TrialKind
    """What the trial is for (autotune/core/trial_kind.py), read from the stored label."""
    reason: str
    config: TrialConfig
    samples_per_second: float | None
    failure_reason: str | None
    failure_detail: str | None
    summary: dict | None
    rules_fired: list[str]
    started: float
    finished: float | None
    wall_seconds: float | None
    pgid: int | None
    master_port: int | None = None
    """The trial's torch.distributed port: names the /dev/shm buffers its ranks leave behind."""

    def __post_init__(self) -> None:
        self.source = TrialKind.of(self.source)  # a row built from a label (a test, a replay)
    repeats: int = 1
    """How many successful trials ran this configuration (set by Study.best)."""


class Study:
    def __init__(self, root: Path, conn: sqlite3.Connection) -> None:
        self.root = root
        self._db = conn
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Hold the study for this process: a second controller on the same study is refused.

        An flock on `.lock` in the study folder; the kernel releases it when the process
        dies, so a SIGKILLed controller never leaves a stale lock behind.
        """
        if self._lock_fd is not None:
            return
        path = self.root / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "another process"
            os.close(fd)
            raise StudyError(f"{self.root}: in use by another autotune run (pid {holder}); "
                             "wait for it to end or choose another --study") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    # -- opening ------------------------------------------------------------
    @classmethod
    def open(cls, root: str | Path, *, create: bool, meta: dict[str, Any] | None = None) -> Study:
        """Open an existing study or create a new one; refuses folders that are not studies."""
        root = Path(root)
        db_path = root / DB_NAME
        if root.exists() and not root.is_dir():
            raise StudyError(f"{root}: exists and is not a folder; choose another --study")
        if not db_path.exists():
            if root.exists() and any(root.iterdir()):
                raise StudyError(f"{root}: folder is not empty and holds no {DB_NAME}; "
                                 "it is not an autotune study: choose another --study")
            if not create:
                raise StudyError(f"{root}: no study here; run without --resume to start one")
            root.mkdir(parents=True, exist_ok=True)
        if db_path.exists():
            _probe_readonly(db_path)  # refuse foreign files before anything writes to them
        conn = _connect(db_path)
        study = cls(root, conn)
        fmt = study.get_meta("format")
        if fmt is None:
            if not create:
                conn.close()
                raise StudyError(f"{db_path}: not an autotune study database")
            study._init(meta or {})
        elif fmt != str(STUDY_FORMAT):
            conn.close()
            raise StudyError(f"{root}: study format {fmt}, this autotune reads format {STUDY_FORMAT}; "
                             "start a new study with another --study")
        try:
            study.lock()
        except StudyError:
            conn.close()
            raise
        study._add_missing_columns()
        return study

    def _add_missing_columns(self) -> None:
        """Studies written before `master_port` or `activation_checkpoint_interval` existed gain
        the column (format unchanged: an old study's trials ran with the base config's interval)."""
        have = {r[1] for r in self._db.execute("PRAGMA table_info(trials)")}
        for name, decl in (("master_port", "INTEGER"), ("activation_checkpoint_interval", "INTEGER NOT NULL DEFAULT 0")):
            if name not in have:
                with self._db:
                    self._db.execute(f"ALTER TABLE trials ADD COLUMN {name} {decl}")

    def _init(self, meta: dict[str, Any]) -> None:
        with self._db:
            self._db.executescript(_SCHEMA)
            self._db.executemany(
                "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                [("format", str(STUDY_FORMAT)), ("created", str(time.time()))]
                + [(k, json.dumps(v)) for k, v in meta.items()],
            )

    def close(self) -> None:
        self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- meta ---------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        try:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        except sqlite3.DatabaseError:
            return None
        return row[0] if row else None

    def set_meta_json(self, items: dict[str, Any]) -> None:
        """Store each value as JSON under its key, all in one transaction."""
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                                 [(k, json.dumps(v)) for k, v in items.items()])

    def get_meta_json(self, key: str) -> Any:
        raw = self.get_meta(key)
        return None if raw is None else json.loads(raw)

    # -- trials -------------------------------------------------------------
    def trial_dir(self, number: int) -> Path:
        return self.root / f"trial-{number:03d}"

    def start_trial(self, number: int, config: TrialConfig, source: str, reason: str) -> int:
        with self._db:
            cur = self._db.execute(
                "INSERT INTO trials(number, status, source, reason, micro_batch_size, "
                "gradient_accumulation_steps, reduce_bucket_size, activation_checkpoint_interval, started)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (number, STATUS_RUNNING, source, reason, config.micro_batch_size,
                 config.gradient_accumulation_steps, config.reduce_bucket_size,
                 config.activation_checkpoint_interval, time.time()),
            )
        return int(cur.lastrowid)

    def set_launch(self, trial_id: int, pgid: int | None, master_port: int | None) -> None:
        """What a later controller needs to clean up after this trial if this one dies."""
        with self._db:
            self._db.execute("UPDATE trials SET pgid = ?, master_port = ? WHERE id = ?",
                             (pgid, master_port, trial_id))

    def finish_trial(self, trial_id: int, *, status: str, samples_per_second: float | None,
                     failure_reason: str | None, failure_detail: str | None,
                     summary: dict | None, rules_fired: list[str], wall_seconds: float) -> None:
        """Record a result, once: a trial already finished or marked interrupted is left as it is."""
        with self._db:
            self._db.execute(
                "UPDATE trials SET status=?, samples_per_second=?, failure_reason=?, failure_detail=?,"
                " summary_json=?, rules_fired=?, finished=?, wall_seconds=? WHERE id=? AND status=?",
                (status, samples_per_second, failure_reason, failure_detail,
                 None if summary is None else json.dumps(summary), json.dumps(rules_fired),
                 time.time(), wall_seconds, trial_id, STATUS_RUNNING),
            )

    def remove_stale_temp_files(self) -> int:
        """Temporary files of atomic writes a dead controller never renamed (we hold the lock)."""
        n = 0
        for tmp in self.root.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
            n += 1
        return n

    def interrupt(self, trial_id: int) -> None:
        """Mark one trial a dead controller left 'running' as interrupted (once it is cleaned up)."""
        with self._db:
            self._db.execute("UPDATE trials SET status=?, finished=? WHERE id=? AND status=?",
                             (STATUS_INTERRUPTED, time.time(), trial_id, STATUS_RUNNING))

    def interrupt_running(self) -> list[TrialRow]:
        """Mark trials left 'running' by a dead controller as interrupted; returns them."""
        left = [t for t in self.trials() if t.status == STATUS_RUNNING]
        with self._db:
            self._db.execute("UPDATE trials SET status=?, finished=? WHERE status=?",
                             (STATUS_INTERRUPTED, time.time(), STATUS_RUNNING))
        return left

    def trials(self) -> list[TrialRow]:
        rows = self._db.execute(
            "SELECT id, number, status, source, reason, micro_batch_size, gradient_accumulation_steps,"
            " reduce_bucket_size, samples_per_second, failure_reason, failure_detail, summary_json,"
            " rules_fired, started, finished, wall_seconds, pgid, master_port, activation_checkpoint_interval"
            " FROM trials ORDER BY id"
        ).fetchall()
        return [
            TrialRow(id=r[0], number=r[1], status=r[2], source=TrialKind.of(r[3]), reason=r[4],
                     config=TrialConfig(micro_batch_size=r[5], gradient_accumulation_steps=r[6],
                                        reduce_bucket_size=r[7], activation_checkpoint_interval=r[18]),
                     samples_per_second=r[8], failure_reason=r[9], failure_detail=r[10],
                     summary=json.loads(r[11]) if r[11] else None,
                     rules_fired=json.loads(r[12]) if r[12] else [], started=r[13],
                     finished=r[14], wall_seconds=r[15], pgid=r[16], master_port=r[17])
            for r in rows
        ]

    def counted(self) -> list[TrialRow]:
        """Finished trials (ok or failed): the ones the budget counts, one per trial number."""
        return counted_of(self.trials())

    def best(self) -> TrialRow | None:
        """The configuration with the highest mean samples/s over its successful trials (`best_of`)."""
        from autotune.core.measurements import best_of

        return best_of(self.trials())


def counted_of(trials: list[TrialRow]) -> list[TrialRow]:
    """Of these rows, the finished trials (ok or failed), the first of each trial number."""
    seen: set[int] = set()
    out = []
    for t in trials:
        if t.status in COUNTED and t.number not in seen:
            seen.add(t.number)
            out.append(t)
    return out


def open_study_readonly(root: str | Path) -> Study:
    """A Study on a read-only connection; StudyError (one line) unless `root` is a valid study.

    Every reader of a study goes through here (`autotune report`) or `stored_meta` (what a
    new run reads first: the stored budget and command); only the controller opens it for
    writing (`Study.open`). The checks are those of `Study.open`, made first on an immutable
    view of the database file, which creates nothing beside it (a plain read-only open of a
    WAL database would create its -shm and -wal files): a refused folder is left exactly as
    it was. Only a valid study is then opened for reading (read-only, no lock, no column
    added), so that trials a running controller has committed to its WAL are seen too: a
    live run holding the study does not keep anyone from reading it.
    """
    root = Path(root)
    db = root / DB_NAME
    if not root.is_dir():
        raise StudyError(f"{root}: {'not a folder' if root.exists() else 'no such study folder'}")
    if not db.is_file():
        raise StudyError(f"{root}: holds no {DB_NAME}; it is not an autotune study")
    wal = db.with_name(DB_NAME + "-wal")
    if not (wal.is_file() and wal.stat().st_size > 0):  # else the WAL holds what the file lacks
        probe = _opened_ro(db, immutable=True)
        _check_readable(db, probe, root)
        probe.close()
    conn = _opened_ro(db, immutable=False)
    _check_readable(db, conn, root)
    return Study(root, conn)


def stored_meta(root: str | Path, key: str) -> str | None:
    """One meta value of a study as stored (its JSON text), read-only, without the study's checks.

    For what a new run needs before it opens the study (the budget, the user's command): None
    where there is no database, no readable one or no such key. The study may be held by
    nobody or by a live run; a study written before a column this version reads is still
    read (`Study.open` adds the column when the run resumes it).
    """
    db = Path(root) / DB_NAME
    if not db.is_file():
        return None
    try:
        conn = _connect_ro(db)
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def stored_budget(root: str | Path) -> int | None:
    """The budget a study was last run with (read-only; None when there is no readable one)."""
    raw = stored_meta(root, "budget")
    try:
        value = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _connect_ro(db: Path, *, immutable: bool = False) -> sqlite3.Connection:
    """The one read-only connection to a study database: SQLite's `mode=ro` URI (never creates
    the file), waiting up to 30 s for a writer's lock as the controller's own connection does.
    `immutable`: read the file alone, creating no -wal or -shm beside it."""
    uri = f"{db.resolve().as_uri()}?mode=ro" + ("&immutable=1" if immutable else "")
    return sqlite3.connect(uri, uri=True, timeout=30)


def _opened_ro(db: Path, *, immutable: bool) -> sqlite3.Connection:
    try:
        return _connect_ro(db, immutable=immutable)
    except sqlite3.Error as exc:
        raise StudyError(f"{db}: cannot open ({exc})") from None


def _check_readable(db: Path, conn: sqlite3.Connection, root: Path) -> None:
    """Our tables, our format, every column this version reads; closes `conn` when refusing."""
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"meta", "trials"} <= names:
            raise StudyError(f"{db}: not an autotune study database" if names else
                             f"{db}: empty study database (the controller died while creating it)")
        row = conn.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        if row is None:
            raise StudyError(f"{db}: not an autotune study database (no format recorded)")
        if row[0] != str(STUDY_FORMAT):
            raise StudyError(f"{root}: study format {row[0]}, this autotune reads format {STUDY_FORMAT}; "
                             "a newer autotune wrote it: report on it with that version")
        Study(root, conn).trials()
    except sqlite3.Error as exc:
        conn.close()
        raise StudyError(f"{db}: not readable as an autotune study ({exc})") from None
    except StudyError:
        conn.close()
        raise


def _probe_readonly(path: Path) -> None:
    """Open read-only and look for our tables: a foreign or damaged file is refused untouched."""
    try:
        conn = _connect_ro(path)
    except sqlite3.Error as exc:
        raise StudyError(f"{path}: cannot open ({exc}); choose another --study") from None
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.Error as exc:
        raise StudyError(f"{path}: not a readable SQLite database ({exc}); choose another --study") from None
    finally:
        conn.close()
    if not names:
        raise StudyError(f"{path}: empty study database (the controller died while creating it); "
                         "delete the folder and start again")
    if not {"meta", "trials"} <= names:
        raise StudyError(f"{path}: not an autotune study database; choose another --study")


def _connect(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(path, timeout=30, isolation_level=None)
        conn.isolation_level = ""  # `with conn:` = one transaction
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.DatabaseError as exc:
        raise StudyError(f"{path}: not a readable SQLite database ({exc}); choose another --study") from None
    return conn
