"""The lineage store: one DuckDB file per workspace recording runs, steps, artifacts and their edges.

DuckDB allows a single read-write process per file, while several processes touch this one (the
serve process, parallel flow runs, CLI readers) and processes outside this project may open it too
(a notebook, the `duckdb` CLI). A plain `duckdb.connect(path, read_only=True)` elsewhere takes
DuckDB's own file lock and ignores ours; while it is held no process can write the file.

So writes never go to the database directly. Each write is one *event*, the typed operations of
one transaction (an insert of rows into a named table and columns, a delete of an experiment's
rows, or one of the fixed run statements of `STATEMENTS`, with their values), appended as one
JSON line to this process's journal file in `lineage.duckdb.journal/` and fsynced, then
*ingested*: under an exclusive `fcntl.flock` on `lineage.duckdb.lock`, every journal line not yet
applied is applied in its own DuckDB transaction, together with a per-file counter of applied
lines (`_journal_progress`), so an event is applied exactly once even if an ingester dies midway.
Fully applied journal files are deleted. When the database file is held by another process,
ingestion simply stops; the events stay in the journal and a background thread in every writing
process retries (0.5 s, doubling to 5 s) until they land. A write therefore fails only if its
journal line cannot be written (disk full) or its values are refused (the event is then kept in
`_journal_rejected` and the writer gets the error).

The journal is workspace data, not code: a line is turned into fixed, parameterised statements
whose every table and column name comes from this module's schema (`_compile`); a line holding
anything else (SQL text, an unknown table or column, a nested value) is rejected, kept and counted
in `_journal_rejected`, never executed.
Our connections also refuse every file system access beyond the database itself (`CONNECT`: no
COPY, ATTACH, read_csv, extension downloads), whatever a planted view asks for.

Reads see everything written, even while ingestion is blocked:
- nothing pending: a read-only connection under a shared flock (the fast path);
- events pending and the file held by an outside reader: the read runs on a private copy of the
  database with the pending events applied (`snapshot`), taken under the shared flock. Outside
  readers see the database as of the last ingestion, without the pending events.

A view (`LineageStore(path, read_only=True)`: `smollm3 summary`, `runs`, `lineage`, `sql`,
`report`, `experiments`) writes nothing in the workspace: no ingestion, no migration, no lock
file; it reads pending events from a private copy.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import duckdb

from infra.files import write_atomic
from pipeline.artifact import WORKSPACE, Artifact, canonical_json, identity, stored
from pipeline.lineage.bounds import check_line, within_bounds

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
-- what a data step flagged about its output (a source that kept far less than its preset keeps
-- on natural text, naming the filter that removed the most)
CREATE TABLE IF NOT EXISTS data_events (
    fingerprint VARCHAR, source VARCHAR, kind VARCHAR, value DOUBLE, threshold DOUBLE,
    message VARCHAR, facts JSON, created TIMESTAMP
);
CREATE TABLE IF NOT EXISTS train_events (
    stage_dir VARCHAR, stage VARCHAR, run_id VARCHAR, attempt INTEGER, task_try INTEGER,
    kind VARCHAR, step BIGINT, rank INTEGER, host VARCHAR, value DOUBLE, threshold DOUBLE,
    message VARCHAR, facts JSON, created TIMESTAMP
);
-- experiments (evals/experiments.py): one row per experiment, what was compared and which eval
-- tasks the comparison trusts
CREATE TABLE IF NOT EXISTS experiments (
    experiment VARCHAR, run_id VARCHAR, kind VARCHAR, name VARCHAR, baseline VARCHAR, variants JSON,
    seeds JSON, confidence DOUBLE, trusted JSON, quality JSON, base_checkpoint VARCHAR,
    base_global_step BIGINT, created TIMESTAMP
);
-- every score of every run (variant x seed) at every evaluated step
CREATE TABLE IF NOT EXISTS experiment_runs (
    experiment VARCHAR, label VARCHAR, variant VARCHAR, seed INTEGER, task VARCHAR, metric VARCHAR,
    step BIGINT, value DOUBLE, stderr DOUBLE, eval_fingerprint VARCHAR
);
-- each variant vs the baseline per task: difference, seed noise, confidence interval, verdict
CREATE TABLE IF NOT EXISTS experiment_results (
    experiment VARCHAR, variant VARCHAR, task VARCHAR, metric VARCHAR, better VARCHAR,
    baseline DOUBLE, score DOUBLE, delta DOUBLE, seed_std DOUBLE, df INTEGER, ci_low DOUBLE,
    ci_high DOUBLE, p_value DOUBLE, significant BOOLEAN, improved BOOLEAN, stderr DOUBLE,
    trusted BOOLEAN, why VARCHAR, verdict VARCHAR, baseline_runs INTEGER, variant_runs INTEGER,
    created TIMESTAMP
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


def _table_columns(schema: str) -> dict[str, tuple[str, ...]]:
    """Each table's columns in order, read from this module's own DDL."""
    out = {}
    for name, body in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\);", schema, re.S):
        body = re.sub(r"PRIMARY KEY \([^)]*\)", "", body)
        out[name] = tuple(part.split()[0] for part in body.split(",") if part.strip())
    return out


COLUMNS = _table_columns(SCHEMA)
EXPERIMENT_COLUMNS = {t: COLUMNS[t] for t in ("experiments", "experiment_runs", "experiment_results")}
# What a journal operation may insert into (flow_runs and run_attempts change through STATEMENTS
# only; the journal's own tables never through the journal).
INSERT_TABLES = frozenset(
    {"steps", "artifacts", "edges", "metrics", "evals", "filter_stats", "preflight", "train_events", "data_events"}
) | set(EXPERIMENT_COLUMNS)
IGNORE_TABLES = frozenset({"artifacts", "edges"})  # recording the same artifact or edge again is a no-op
# The fixed statements of a flow run's life, by name: (SQL, number of parameters).
STATEMENTS: dict[str, tuple[str, int]] = {
    "attempts_crashed": (
        "UPDATE run_attempts SET state = 'crashed' WHERE run_id = ? AND state = 'running' "
        "AND attempt IS DISTINCT FROM ?",
        2,
    ),
    "run_started": (
        "INSERT INTO flow_runs VALUES (?, ?, ?, ?, ?, ?, NULL, 'running') "
        "ON CONFLICT (run_id) DO UPDATE SET flow = excluded.flow, "
        "deployment = excluded.deployment, recipe = excluded.recipe, "
        "config = excluded.config, ended = NULL, state = 'running'",
        6,
    ),
    "attempt_started": (
        "INSERT OR REPLACE INTO run_attempts SELECT ?, coalesce(?, (SELECT "
        "coalesce(max(attempt), 0) + 1 FROM run_attempts WHERE run_id = ?)), ?, NULL, "
        "'running'",
        4,
    ),
    "run_ended": ("UPDATE flow_runs SET ended = ?, state = ? WHERE run_id = ?", 3),
    "attempt_ended": (
        "UPDATE run_attempts SET ended = ?, state = ? WHERE run_id = ? AND attempt = "
        "coalesce(?, (SELECT max(attempt) FROM run_attempts WHERE run_id = ?))",
        5,
    ),
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


# A journal operation is data: {"op": "insert", "table", "columns", "rows", "ignore"},
# {"op": "delete", "table", "column", "value"} (experiment rows, by experiment id) or
# {"op": "statement", "name", "params"} (one of STATEMENTS). `_compile` turns one into a fixed,
# parameterised statement whose every identifier comes from this module's schema; anything else
# raises JournalRejected. Values are scalars only.
Op = dict[str, Any]
Statement = tuple[str, list[Any], bool]  # (sql, params or rows, executemany?)
SCALARS = (str, int, float, bool, type(None), datetime, date)


class JournalRejected(ValueError):
    """A journal line that is not a well-formed typed operation on our schema."""


def _plain(value: Any) -> Any:
    """numpy numbers as Python ones (a journal value is a JSON scalar)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool | int):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool | int | float):
        return float(value)
    return value


def _scalars(values: Any, where: str) -> list[Any]:
    if not isinstance(values, list) or not all(isinstance(v, SCALARS) for v in values):
        raise JournalRejected(f"{where}: values must be a list of str, int, float, bool, null, datetime or date")
    return values


def _compile(op: Any) -> Statement:
    """The fixed statement a typed operation stands for; JournalRejected for anything else."""
    kind = op.get("op") if isinstance(op, dict) else None
    if kind == "insert" and set(op) == {"op", "table", "columns", "rows", "ignore"}:
        table, columns, rows = op["table"], op["columns"], op["rows"]
        if table not in INSERT_TABLES:
            raise JournalRejected(f"insert into {table!r}: not a lineage table one may insert into")
        known = COLUMNS[table]
        if not isinstance(columns, list) or not columns or len(set(map(str, columns))) != len(columns):
            raise JournalRejected(f"insert into {table}: columns must be a non-empty list without repeats")
        unknown = [c for c in columns if c not in known]
        if unknown:
            raise JournalRejected(f"insert into {table}: unknown column(s) {unknown}; columns: {', '.join(known)}")
        if op["ignore"] is not False and not (op["ignore"] is True and table in IGNORE_TABLES):
            raise JournalRejected(f"insert into {table}: 'ignore' is only for {sorted(IGNORE_TABLES)}")
        if not isinstance(rows, list) or not rows:
            raise JournalRejected(f"insert into {table}: rows must be a non-empty list")
        for row in rows:
            if len(_scalars(row, f"insert into {table}")) != len(columns):
                raise JournalRejected(f"insert into {table}: a row has {len(row)} values for {len(columns)} columns")
        names = [known[known.index(c)] for c in columns]  # our own spelling of each identifier
        verb = "INSERT OR IGNORE" if op["ignore"] else "INSERT"
        sql = f"{verb} INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        return sql, rows, True
    if kind == "delete" and set(op) == {"op", "table", "column", "value"}:
        if op["table"] not in EXPERIMENT_COLUMNS or op["column"] != "experiment":
            raise JournalRejected("delete: only experiment rows, by their experiment id")
        _scalars([op["value"]], "delete")
        return f"DELETE FROM {op['table']} WHERE experiment = ?", [op["value"]], False
    if kind == "statement" and set(op) == {"op", "name", "params"}:
        if op["name"] not in STATEMENTS:
            raise JournalRejected(f"statement {op['name']!r}: not one of {', '.join(STATEMENTS)}")
        sql, count = STATEMENTS[op["name"]]
        if len(_scalars(op["params"], f"statement {op['name']}")) != count:
            raise JournalRejected(f"statement {op['name']}: {len(op['params'])} parameters for {count}")
        return sql, op["params"], False
    raise JournalRejected(f"not a lineage operation: {str(op)[:200]}")


def _event_line(ops: Sequence[Op], event_id: str) -> bytes:
    body = {"id": event_id, "t": time.time(), "ops": list(ops)}
    return (json.dumps(body, default=_encode, separators=(",", ":")) + "\n").encode()


def _parse_event(line: bytes) -> list[Statement]:
    """The statements of one journal line, every one of them fixed here (JournalRejected else;
    JournalLineOutOfBounds for a line too long or too deep to parse: lineage/bounds.py)."""
    check_line(line)
    try:
        raw = json.loads(line, object_hook=_decode)
    except ValueError as exc:
        raise JournalRejected(f"not JSON: {exc}") from None
    ops = raw.get("ops") if isinstance(raw, dict) else None
    if not isinstance(ops, list) or not ops:
        raise JournalRejected("an event holds a non-empty list of operations")
    return [_compile(op) for op in ops]


def _event_time(line: bytes) -> float:
    if not within_bounds(line):
        return 0.0  # rejected when its turn comes
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


class JournalWriter:
    """What `LineageStore.writer()` yields: typed operations, applied as one transaction when the
    block ends. Write-only: read with `query` afterwards."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def _add(self, op: Op) -> JournalWriter:
        _compile(op)  # a bad write fails here, naming the table or column, before it is journaled
        self.ops.append(op)
        return self

    def insert(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, ignore: bool = False):
        plain = [[_plain(v) for v in r] for r in rows]
        if not plain:
            return self
        return self._add({"op": "insert", "table": table, "columns": list(columns), "rows": plain, "ignore": ignore})

    def delete_experiment(self, table: str, experiment: str):
        return self._add({"op": "delete", "table": table, "column": "experiment", "value": _plain(experiment)})

    def statement(self, name: str, params: Sequence[Any]):
        return self._add({"op": "statement", "name": name, "params": [_plain(v) for v in params]})


def _is_lock_conflict(exc: BaseException) -> bool:
    """Another process holds the file (IOException), or this process has it open read-only
    elsewhere (a notebook's own connection: DuckDB refuses a second configuration)."""
    text = str(exc).lower()
    return (isinstance(exc, duckdb.IOException) and "lock" in text) or (
        isinstance(exc, duckdb.ConnectionException) and "different configuration" in text
    )


def _apply(con: duckdb.DuckDBPyConnection, statements: Sequence[Statement]) -> None:
    for sql, params, many in statements:
        if many:
            con.executemany(sql, params)
        else:
            con.execute(sql, params)


# Our connections touch no file but the database: no COPY, ATTACH, read_csv or extension
# downloads, whatever a planted view or journal line asks for.
CONNECT = {"enable_external_access": False, "autoinstall_known_extensions": False, "autoload_known_extensions": False}


def _connect(path: Path | str, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    return duckdb.connect(str(path), read_only=read_only, config=dict(CONNECT))


def _ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create the tables this code's schema has and the database lacks (a no-op when current)."""
    # the DDL statements cost ~15 ms per connection; counting the tables costs ~1 ms
    (present,) = con.execute(
        f"SELECT count(*) FROM duckdb_tables() WHERE table_name IN ({', '.join('?' * len(_TABLES))})", list(_TABLES)
    ).fetchone()
    if present != len(_TABLES):
        con.execute(SCHEMA)


def _apply_pending(
    con: duckdb.DuckDBPyConnection,
    files: dict[str, list[bytes]],
    rejected: Callable[[str, int, bytes, str], object] = lambda *_: None,
) -> dict[str, int]:
    """Apply every journal line of `files` (name -> complete lines) not yet counted in
    `_journal_progress`, oldest first across files (each file's own order kept whatever the clocks
    say), each in one transaction with its file's counter: exactly once, even if the process dies
    midway. A line the schema or the database refuses is rolled back and kept in
    `_journal_rejected` instead (`rejected(file, index, line, error)` is told). Returns the counts."""
    progress = dict(con.execute("SELECT file, events FROM _journal_progress").fetchall())
    per_file = [
        [(_event_time(line), name, i, line) for i, line in enumerate(lines) if i >= progress.get(name, 0)]
        for name, lines in files.items()
    ]
    for _, name, index, line in heapq.merge(*per_file, key=lambda e: e[0]):
        con.execute("BEGIN TRANSACTION")
        try:
            _apply(con, _parse_event(line))
        except (duckdb.Error, ValueError, KeyError, TypeError) as exc:
            con.execute("ROLLBACK")
            error = f"{type(exc).__name__}: {exc}"
            con.execute("BEGIN TRANSACTION")
            con.execute(
                "INSERT INTO _journal_rejected VALUES (?, ?, ?, ?, ?)",
                [name, index, error[:2000], line.decode(errors="replace")[:20000], _now()],
            )
            rejected(name, index, line, error)
        con.execute("INSERT OR REPLACE INTO _journal_progress VALUES (?, ?)", [name, index + 1])
        con.execute("COMMIT")
        progress[name] = index + 1
    return progress


def _fetch(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any], dicts: bool, root: Path) -> list:
    """Rows of a query, with the workspace's paths (stored as `{workspace}/REL`) under `root`."""
    cur = con.execute(sql, list(params))
    rows = [tuple(_located(v, root) for v in row) for row in cur.fetchall()]
    if not dicts:
        return rows
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in rows]


def _located(value: Any, root: Path) -> Any:
    """A stored value with `{workspace}` made `root`: a path column, or paths inside JSON text."""
    if not isinstance(value, str) or WORKSPACE not in value:
        return value
    if value == WORKSPACE or value.startswith(WORKSPACE + "/"):
        return str(root) + value[len(WORKSPACE) :]
    return value.replace(f'"{WORKSPACE}', '"' + json.dumps(str(root))[1:-1])


class LineageStore:
    """The lineage database of one workspace: the journaled write layer, the schema and read
    connections. `pipeline.lineage.queries.Lineage` adds the questions lineage answers."""

    def __init__(self, path: Path | str, *, read_only: bool = False):
        self.path = Path(path)
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self.journal_dir = self.path.with_name(self.path.name + ".journal")
        self._session: tuple[int, duckdb.DuckDBPyConnection] | None = None  # see `reading`
        # A view's lineage (`smollm3 summary`, `runs`, `lineage`, `sql`): it writes nothing in the
        # workspace (no ingestion, no migration, no lock file); pending events and an older
        # schema are read from a private copy (`snapshot`).
        self.read_only = read_only
        # The workspace this lineage belongs to: paths under it are stored relative to it
        # (`{workspace}/REL`, pipeline.artifact.stored), so a moved workspace's lineage follows it.
        self.root = self.path.parent.resolve()

    @contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        if self.read_only:
            if not self._lock_path.exists():  # nobody ever wrote here: nothing to wait for
                yield
                return
            with open(self._lock_path) as fh:
                fcntl.flock(fh, mode)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
            return
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

    def _connect_for_ingest(self) -> duckdb.DuckDBPyConnection | None:
        """A read-write connection with the schema in place; None while another process holds
        the database file."""
        try:
            con = _connect(self.path)
        except duckdb.Error as exc:
            if _is_lock_conflict(exc):
                return None
            raise
        try:
            _ensure_schema(con)
        except BaseException:
            con.close()
            raise
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
                files = {p.name: _read_lines(p) for p in self._journal_files()}
                self._retire_files(con, _apply_pending(con, files, self._rejected))
            finally:
                con.close()
        return True

    def _rejected(self, file: str, index: int, line: bytes, error: str) -> None:
        """An event was refused (kept in `_journal_rejected`): say so, and tell its writer."""
        log.error("lineage event %s#%d was rejected by %s: %s", file, index, self.path, error)
        try:
            event_id = json.loads(line)["id"] if within_bounds(line) else None
            if isinstance(event_id, str) and re.fullmatch(r"[0-9a-f]{32}", event_id):  # ours: a uuid4 hex
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
        if self.read_only:
            raise LineageError(f"lineage {self.path} was opened read-only (a view); it records nothing")
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
    def writer(self) -> Iterator[JournalWriter]:
        """Operations added to the yielded writer are applied as one transaction when the block
        ends without an exception (and dropped if it raises)."""
        ops = JournalWriter()
        yield ops
        self._write(ops.ops)

    def _fresh(self) -> bool:
        """Whether reads may go to the database file itself: it holds every journaled write
        (ingested now if need be), or nothing was ever recorded. False while pending events
        cannot land (an outside process holds the file, no write permission) and, for a read-only
        store, whenever events are pending: reads then go to a private copy (`snapshot`)."""
        if self.read_only:
            if not self.path.exists():
                return not self._journal_files()
            return not self._has_pending()
        if not self._has_pending():
            return True
        try:
            return self._ingest()
        except Exception:  # noqa: BLE001 - e.g. no write permission: read a snapshot
            return False

    def _read(self, sql: str, params: Sequence[Any], dicts: bool) -> list:
        session = self._session
        if session is not None and session[0] == threading.get_ident():  # inside `reading()`
            return _fetch(session[1], sql, params, dicts, self.root)
        if not self._fresh():
            return self.snapshot_query(sql, params, dicts=dicts)
        if not self.path.exists():
            return []
        return self._read_database(sql, params, dicts)

    def _read_database(self, sql: str, params: Sequence[Any], dicts: bool) -> list:
        """The query on the database file itself, read-only under the shared lock."""
        with self._locked(fcntl.LOCK_SH):
            con = _connect(self.path, read_only=True)
            try:
                return _fetch(con, sql, params, dicts, self.root)
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
                files = {p.name: _read_lines(p) for p in self._journal_files()}
            con = _connect(copy)
            try:
                _ensure_schema(con)
                _apply_pending(con, files)  # what ingestion rejects is rejected and counted here too
                yield con
            finally:
                con.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def snapshot_query(self, sql: str, params: Sequence[Any] = (), *, dicts: bool = True) -> list:
        """`sql` on a private copy (see `snapshot`): what `smollm3 sql` runs."""
        with self.snapshot() as con:
            return _fetch(con, sql, params, dicts, self.root)

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
        with self.writer() as ops:
            ops.statement("attempts_crashed", [run_id, attempt])
            config = stored(json.loads(canonical_json(config)), self.root)
            ops.statement("run_started", [run_id, flow, deployment, recipe, canonical_json(config), now])
            ops.statement("attempt_started", [run_id, attempt, run_id, now])

    def end_run(self, run_id: str, state: str, *, attempt: int | None = None) -> None:
        """Record how an attempt ended (`state`: completed, failed, cancelled or crashed); None
        `attempt` means the latest one."""
        if state not in RUN_STATES:
            raise ValueError(f"flow run state {state!r} is not one of {sorted(RUN_STATES)}")
        now = _now()
        with self.writer() as ops:
            ops.statement("run_ended", [now, state, run_id])
            ops.statement("attempt_ended", [now, state, run_id, attempt, run_id])

    def record_step(self, row: StepRow) -> None:
        """One step's state in one attempt of a run (completed, cached, failed or skipped)."""
        with self.writer() as ops:
            ops.insert(
                "steps",
                COLUMNS["steps"],
                [
                    [
                        row.run_id,
                        row.step,
                        row.label,
                        row.fingerprint,
                        row.state,
                        canonical_json(stored(json.loads(canonical_json(row.config)), self.root)),
                        row.code_version,
                        row.started,
                        row.ended,
                        (row.ended - row.started).total_seconds(),
                        row.error,
                        row.attempt,
                    ]
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
        with self.writer() as ops:
            ops.insert(
                "artifacts",
                COLUMNS["artifacts"],
                [
                    [
                        artifact.fingerprint,
                        artifact.kind,
                        step,
                        label,
                        stored(artifact.uri, self.root),
                        canonical_json(stored(artifact.meta, self.root)),
                        canonical_json(stored(identity(config), self.root)),
                        _now(),
                    ]
                ],
                ignore=True,
            )
            edges = [[parent.fingerprint, artifact.fingerprint] for parent in parents]
            ops.insert("edges", COLUMNS["edges"], edges, ignore=True)

    def record_rows(self, table: str, rows: Sequence[Sequence[Any]]) -> None:
        """Append rows to one of the schema's fact tables (metrics, evals, filter_stats, ...)."""
        if table not in {"metrics", "evals", "filter_stats", "preflight", "train_events", "data_events"}:
            raise ValueError(f"unknown lineage table {table!r}")
        if not rows:
            return
        with self.writer() as ops:
            ops.insert(table, COLUMNS[table], rows)

    def record_experiment(
        self, experiment: dict[str, Any], runs: Sequence[dict[str, Any]], results: Sequence[dict[str, Any]]
    ) -> None:
        """One experiment's rows, replacing any earlier ones of the same experiment id (a rebuilt
        comparison), in one transaction: `experiment` is a row of `experiments`, `runs` rows of
        `experiment_runs` (every score of every run at every evaluated step) and `results` rows of
        `experiment_results` (each variant vs the baseline per task); see SCHEMA."""
        exp_id = experiment["experiment"]
        with self.writer() as ops:
            for table, rows in (
                ("experiments", [experiment]),
                ("experiment_runs", runs),
                ("experiment_results", results),
            ):
                columns = EXPERIMENT_COLUMNS[table]
                ops.delete_experiment(table, exp_id)
                bad = [sorted(set(r) ^ set(columns)) for r in rows if set(r) != set(columns)]
                if bad:
                    raise ValueError(f"{table} row columns differ from the table's: {bad[0]}")
                ops.insert(table, columns, [[r[c] for c in columns] for r in rows])

    def rejected_events(self) -> int:
        """How many journal events were refused (not typed operations on this schema, or values
        the database refused): kept in `_journal_rejected`, never applied."""
        return int(self.query("SELECT count(*) FROM _journal_rejected")[0][0])

    @contextmanager
    def reading(self) -> Iterator[LineageStore]:
        """Reads made in this block by this thread share one connection: a view that asks a
        hundred small questions (a lineage tree, a run listing) opens the database once instead
        of once per question (~50 ms each). Pending journal events are ingested first, or, while
        an outside process holds the file, read from a private copy (`snapshot`). The open
        connection holds DuckDB's read lock like an outside reader: writes made meanwhile are
        journaled at once and land when the block ends (the background retry), so keep a block to
        one view. A read-only store never ingests: it reads a private copy when events are
        pending."""
        if not self._fresh():
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
            con = _connect(self.path, read_only=True)
        self._session = (threading.get_ident(), con)
        try:
            yield self
        finally:
            self._session = None
            con.close()
