"""Records planted in a workspace's lineage (issue 35, item 4): a run id that is a path, and
text carrying terminal escape sequences. Planted through the lineage writer (what a journal line
anyone may append becomes), then read by the CLI's views in a fresh process: the control shows
the record live in lineage, the views refuse the id before it names a file and print the text
escaped."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pipeline.lineage import Lineage, StepRow
from pipeline.workspace import Workspace, check_run_id

REPO = Path(__file__).resolve().parents[2]
ESC = "\x1b]0;pwned\x07\x1b[2J"  # retitle the terminal, then clear the screen


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


def _plant_run(ws: Path, run_id: str) -> Lineage:
    lin = Lineage(ws / "lineage.duckdb")
    lin.start_run(run_id, "smollm3", "full", f"tiny{ESC}", {})
    now = datetime.now()
    lin.record_step(StepRow(run_id, "source", f"prose{ESC}", "a" * 64, "failed", {}, "v", now, now, f"boom{ESC}"))
    lin.end_run(run_id, "failed")
    return lin


@pytest.mark.parametrize("run_id", ["../../outside", "/tmp/abs-run", "a/b", "..", "x" * 65, "run\x1b[2J"])
def test_a_run_id_that_is_a_path_never_names_a_file(tmp_path, run_id):
    ws = tmp_path / "deep" / "ws"
    lin = _plant_run(ws, run_id)
    with lin.reading():  # control: the planted run is the newest run of the workspace's lineage
        assert lin.runs(1)[0]["run_id"] == run_id
    out = _cli("report", "latest", "--workspace", str(ws))
    assert out.returncode == 2, out.stderr
    assert "is not a run id (letters, digits, _ and -, at most 64)" in out.stderr
    assert "Traceback" not in out.stderr and "\x1b" not in out.stderr
    assert not (ws / "reports").exists()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.suffix == ".md") == []
    assert not Path("/tmp/abs-run.md").exists()
    with pytest.raises(ValueError, match="is not a run id"):
        Workspace(root=str(ws)).run_dir(run_id)


def test_a_uuid_and_the_ids_tests_use_are_run_ids():
    for run_id in ("5f0e2d3c-8a1b-4c9d-9e7f-0a1b2c3d4e5f", "run-1", "r1", "flow_ok"):
        assert check_run_id(run_id) == run_id


def test_text_from_the_workspace_is_printed_escaped(tmp_path):
    ws = tmp_path / "ws"
    lin = _plant_run(ws, "run-1")
    with lin.reading():  # control: lineage holds the raw escape sequences
        assert ESC in lin.runs(1)[0]["recipe"]
    for view in (["runs"], ["summary"], ["sql", "SELECT recipe FROM flow_runs"]):
        out = _cli(*view, "--workspace", str(ws))
        assert out.returncode == 0, (view, out.stderr)
        assert "\x1b" not in out.stdout and "\x07" not in out.stdout, view
        assert "]0;pwned" in out.stdout, view  # shown, escaped (DuckDB's table writes \\e itself)
        if view[0] != "sql":
            assert "tiny\\x1b]0;pwned\\x07\\x1b[2J" in out.stdout, (view, out.stdout)
