"""LineageStore store: one DuckDB file per workspace recording runs, steps, artifacts and their edges.

DuckDB allows a single read-write process per file, while several processes touch this one (the
serve process, parallel flow runs, CLI readers) and processes outside this project may open it too
(a notebook, the `duckdb` CLI). A plain `duckdb.connect(path, read_only=True)` elsewhere takes
DuckDB's own file lock and ignores ours; while it is held no process can write the file.

So writes never go to the database directly. Each write is one *event* (the SQL statements of one
transaction and their parameters) appended as one line to this process's journal file in
`lineage.duckdb.journal/` and fsynced, then *ingested*: under an exclusive `fcntl.flock` on
`lineage.duckdb.lock`, every journal line not yet applied is applied in its own DuckDB transaction,
together with a per-file counter of applied lines (`_journal_progress`), so an event is applied
exactly once even if an ingester dies midway. Fully applied journal files are deleted. When the
database file is held by another process, ingestion simply stops; the events stay in the journal
and a background thread in every writing process retries (0.5 s, doubling to 5 s) until they land.
A write therefore fails only if its journal line cannot be written (disk full) or its SQL is
invalid (the event is then kept in `_journal_rejected` and the writer gets the error).

Reads see everything written, even while ingestion is blocked:
- nothing pending: a read-only connection under a shared flock (the fast path);
- events pending and the file held by an outside reader: the read runs on a private copy of the
  database with the pending events applied (`snapshot`), taken under the shared flock. Outside
  readers see the database as of the last ingestion, without the pending events.

Readers outside this project should use `Lineage(path).snapshot()` / `snapshot_query` (or
`smollm3 sql`), which read a consistent private copy and never block writers; an outside
`duckdb.connect(path, read_only=True)` is safe (nothing is lost) but delays ingestion while open.
Outside *writers* are not supported. Torchrun ranks never open the database: the task ingests the
trainer's JSONL afterwards.
"""

from __future__ import annotations

import atexit
import fcntl
import heapq
import json
import logging
import numbers
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import duckdb

from infra.files import write_atomic
from pipeline.artifact import Artifact, canonical_json, identity

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS flow_runs (
    run_id VARCHAR PRIMARY KEY, flow VARCHAR, deployment VARCHAR, recipe VARCHAR,
    config JSON, started TIMESTAMP, ended TIMESTAMP, state VARCHAR
);
CREATE TABLE IF NOT EXISTS run_attempts (
    run_id VARCHAR, attempt INTEGER, started TIMESTAMP, ended TIMESTAMP, state VARCHAR,
    PRIMARY KEY (run_id, attempt)
);
CREATE TABLE IF NOT EXISTS steps (
    run_id VARCHAR, step VARCHAR, label VARCHAR, fingerprint VARCHAR, state VARCHAR,
    config JSON, code_version VARCHAR, started TIMESTAMP, ended TIMESTAMP, seconds DOUBLE,
    error VARCHAR, attempt INTEGER
);
CREATE TABLE IF NOT EXISTS artifacts (
    fingerprint VARCHAR PRIMARY KEY, kind VARCHAR, step VARCHAR, label VARCHAR, uri VARCHAR,
    meta JSON, config JSON, created TIMESTAMP
);
CREATE TABLE IF NOT EXISTS edges (
    parent VARCHAR, child VARCHAR, PRIMARY KEY (parent, child)
);
CREATE TABLE IF NOT EXISTS metrics (
    fingerprint VARCHAR, step BIGINT, name VARCHAR, value DOUBLE
);
CREATE TABLE IF NOT EXISTS evals (
    fingerprint VARCHAR, run_id VARCHAR, task VARCHAR, metric VARCHAR, value DOUBLE,
    stderr DOUBLE, created TIMESTAMP
);
CREATE TABLE IF NOT EXISTS filter_stats (
    fingerprint VARCHAR, source VARCHAR, position INTEGER, filter VARCHAR, docs_in BIGINT,
    docs_out BIGINT, chars_in BIGINT, chars_out BIGINT, reasons JSON
);
CREATE TABLE IF NOT EXISTS preflight (
    run_id VARCHAR, check_name VARCHAR, status VARCHAR, value VARCHAR, threshold VARCHAR,
    advice VARCHAR, created TIMESTAMP
);
CREATE TABLE IF NOT EXISTS train_events (
    stage_dir VARCHAR, stage VARCHAR, run_id VARCHAR, attempt INTEGER, task_try INTEGER,
    kind VARCHAR, step BIGINT, rank INTEGER, host VARCHAR, value DOUBLE, threshold DOUBLE,
    message VARCHAR, facts JSON, created TIMESTAMP
);
CREATE TABLE IF NOT EXISTS _journal_progress (file VARCHAR PRIMARY KEY, events BIGINT);
CREATE TABLE IF NOT EXISTS _journal_rejected (
    file VARCHAR, seq BIGINT, error VARCHAR, event VARCHAR, rejected TIMESTAMP
);
"""

APPLIED_HINT = "applied.json"  # in the journal folder: lines applied per file (a hint)
RETIRE_BYTES = 1 << 20  # a fully applied journal file this big is deleted...
RETIRE_IDLE_S = 60.0  # ...or one not written for this long

_TABLES = tuple(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA))

# Columns added after a table's first release: a database made before gains them (existing rows
# read NULL there) the first time this code opens it, under the ingestion lock.
ADDED_COLUMNS = (("steps", "attempt", "INTEGER"),)  # the flow run's attempt (Prefect's run_count)
MIGRATE = "".join(f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {c} {ty};\n" for t, c, ty in ADDED_COLUMNS)

STEP_COLUMNS = "run_id, step, label, fingerprint, state, config, code_version, started, ended, seconds, error, attempt"
# Statements journaled by earlier code, still valid events: rewritten to name their columns, so an
# event written before an upgrade and ingested after it lands instead of being rejected.
LEGACY_SQL = {
    "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)": f"INSERT INTO steps ({STEP_COLUMNS.rsplit(', ', 1)[0]}) VALUES ({', '.join('?' * 11)})",
}

# States a flow run's row (and each attempt's) can end in.
RUN_STATES = frozenset({"completed", "failed", "cancelled", "crashed"})


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class StepRow:
    run_id: str
    step: str
    label: str
    fingerprint: str | None
    state: str  # completed | cached | failed | skipped | retried (failed, the next attempt runs)
    config: Any
    code_version: str
    started: datetime
    ended: datetime
    error: str | None = None
    attempt: int | None = None  # the flow run's attempt (Prefect's run_count): one row per attempt


class LineageError(RuntimeError):
    """A lineage write was refused by the database (invalid SQL or values); names the statement."""


# --- the journal: events as JSON lines ----------------------------------------------------------


def _encode(value: Any) -> Any:
    """JSON for a statement parameter; datetimes and dates are tagged so they come back typed."""
    if isinstance(value, datetime):
        return {"$dt": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)  # numpy integers are not ints
    if isinstance(value, numbers.Real) and not isinstance(value, bool | float):
        return float(value)
    raise TypeError(
        f"lineage parameter {value!r} of type {type(value).__name__} cannot be stored; "
        "pass str, int, float, bool, None, datetime, date or a list of them"
    )


def _decode(obj: dict) -> Any:
    if len(obj) == 1:
        if "$dt" in obj:
            return datetime.fromisoformat(obj["$dt"])
        if "$date" in obj:
            return date.fromisoformat(obj["$date"])
    return obj


Op = tuple[str, list[Any] | None, bool]  # (sql, params or rows, executemany?)


def _event_line(ops: Sequence[Op], event_id: str) -> bytes:
    body = {"id": event_id, "t": time.time(), "ops": [[sql, params, many] for sql, params, many in ops]}
    return (json.dumps(body, default=_encode, separators=(",", ":")) + "\n").encode()


def _parse_event(line: bytes) -> list[Op]:
    raw = json.loads(line, object_hook=_decode)
    return [(sql, params, bool(many)) for sql, params, many in raw["ops"]]


def _event_time(line: bytes) -> float:
    try:
        return float(json.loads(line).get("t", 0.0))
    except (ValueError, AttributeError):
        return 0.0


class _ProcessJournal:
    """This process's journal file in one journal folder; one per (folder, pid)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.lock = threading.Lock()
        self.path: Path | None = None

    def _new_path(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}.jsonl"
        return self.folder / name

    def append(self, line: bytes) -> Path:
        """Append one event line durably; returns the file it went to."""
        with self.lock:
            for _ in range(100):
                if self.path is None:
                    self.path = self._new_path()
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    if os.fstat(fd).st_nlink == 0:  # ingested and deleted meanwhile: a new file
                        self.path = None
                        continue
                    size = os.fstat(fd).st_size
                    try:
                        if os.write(fd, line) != len(line):
                            raise OSError(f"short write to {self.path}")
                        os.fsync(fd)
                    except BaseException:
                        os.ftruncate(fd, size)  # never leave half a line for the next event
                        raise
                    if size == 0:  # a new file: make its directory entry durable too
                        dfd = os.open(self.folder, os.O_RDONLY)
                        try:
                            os.fsync(dfd)
                        finally:
                            os.close(dfd)
                    return self.path
                finally:
                    os.close(fd)  # also releases the flock
            raise OSError(f"could not append to a journal file in {self.folder}")


_journals: dict[tuple[Path, int], _ProcessJournal] = {}
_journals_lock = threading.Lock()


def _after_fork() -> None:
    # A fork while another thread held the lock would leave the child's copy locked forever.
    global _journals_lock
    _journals_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _journal_for(folder: Path) -> _ProcessJournal:
    key = (folder, os.getpid())  # after a fork the child gets a file of its own
    with _journals_lock:
        if key not in _journals:
            _journals[key] = _ProcessJournal(folder)
        return _journals[key]


def _read_lines(path: Path) -> list[bytes]:
    """The complete lines of a journal file; a last line without its newline is still being
    written (or was cut by a crash) and is left for later."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return data.split(b"\n")[:-1]


class _Retrier:
    """One daemon thread per journal folder and process, ingesting until nothing is pending."""

    def __init__(self, lineage: LineageStore):
        self.lineage = lineage
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def kick(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, daemon=True, name=f"lineage-ingest:{self.lineage.path.name}"
                )
                self.thread.start()
            else:
                self.wake.set()  # a new event while retrying: try again now

    def _run(self) -> None:
        delay = 0.5
        while True:
            self.wake.wait(delay)
            self.wake.clear()
            try:
                landed = self.lineage._ingest()
            except Exception as exc:  # noqa: BLE001 - keep retrying; say why
                log.warning("lineage ingestion into %s failed: %s: %s", self.lineage.path, type(exc).__name__, exc)
                landed = False
            if landed:
                with self.lock:  # exit only if no event arrived since (kick holds this lock)
                    if not self.wake.is_set():
                        self.thread = None
                        return
                delay = 0.5
            else:
                delay = min(delay * 2, 5.0)


_retriers: dict[tuple[Path, int], _Retrier] = {}


def _retrier_for(lineage: LineageStore) -> _Retrier:
    key = (lineage.journal_dir, os.getpid())
    with _journals_lock:
        if key not in _retriers:
            _retriers[key] = _Retrier(lineage)
        return _retriers[key]


@atexit.register
def _ingest_before_exit() -> None:
    """A last try for events still pending at exit; what stays pending lands with the next
    process that touches the same lineage."""
    for (_, pid), retrier in list(_retriers.items()):
        if pid == os.getpid() and retrier.lineage._has_pending():
            try:
                retrier.lineage._ingest()
            except Exception:  # noqa: BLE001 - exiting; the journal keeps the events
                pass


class JournaledConnection:
    """What `Lineage.writer()` yields: `execute` / `executemany` are recorded and applied as one
    transaction when the block ends. Write-only: read with `Lineage.query` afterwards."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> JournaledConnection:
        self.ops.append((sql, list(params) if params is not None else None, False))
        return self

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> JournaledConnection:
        self.ops.append((sql, [list(r) for r in rows], True))
        return self

    def _no_reads(self, *_a, **_k):
        raise TypeError(
            "a lineage writer connection is write-only: its statements are journaled "
            "and applied when the `with` block ends; read with Lineage.query"
        )

    fetchall = fetchone = fetchdf = df = sql = _no_reads


def _is_lock_conflict(exc: BaseException) -> bool:
    """Another process holds the file (IOException), or this process has it open read-only
    elsewhere (a notebook's own connection: DuckDB refuses a second configuration)."""
    text = str(exc).lower()
    return (isinstance(exc, duckdb.IOException) and "lock" in text) or (
        isinstance(exc, duckdb.ConnectionException) and "different configuration" in text
    )


def _apply(con: duckdb.DuckDBPyConnection, ops: Sequence[Op]) -> None:
    for sql, params, many in ops:
        sql = LEGACY_SQL.get(sql, sql)
        if many:
            con.executemany(sql, params or [])
        elif params is None:
            con.execute(sql)
        else:
            con.execute(sql, params)


_CURRENT: set[str] = set()  # databases this process has seen with the current schema


def _ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create missing tables and add columns newer than the database (a no-op when current)."""
    # 11 DDL statements cost ~15 ms per connection; counting tables and columns costs ~1 ms
    present = con.execute(
        "SELECT (SELECT count(*) FROM duckdb_tables() WHERE table_name IN "
        f"({', '.join('?' * len(_TABLES))})), (SELECT count(*) FROM duckdb_columns() WHERE "
        f"{' OR '.join(['(table_name = ? AND column_name = ?)'] * len(ADDED_COLUMNS))})",
        [*_TABLES, *(x for t, c, _ in ADDED_COLUMNS for x in (t, c))],
    ).fetchone()
    if present != (len(_TABLES), len(ADDED_COLUMNS)):
        con.execute(SCHEMA + MIGRATE)


def _fetch(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any], dicts: bool) -> list:
    cur = con.execute(sql, list(params))
    rows = cur.fetchall()
    if not dicts:
        return rows
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in rows]


class LineageStore:
    """The lineage database of one workspace: the journaled write layer, the schema and read
    connections. `pipeline.lineage.queries.Lineage` adds the questions lineage answers."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self.journal_dir = self.path.with_name(self.path.name + ".journal")
        self._session: tuple[int, duckdb.DuckDBPyConnection] | None = None  # see `reading`

    @contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+") as fh:
            fcntl.flock(fh, mode)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _journal_files(self) -> list[Path]:
        try:
            return sorted(p for p in self.journal_dir.iterdir() if p.suffix == ".jsonl")
        except FileNotFoundError:
            return []

    def _applied_hint(self) -> dict[str, int]:
        """Lines applied per journal file, as the last ingester saw them after committing. A hint:
        it may lag the database (then we connect and look), never run ahead of it."""
        try:
            return json.loads((self.journal_dir / APPLIED_HINT).read_text())
        except (OSError, ValueError):
            return {}

    def _has_pending(self) -> bool:
        """Some journal line is not known to be applied (cheap: no database connection)."""
        files = self._journal_files()
        if not files:
            return False
        hint = self._applied_hint()
        for path in files:
            try:
                lines = path.read_bytes().count(b"\n")
            except FileNotFoundError:
                continue
            if lines > hint.get(path.name, 0):
                return True
        return False

    def _pending(self, progress: dict[str, int]) -> Iterator[tuple[Path, int, bytes]]:
        """(file, index, line) of every journal line not yet applied, oldest first across files
        (each file's own order is kept whatever the clocks say)."""
        per_file = []
        for path in self._journal_files():
            lines = _read_lines(path)
            done = progress.get(path.name, 0)
            per_file.append(
                [(_event_time(line), path.name, i, path, line) for i, line in enumerate(lines) if i >= done]
            )
        for _, _, i, path, line in heapq.merge(*per_file, key=lambda e: e[0]):
            yield path, i, line

    def _connect_for_ingest(self) -> duckdb.DuckDBPyConnection | None:
        """A read-write connection with the schema in place; None while another process holds
        the database file."""
        try:
            con = duckdb.connect(str(self.path))
        except duckdb.Error as exc:
            if _is_lock_conflict(exc):
                return None
            raise
        try:
            _ensure_schema(con)
        except BaseException:
            con.close()
            raise
        _CURRENT.add(str(self.path.resolve()))
        return con

    def _ingest(self) -> bool:
        """Apply pending journal events; True when nothing is left pending, False while another
        process holds the database file."""
        if not self._has_pending():
            return True
        with self._locked(fcntl.LOCK_EX):
            if not self._has_pending():  # another process ingested while we waited
                return True
            con = self._connect_for_ingest()
            if con is None:
                return False
            try:
                progress = dict(con.execute("SELECT file, events FROM _journal_progress").fetchall())
                for path, index, line in self._pending(progress):
                    try:
                        con.execute("BEGIN TRANSACTION")
                        _apply(con, _parse_event(line))
                    except (duckdb.Error, ValueError, KeyError, TypeError) as exc:
                        con.execute("ROLLBACK")
                        self._reject(con, path, index, line, f"{type(exc).__name__}: {exc}")
                        con.execute("BEGIN TRANSACTION")
                    con.execute("INSERT OR REPLACE INTO _journal_progress VALUES (?, ?)", [path.name, index + 1])
                    con.execute("COMMIT")
                    progress[path.name] = index + 1
                self._retire_files(con, progress)
            finally:
                con.close()
        return True

    def _reject(self, con, path: Path, index: int, line: bytes, error: str) -> None:
        """Keep an event the database refused (in `_journal_rejected`) and tell its writer."""
        log.error("lineage event %s#%d was rejected by %s: %s", path.name, index, self.path, error)
        con.execute(
            "INSERT INTO _journal_rejected VALUES (?, ?, ?, ?, ?)",
            [path.name, index, error, line.decode(errors="replace"), _now()],
        )
        try:
            event_id = json.loads(line)["id"]
            (self.journal_dir / f"{event_id}.rejected").write_text(error)
        except (ValueError, KeyError, TypeError, OSError):
            pass

    def _retire_files(self, con: duckdb.DuckDBPyConnection, progress: dict[str, int]) -> None:
        """Delete fully applied journal files that are big or idle (their writers start new
        ones), then save the hint. Files in use stay: recreating one per event costs fsyncs."""
        now = time.time()
        kept: dict[str, int] = {}
        for path in self._journal_files():
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # no append in flight while we decide
                st = os.fstat(fd)
                applied = progress.get(path.name, 0)
                complete = st.st_size == 0 or os.pread(fd, 1, st.st_size - 1) == b"\n"
                whole = complete and os.pread(fd, st.st_size, 0).count(b"\n") == applied
                if whole and (st.st_size >= RETIRE_BYTES or now - st.st_mtime >= RETIRE_IDLE_S):
                    path.unlink()
                else:
                    kept[path.name] = applied
            finally:
                os.close(fd)
        for marker in self.journal_dir.glob("*.rejected"):  # writers that never came back
            try:
                if now - marker.stat().st_mtime > 3600:
                    marker.unlink()
            except FileNotFoundError:
                pass
        gone = [[name] for name in progress if name not in kept]
        if gone:
            con.executemany("DELETE FROM _journal_progress WHERE file = ?", gone)
        write_atomic(self.journal_dir / APPLIED_HINT, json.dumps(kept))

    def _write(self, ops: Sequence[Op]) -> None:
        """Journal, then try to ingest; a held database file leaves the event pending (retried)."""
        if not ops:
            return
        event_id = uuid.uuid4().hex
        _journal_for(self.journal_dir).append(_event_line(ops, event_id))
        try:
            landed = self._ingest()
        except Exception as exc:  # noqa: BLE001 - the event is safe in the journal
            log.warning(
                "lineage ingestion into %s failed (%s: %s); retrying in the background",
                self.path,
                type(exc).__name__,
                exc,
            )
            landed = False
        if not landed:
            _retrier_for(self).kick()
            return
        marker = self.journal_dir / f"{event_id}.rejected"
        if marker.exists():
            error = marker.read_text()
            marker.unlink(missing_ok=True)
            raise LineageError(f"lineage write to {self.path} was rejected: {error} (kept in table _journal_rejected)")

    @contextmanager
    def writer(self) -> Iterator[JournaledConnection]:
        """Statements executed on the yielded connection are applied as one transaction when the
        block ends without an exception (and dropped if it raises)."""
        con = JournaledConnection()
        yield con
        self._write(con.ops)

    def _schema_current(self) -> bool:
        """The database has this code's tables and columns (brought up to date once per process;
        False while an outside process holds the file and it still lacks some)."""
        key = str(self.path.resolve())
        if key in _CURRENT:
            return True
        with self._locked(fcntl.LOCK_EX):
            con = self._connect_for_ingest()  # adds what is missing
        if con is None:
            return False
        con.close()
        return True

    def _read(self, sql: str, params: Sequence[Any], dicts: bool) -> list:
        session = self._session
        if session is not None and session[0] == threading.get_ident():  # inside `reading()`
            return _fetch(session[1], sql, params, dicts)
        if self._has_pending():
            try:
                landed = self._ingest()
            except Exception:  # noqa: BLE001 - e.g. no write permission: read a snapshot
                landed = False
            if not landed:  # events pending: read them from a private copy
                return self.snapshot_query(sql, params, dicts=dicts)
        if not self.path.exists():
            return []
        try:
            current = self._schema_current()
        except Exception:  # noqa: BLE001 - e.g. no write permission: a copy brought up to date
            current = False
        if not current:
            return self.snapshot_query(sql, params, dicts=dicts)
        with self._locked(fcntl.LOCK_SH):
            con = duckdb.connect(str(self.path), read_only=True)
            try:
                return _fetch(con, sql, params, dicts)
            finally:
                con.close()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Rows of a read-only query, including every write made so far; an absent database
        reads as empty."""
        return self._read(sql, params, dicts=False)

    def query_dicts(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return self._read(sql, params, dicts=True)

    @contextmanager
    def snapshot(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection to a private, consistent copy of the lineage (pending journal events
        applied); never blocks writers. For notebooks and `smollm3 sql`:

            with Lineage("workspace/lineage.duckdb").snapshot() as con:
                con.sql("SELECT * FROM flow_runs").df()
        """
        tmp = Path(tempfile.mkdtemp(prefix="lineage-snapshot-"))
        try:
            copy = tmp / "lineage.duckdb"
            with self._locked(fcntl.LOCK_SH):  # no ingestion runs while we copy
                if self.path.exists():
                    shutil.copyfile(self.path, copy)
                    wal = self.path.with_name(self.path.name + ".wal")
                    if wal.exists():
                        shutil.copyfile(wal, copy.with_name(copy.name + ".wal"))
                files = {p: _read_lines(p) for p in self._journal_files()}
            con = duckdb.connect(str(copy))
            try:
                _ensure_schema(con)
                progress = dict(con.execute("SELECT file, events FROM _journal_progress").fetchall())
                per_file = [
                    [
                        (_event_time(line), p.name, i, line)
                        for i, line in enumerate(lines)
                        if i >= progress.get(p.name, 0)
                    ]
                    for p, lines in files.items()
                ]
                for *_, line in heapq.merge(*per_file, key=lambda e: e[0]):
                    try:
                        con.execute("BEGIN TRANSACTION")
                        _apply(con, _parse_event(line))
                        con.execute("COMMIT")
                    except (duckdb.Error, ValueError, KeyError, TypeError):
                        con.execute("ROLLBACK")  # ingestion will reject it too
                yield con
            finally:
                con.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def snapshot_query(self, sql: str, params: Sequence[Any] = (), *, dicts: bool = True) -> list:
        """`sql` on a private copy (see `snapshot`): what `smollm3 sql` runs."""
        with self.snapshot() as con:
            return _fetch(con, sql, params, dicts)

    def start_run(
        self,
        run_id: str,
        flow: str,
        deployment: str | None,
        recipe: str,
        config: Any,
        *,
        attempt: int | None = None,
    ) -> None:
        """Record the start of an attempt of a flow run (`attempt`: Prefect's run_count; None
        numbers it after the last recorded one). The run's row keeps its first start time. An
        earlier attempt still `running` lost its process without a word (SIGKILL, a lost node):
        it is marked `crashed`, its end unknown (NULL)."""
        now = _now()
        self._write(
            [
                (
                    "UPDATE run_attempts SET state = 'crashed' WHERE run_id = ? AND state = 'running' "
                    "AND attempt IS DISTINCT FROM ?",
                    [run_id, attempt],
                    False,
                ),
                (
                    "INSERT INTO flow_runs VALUES (?, ?, ?, ?, ?, ?, NULL, 'running') "
                    "ON CONFLICT (run_id) DO UPDATE SET flow = excluded.flow, "
                    "deployment = excluded.deployment, recipe = excluded.recipe, "
                    "config = excluded.config, ended = NULL, state = 'running'",
                    [run_id, flow, deployment, recipe, canonical_json(config), now],
                    False,
                ),
                (
                    "INSERT OR REPLACE INTO run_attempts SELECT ?, coalesce(?, (SELECT "
                    "coalesce(max(attempt), 0) + 1 FROM run_attempts WHERE run_id = ?)), ?, NULL, "
                    "'running'",
                    [run_id, attempt, run_id, now],
                    False,
                ),
            ]
        )

    def end_run(self, run_id: str, state: str, *, attempt: int | None = None) -> None:
        """Record how an attempt ended (`state`: completed, failed, cancelled or crashed); None
        `attempt` means the latest one."""
        if state not in RUN_STATES:
            raise ValueError(f"flow run state {state!r} is not one of {sorted(RUN_STATES)}")
        now = _now()
        self._write(
            [
                ("UPDATE flow_runs SET ended = ?, state = ? WHERE run_id = ?", [now, state, run_id], False),
                (
                    "UPDATE run_attempts SET ended = ?, state = ? WHERE run_id = ? AND attempt = "
                    "coalesce(?, (SELECT max(attempt) FROM run_attempts WHERE run_id = ?))",
                    [now, state, run_id, attempt, run_id],
                    False,
                ),
            ]
        )

    def record_step(self, row: StepRow) -> None:
        """One step's state in one attempt of a run (completed, cached, failed or skipped)."""
        with self.writer() as con:
            con.execute(
                f"INSERT INTO steps ({STEP_COLUMNS}) VALUES ({', '.join('?' * 12)})",
                [
                    row.run_id,
                    row.step,
                    row.label,
                    row.fingerprint,
                    row.state,
                    canonical_json(row.config),
                    row.code_version,
                    row.started,
                    row.ended,
                    (row.ended - row.started).total_seconds(),
                    row.error,
                    row.attempt,
                ],
            )

    def record_artifact(
        self,
        artifact: Artifact,
        step: str,
        label: str,
        config: Any,
        parents: Iterable[Artifact] = (),
    ) -> None:
        """Insert an artifact and its input edges; recording the same artifact twice is a no-op.
        The config column holds what the fingerprint hashed (operational fields left out)."""
        with self.writer() as con:
            con.execute(
                "INSERT OR IGNORE INTO artifacts VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    artifact.fingerprint,
                    artifact.kind,
                    step,
                    label,
                    artifact.uri,
                    canonical_json(artifact.meta),
                    canonical_json(identity(config)),
                    _now(),
                ],
            )
            for parent in parents:
                con.execute(
                    "INSERT OR IGNORE INTO edges VALUES (?, ?)",
                    [parent.fingerprint, artifact.fingerprint],
                )

    def record_rows(self, table: str, rows: Sequence[Sequence[Any]]) -> None:
        """Append rows to one of the schema's fact tables (metrics, evals, filter_stats, ...)."""
        if table not in {"metrics", "evals", "filter_stats", "preflight", "train_events"}:
            raise ValueError(f"unknown lineage table {table!r}")
        if not rows:
            return
        width = len(rows[0])
        with self.writer() as con:
            con.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * width)})", [list(r) for r in rows])

    def record_experiment(
        self, experiment: dict[str, Any], runs: Sequence[dict[str, Any]], results: Sequence[dict[str, Any]]
    ) -> None:
        """One experiment's rows, replacing any earlier ones of the same experiment id (a rebuilt
        comparison), in one transaction: `experiment` is a row of `experiments`, `runs` rows of
        `experiment_runs` (every score of every run at every evaluated step) and `results` rows of
        `experiment_results` (each variant vs the baseline per task); see EXPERIMENT_SCHEMA."""
        exp_id = experiment["experiment"]
        with self.writer() as con:
            con.execute(EXPERIMENT_SCHEMA)
            for table, rows in (
                ("experiments", [experiment]),
                ("experiment_runs", runs),
                ("experiment_results", results),
            ):
                columns = EXPERIMENT_COLUMNS[table]
                con.execute(f"DELETE FROM {table} WHERE experiment = ?", [exp_id])
                bad = [sorted(set(r) ^ set(columns)) for r in rows if set(r) != set(columns)]
                if bad:
                    raise ValueError(f"{table} row columns differ from the table's: {bad[0]}")
                if rows:
                    con.executemany(
                        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                        [[r[c] for c in columns] for r in rows],
                    )

    def _has_experiments(self) -> bool:
        return bool(self.query("SELECT 1 FROM information_schema.tables WHERE table_name = 'experiments'"))

    @contextmanager
    def reading(self) -> Iterator[LineageStore]:
        """Reads made in this block by this thread share one connection: a view that asks a
        hundred small questions (a lineage tree, a run listing) opens the database once instead
        of once per question (~50 ms each). Pending journal events are ingested first, or, while
        an outside process holds the file, read from a private copy (`snapshot`). The open
        connection holds DuckDB's read lock like an outside reader: writes made meanwhile are
        journaled at once and land when the block ends (the background retry), so keep a block to
        one view."""
        if self._has_pending():
            try:
                landed = self._ingest()
            except Exception:  # noqa: BLE001 - e.g. no write permission: read a snapshot
                landed = False
            if not landed:
                with self.snapshot() as con:
                    self._session = (threading.get_ident(), con)
                    try:
                        yield self
                    finally:
                        self._session = None
                return
        if not self.path.exists():
            yield self  # nothing recorded yet: every read is empty, as outside a session
            return
        with self._locked(fcntl.LOCK_SH):  # not while an ingestion is applying events
            con = duckdb.connect(str(self.path), read_only=True)
        self._session = (threading.get_ident(), con)
        try:
            yield self
        finally:
            self._session = None
            con.close()


# Experiment tables (evals/experiments.py), as (column, type); created on first use.
EXPERIMENT_TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    # one row per experiment: what was compared and which eval tasks the comparison trusts
    "experiments": (
        ("experiment", "VARCHAR"),
        ("run_id", "VARCHAR"),
        ("kind", "VARCHAR"),
        ("name", "VARCHAR"),
        ("baseline", "VARCHAR"),
        ("variants", "JSON"),
        ("seeds", "JSON"),
        ("confidence", "DOUBLE"),
        ("trusted", "JSON"),
        ("quality", "JSON"),
        ("base_checkpoint", "VARCHAR"),
        ("base_global_step", "BIGINT"),
        ("created", "TIMESTAMP"),
    ),
    # every score of every run (variant x seed) at every evaluated step
    "experiment_runs": (
        ("experiment", "VARCHAR"),
        ("label", "VARCHAR"),
        ("variant", "VARCHAR"),
        ("seed", "INTEGER"),
        ("task", "VARCHAR"),
        ("metric", "VARCHAR"),
        ("step", "BIGINT"),
        ("value", "DOUBLE"),
        ("stderr", "DOUBLE"),
        ("eval_fingerprint", "VARCHAR"),
    ),
    # each variant vs the baseline per task: difference, seed noise, confidence interval, verdict
    "experiment_results": (
        ("experiment", "VARCHAR"),
        ("variant", "VARCHAR"),
        ("task", "VARCHAR"),
        ("metric", "VARCHAR"),
        ("better", "VARCHAR"),
        ("baseline", "DOUBLE"),
        ("score", "DOUBLE"),
        ("delta", "DOUBLE"),
        ("seed_std", "DOUBLE"),
        ("df", "INTEGER"),
        ("ci_low", "DOUBLE"),
        ("ci_high", "DOUBLE"),
        ("p_value", "DOUBLE"),
        ("significant", "BOOLEAN"),
        ("improved", "BOOLEAN"),
        ("stderr", "DOUBLE"),
        ("trusted", "BOOLEAN"),
        ("why", "VARCHAR"),
        ("verdict", "VARCHAR"),
        ("baseline_runs", "INTEGER"),
        ("variant_runs", "INTEGER"),
        ("created", "TIMESTAMP"),
    ),
}


EXPERIMENT_COLUMNS = {t: tuple(c for c, _ in cols) for t, cols in EXPERIMENT_TABLES.items()}


EXPERIMENT_SCHEMA = "\n".join(
    f"CREATE TABLE IF NOT EXISTS {t} ({', '.join(f'{c} {kind}' for c, kind in cols)});"
    for t, cols in EXPERIMENT_TABLES.items()
)
