"""Lineage store: one DuckDB file per workspace recording runs, steps, artifacts and their edges.

DuckDB allows a single read-write process per file, while several processes touch this one (the
serve process, parallel flow runs, CLI readers). Every access is therefore a short
connect-work-close cycle under an OS file lock beside the database: exclusive for writers, shared
for readers. Retrying on DuckDB's own lock error alone was measured to lose rows; the flock loses
none. Torchrun ranks never open the database: the task ingests the trainer's JSONL afterwards.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb

from infra.artifact import Artifact, canonical_json, identity

SCHEMA = """
CREATE TABLE IF NOT EXISTS flow_runs (
    run_id VARCHAR PRIMARY KEY, flow VARCHAR, deployment VARCHAR, recipe VARCHAR,
    config JSON, started TIMESTAMP, ended TIMESTAMP, state VARCHAR
);
CREATE TABLE IF NOT EXISTS steps (
    run_id VARCHAR, step VARCHAR, label VARCHAR, fingerprint VARCHAR, state VARCHAR,
    config JSON, code_version VARCHAR, started TIMESTAMP, ended TIMESTAMP, seconds DOUBLE,
    error VARCHAR
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
"""


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class StepRow:
    run_id: str
    step: str
    label: str
    fingerprint: str | None
    state: str  # completed | cached | failed
    config: Any
    code_version: str
    started: datetime
    ended: datetime
    error: str | None = None


class Lineage:
    """The lineage database of one workspace."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+") as fh:
            fcntl.flock(fh, mode)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @contextmanager
    def writer(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-write connection held under the exclusive lock; keep the work short."""
        with self._locked(fcntl.LOCK_EX):
            con = duckdb.connect(str(self.path))
            try:
                con.execute(SCHEMA)
                con.execute("BEGIN TRANSACTION")
                yield con
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            finally:
                con.close()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Run a read-only query under the shared lock; an absent database reads as empty."""
        if not self.path.exists():
            return []
        with self._locked(fcntl.LOCK_SH):
            con = duckdb.connect(str(self.path), read_only=True)
            try:
                return con.execute(sql, list(params)).fetchall()
            finally:
                con.close()

    def query_dicts(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self._locked(fcntl.LOCK_SH):
            con = duckdb.connect(str(self.path), read_only=True)
            try:
                cur = con.execute(sql, list(params))
                names = [d[0] for d in cur.description]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            finally:
                con.close()

    # --- writes -------------------------------------------------------------------------------

    def start_run(
        self, run_id: str, flow: str, deployment: str | None, recipe: str, config: Any
    ) -> None:
        with self.writer() as con:
            con.execute(
                "INSERT OR REPLACE INTO flow_runs VALUES (?, ?, ?, ?, ?, ?, NULL, 'running')",
                [run_id, flow, deployment, recipe, canonical_json(config), _now()],
            )

    def end_run(self, run_id: str, state: str) -> None:
        with self.writer() as con:
            con.execute(
                "UPDATE flow_runs SET ended = ?, state = ? WHERE run_id = ?",
                [_now(), state, run_id],
            )

    def record_step(self, row: StepRow) -> None:
        with self.writer() as con:
            con.execute(
                "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    row.run_id, row.step, row.label, row.fingerprint, row.state,
                    canonical_json(row.config), row.code_version, row.started, row.ended,
                    (row.ended - row.started).total_seconds(), row.error,
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
                    artifact.fingerprint, artifact.kind, step, label, artifact.uri,
                    canonical_json(artifact.meta), canonical_json(identity(config)), _now(),
                ],
            )
            for parent in parents:
                con.execute(
                    "INSERT OR IGNORE INTO edges VALUES (?, ?)",
                    [parent.fingerprint, artifact.fingerprint],
                )

    def record_rows(self, table: str, rows: Sequence[Sequence[Any]]) -> None:
        """Append rows to one of the schema's fact tables (metrics, evals, filter_stats, ...)."""
        if table not in {"metrics", "evals", "filter_stats", "preflight"}:
            raise ValueError(f"unknown lineage table {table!r}")
        if not rows:
            return
        width = len(rows[0])
        with self.writer() as con:
            con.executemany(
                f"INSERT INTO {table} VALUES ({', '.join('?' * width)})", [list(r) for r in rows]
            )

    # --- reads --------------------------------------------------------------------------------

    def artifact(self, fingerprint_prefix: str) -> dict[str, Any] | None:
        rows = self.query_dicts(
            "SELECT * FROM artifacts WHERE fingerprint LIKE ? ORDER BY created", [fingerprint_prefix + "%"]
        )
        if len(rows) > 1:
            names = ", ".join(r["fingerprint"][:12] for r in rows)
            raise ValueError(f"fingerprint prefix {fingerprint_prefix!r} is ambiguous: {names}")
        return rows[0] if rows else None

    def artifact_by_uri(self, path: Path) -> dict[str, Any] | None:
        path = Path(path).resolve()
        rows = self.query_dicts("SELECT * FROM artifacts")
        best = None
        for row in rows:
            uri = Path(row["uri"]).resolve()
            if path == uri or uri in path.parents:
                if best is None or len(str(uri)) > len(best["uri"]):
                    best = row
        return best

    def parents(self, fingerprint: str) -> list[dict[str, Any]]:
        return self.query_dicts(
            "SELECT a.* FROM edges e JOIN artifacts a ON a.fingerprint = e.parent "
            "WHERE e.child = ? ORDER BY a.step, a.label",
            [fingerprint],
        )

    def children(self, fingerprint: str) -> list[dict[str, Any]]:
        return self.query_dicts(
            "SELECT a.* FROM edges e JOIN artifacts a ON a.fingerprint = e.child "
            "WHERE e.parent = ? ORDER BY a.step, a.label",
            [fingerprint],
        )

    def ancestors(self, fingerprint: str) -> list[dict[str, Any]]:
        """Every artifact upstream of `fingerprint` (a recursive query over the edges)."""
        return self._closure(fingerprint, near="child", far="parent")

    def descendants(self, fingerprint: str) -> list[dict[str, Any]]:
        """Every artifact downstream of `fingerprint`."""
        return self._closure(fingerprint, near="parent", far="child")

    def _closure(self, fingerprint: str, near: str, far: str) -> list[dict[str, Any]]:
        return self.query_dicts(
            f"""
            WITH RECURSIVE walk(fp) AS (
                SELECT {far} FROM edges WHERE {near} = ?
                UNION SELECT e.{far} FROM edges e JOIN walk ON e.{near} = walk.fp
            )
            SELECT a.* FROM artifacts a JOIN walk ON a.fingerprint = walk.fp ORDER BY a.step, a.label
            """,
            [fingerprint],
        )

    def runs(self, limit: int = 20) -> list[dict[str, Any]]:
        return self.query_dicts(
            "SELECT * FROM flow_runs ORDER BY started DESC LIMIT ?", [limit]
        )

    def steps_of(self, run_id: str) -> list[dict[str, Any]]:
        return self.query_dicts(
            "SELECT * FROM steps WHERE run_id = ? ORDER BY started", [run_id]
        )


    # --- typed lookups ----------------------------------------------------------------------
    # What tasks and flows ask of lineage, as functions returning Artifacts: no SQL outside
    # this module's class.

    def get(self, fingerprint_prefix: str) -> Artifact:
        """The artifact with this fingerprint (or unique prefix); an error names a missing one."""
        row = self.artifact(fingerprint_prefix)
        if row is None:
            raise LookupError(f"artifact {fingerprint_prefix[:12]} is not in lineage {self.path}")
        return artifact_of(row)

    def get_many(self, fingerprints: Sequence[str]) -> list[Artifact]:
        """Artifacts by fingerprint, in the order given."""
        return [self.get(fp) for fp in fingerprints]

    def find_by_path(self, path: Path) -> Artifact | None:
        """The artifact whose step folder holds `path` (the innermost one)."""
        row = self.artifact_by_uri(path)
        return artifact_of(row) if row else None

    def inputs_of(self, fingerprint: str, kind: str | None = None) -> list[Artifact]:
        """The artifacts a step read to make this one (optionally only those of one kind)."""
        return [artifact_of(r) for r in self.parents(fingerprint) if kind is None or r["kind"] == kind]

    def made_from(self, fingerprint: str, step: str | None = None) -> list[Artifact]:
        """The artifacts steps made from this one (optionally only those of one step), oldest first."""
        rows = sorted(self.children(fingerprint), key=lambda r: r["created"])
        return [artifact_of(r) for r in rows if step is None or r["step"] == step]

    def latest_run(self, flow: str, deployment: str | None = None) -> str | None:
        """The newest run of `flow`, runs of `deployment` first (a served `smollm3/full` run beats
        an ad hoc run of the same flow)."""
        rows = self.query(
            "SELECT run_id FROM flow_runs WHERE flow = ? "
            "ORDER BY coalesce(deployment = ?, false) DESC, started DESC LIMIT 1",
            [flow, deployment],
        )
        return rows[0][0] if rows else None

    def previous(self, step: str, label: str) -> tuple[Artifact, Any, set[str]] | None:
        """The newest artifact of `step[label]`: the artifact, the identity config it was built
        with, and its parents' fingerprints (what `smollm3 plan` compares against)."""
        rows = self.query_dicts(
            "SELECT * FROM artifacts WHERE step = ? AND label = ? ORDER BY created DESC LIMIT 1", [step, label]
        )
        if not rows:
            return None
        config = json.loads(rows[0]["config"]) if rows[0]["config"] else {}
        parents = {r["fingerprint"] for r in self.parents(rows[0]["fingerprint"])}
        return artifact_of(rows[0]), config, parents

    def run_outputs(self, run_id: str, step: str) -> list[Artifact]:
        """Artifacts of `step` that a run built or reused (completed or cached), in run order."""
        return [a for _, a in self.labelled_outputs(run_id, step)]

    def labelled_outputs(self, run_id: str, step: str | None = None,
                         kind: str | None = None) -> list[tuple[str, Artifact]]:
        """(label, artifact) of the steps a run built or reused, optionally of one step name or
        one artifact kind, in the order they finished."""
        rows = self.query_dicts(
            "SELECT s.label AS step_label, a.*, min(s.ended) AS finished FROM steps s "
            "JOIN artifacts a ON a.fingerprint = s.fingerprint "
            "WHERE s.run_id = ? AND s.state IN ('completed', 'cached') "
            "AND (? IS NULL OR s.step = ?) AND (? IS NULL OR a.kind = ?) "
            "GROUP BY ALL ORDER BY finished",
            [run_id, step, step, kind, kind],
        )
        return [(r["step_label"], artifact_of(r)) for r in rows]

    def run_scores(self, run_id: str, metrics: Sequence[str] = ("acc", "acc_norm", "exact_match")) -> list[dict[str, Any]]:
        """Eval scores of a run's evaluate steps (built or reused): label (the evaluated stage or
        model), task, metric, value, stderr, in the order the evaluations ran."""
        return self.query_dicts(
            f"""
            SELECT DISTINCT s.label, e.task, e.metric, e.value, e.stderr, s.started
            FROM steps s JOIN evals e ON e.fingerprint = s.fingerprint
            WHERE s.run_id = ? AND s.step = 'evaluate' AND s.state IN ('completed', 'cached')
                  AND e.metric IN ({', '.join('?' * len(metrics))})
            ORDER BY s.started
            """,
            [run_id, *metrics],
        )

    def find_runs(self, prefix: str) -> list[dict[str, Any]]:
        """Runs whose id starts with `prefix`, newest first."""
        return self.query_dicts("SELECT * FROM flow_runs WHERE run_id LIKE ? ORDER BY started DESC", [prefix + "%"])

    # --- anneal comparisons (tasks/anneal.py): created on first use -------------------------

    def record_comparisons(self, rows: Sequence[Sequence[Any]]) -> None:
        """Append rows to `anneal_comparisons` (see COMPARISON_SCHEMA for the columns)."""
        with self.writer() as con:
            con.execute(COMPARISON_SCHEMA)
            con.executemany(f"INSERT INTO anneal_comparisons VALUES ({', '.join('?' * 19)})",
                            [list(r) for r in rows])

    def comparisons(self, comparison: str | None = None) -> list[dict[str, Any]]:
        """Rows of `anneal_comparisons` (all, or one comparison's), newest first."""
        if not self.query("SELECT 1 FROM information_schema.tables WHERE table_name = 'anneal_comparisons'"):
            return []
        where, params = ("WHERE comparison = ?", [comparison]) if comparison else ("", [])
        return self.query_dicts(f"SELECT * FROM anneal_comparisons {where} ORDER BY created DESC, candidate, task", params)


def artifact_of(row: dict[str, Any]) -> Artifact:
    """An Artifact from a row of the `artifacts` table."""
    meta = row["meta"]
    return Artifact(kind=row["kind"], uri=row["uri"], fingerprint=row["fingerprint"],
                    meta=json.loads(meta) if isinstance(meta, str) else dict(meta or {}))


COMPARISON_SCHEMA = """
CREATE TABLE IF NOT EXISTS anneal_comparisons (
    comparison VARCHAR, run_id VARCHAR, base_checkpoint VARCHAR, base_global_step BIGINT,
    candidate VARCHAR, task VARCHAR, metric VARCHAR, baseline DOUBLE, score DOUBLE, delta DOUBLE,
    stderr DOUBLE, seed_std DOUBLE, noise DOUBLE, z DOUBLE, significant BOOLEAN, better VARCHAR,
    improved BOOLEAN, eval_fingerprint VARCHAR, created TIMESTAMP
)
"""
