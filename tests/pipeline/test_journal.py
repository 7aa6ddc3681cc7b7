"""The lineage journal is data, not SQL: lines planted in `lineage.duckdb.journal/` (SQL text, an
unknown table or column, an identifier smuggling SQL, an unknown statement, a nested value, an
event id naming another folder) are rejected and counted, never executed; the read-only views
(`smollm3 summary`, `runs`, `lineage`, `sql`) write nothing in the workspace and run nothing
the workspace supplies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pipeline.artifact import Artifact
from pipeline.lineage import Lineage, StepRow

REPO = Path(__file__).resolve().parents[2]


def planted(target: Path) -> list[dict]:
    """Hostile journal events, each of which would write `target` (or another file) if run."""
    copy = f"COPY (SELECT 42 AS answer) TO '{target}' (FORMAT csv)"
    return [
        # the attack the issue reported: a line of SQL text, as earlier code journaled
        {"id": "1" * 32, "t": 1.0, "ops": [[copy, None, False]]},
        # the same inside the new format's table name, column name and statement name
        {"v": 2, "id": "2" * 32, "t": 1.0, "ops": [
            {"op": "insert", "table": f"metrics (name) SELECT 1; {copy}; --", "columns": ["name"],
             "rows": [["x"]], "ignore": False}]},
        {"v": 2, "id": "3" * 32, "t": 1.0, "ops": [
            {"op": "insert", "table": "metrics", "columns": [f"name) VALUES ('x'); {copy}; --"],
             "rows": [["x"]], "ignore": False}]},
        {"v": 2, "id": "4" * 32, "t": 1.0, "ops": [{"op": "statement", "name": copy, "params": []}]},
        # the journal's own bookkeeping, and a nested value
        {"v": 2, "id": "5" * 32, "t": 1.0, "ops": [
            {"op": "insert", "table": "_journal_progress", "columns": ["file", "events"],
             "rows": [["other.jsonl", 10**6]], "ignore": False}]},
        {"v": 2, "id": "6" * 32, "t": 1.0, "ops": [
            {"op": "insert", "table": "metrics", "columns": ["name"], "rows": [[{"$x": copy}]],
             "ignore": False}]},
        # a refused event's id names the file its writer is told through: not outside the folder
        {"v": 2, "id": f"../../{target.name}", "t": 1.0, "ops": [{"op": "drop", "table": "steps"}]},
    ]  # fmt: skip


def _workspace(tmp_path: Path) -> Lineage:
    ws = tmp_path / "ws"
    lin = Lineage(ws / "lineage.duckdb")
    lin.start_run("r1", "smollm3", "full", "tiny", {})
    art = Artifact(kind="corpus", uri=str(ws / "source" / "aaaa"), fingerprint="a" * 64, meta={})
    lin.record_artifact(art, "source", "prose", {})
    now = datetime.now()
    lin.record_step(StepRow("r1", "source", "prose", art.fingerprint, "completed", {}, "v", now, now))
    lin.end_run("r1", "completed")
    return lin


def _plant(lin: Lineage, events: list[dict]) -> None:
    """Written as an outsider would: a new journal file, one JSON line per event."""
    lin.journal_dir.mkdir(exist_ok=True)
    path = lin.journal_dir / "attacker-1-000000000000.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def _state(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


def test_views_run_no_planted_statement_and_write_nothing(tmp_path):
    lin = _workspace(tmp_path)
    target = tmp_path / "pwned.csv"
    _plant(lin, planted(target))
    ws = lin.path.parent
    before = _state(ws)
    out = _cli("summary", "--workspace", str(ws))
    assert out.returncode == 0, out.stderr
    assert "lineage journal: 7 event(s) rejected, never applied" in out.stdout
    for view in (["runs"], ["lineage", "a" * 12], ["sql", "SELECT count(*) FROM flow_runs"]):
        out = _cli(*view, "--workspace", str(ws))
        assert out.returncode == 0, (view, out.stderr)
    out = _cli("sql", f"COPY (SELECT 1) TO '{tmp_path / 'mine.csv'}'", "--workspace", str(ws))
    assert out.returncode == 2 and "file system operations are disabled" in out.stderr  # nor the user's own
    assert not target.exists() and not (tmp_path / "mine.csv").exists()
    assert not (ws.parent / target.name).exists()
    assert _state(ws) == before  # not a byte written in the workspace, not even a lock file


def test_ingestion_rejects_and_counts_every_planted_event_and_runs_none(tmp_path):
    lin = _workspace(tmp_path)
    target = tmp_path / "pwned.csv"
    _plant(lin, planted(target))
    lin.record_rows("metrics", [("f", 1, "loss", 2.0)])  # a writer ingests everybody's events
    assert not target.exists() and not (lin.journal_dir.parent / target.name).exists()
    rejected = lin.query_dicts("SELECT seq, error FROM _journal_rejected ORDER BY seq")
    assert [r["seq"] for r in rejected] == list(range(7))
    assert 'not a lineage operation: ["COPY' in rejected[0]["error"]
    assert "not a lineage table one may insert into" in rejected[1]["error"]
    assert "unknown column(s)" in rejected[2]["error"]
    assert "not one of attempts_crashed" in rejected[3]["error"]
    assert "'_journal_progress': not a lineage table" in rejected[4]["error"]
    assert "values must be a list of str" in rejected[5]["error"]
    assert "not a lineage operation" in rejected[6]["error"]
    assert lin.rejected_events() == 7
    assert lin.query("SELECT name, value FROM metrics") == [("loss", 2.0)]  # ours landed
    assert lin.query("SELECT count(*) FROM _journal_progress WHERE file = 'other.jsonl'") == [(0,)]


def test_a_line_too_deep_or_too_long_is_rejected_and_the_views_still_answer(tmp_path):
    """A planted line nested 100,000 deep (and one over the length bound): `json.loads` alone
    recurses past Python's limit on it (the control); the views answer, naming the rejected
    events, and the next write lands, with the two kept in `_journal_rejected`."""
    from pipeline.lineage.bounds import MAX_LINE_BYTES

    lin = _workspace(tmp_path)
    deep = '{"v": 2, "id": "' + "7" * 32 + '", "t": 1.0, "ops": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(RecursionError):
        json.loads(deep)
    ops = [{"op": "insert", "table": "metrics", "columns": ["name"], "rows": [["x"]], "ignore": False}]
    long = json.dumps({"v": 2, "id": "8" * 32, "t": 1.0, "ops": ops, "pad": "x" * MAX_LINE_BYTES})
    lin.journal_dir.mkdir(exist_ok=True)
    (lin.journal_dir / "attacker-1-000000000000.jsonl").write_text(deep + "\n" + long + "\n")
    ws = lin.path.parent
    out = _cli("summary", "--workspace", str(ws))
    assert out.returncode == 0, out.stderr
    assert "lineage journal: 2 event(s) rejected, never applied" in out.stdout
    for view in (["runs"], ["lineage", "a" * 12], ["sql", "SELECT count(*) FROM flow_runs"]):
        out = _cli(*view, "--workspace", str(ws))
        assert out.returncode == 0 and "Traceback" not in out.stderr, (view, out.stderr)
    lin.record_rows("metrics", [("f", 1, "loss", 2.0)])  # a writer: ingestion goes past them
    errors = [r["error"] for r in lin.query_dicts("SELECT error FROM _journal_rejected ORDER BY seq")]
    assert errors == [
        "JournalLineOutOfBounds: a journal line nested deeper than 32 levels",
        f"JournalLineOutOfBounds: a journal line of {len(long)} bytes, over the bound of {MAX_LINE_BYTES}",
    ]
    assert lin.query("SELECT name, value FROM metrics") == [("loss", 2.0)]


def test_the_depth_scan_ignores_brackets_inside_strings():
    from pipeline.lineage.bounds import MAX_DEPTH, json_depth

    assert json_depth(b'{"a": [[1], {"b": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\"[["}]}') == 3
    assert json_depth(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)) == MAX_DEPTH + 1
