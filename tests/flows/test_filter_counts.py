"""`python -m flows.filter_counts RECIPE SOURCE`: the per-source command docs/data.md measures with,
run as a user runs it (a subprocess), prints the per-filter tables of that source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_source_is_read_and_curated_and_its_table_printed(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.filter_counts",
            "tiny",
            "math",
            "sources.math.max_documents=200",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train (math preset):" in done.stdout
    assert "| read | " in done.stdout and "| length | " in done.stdout
    assert (tmp_path / "curated" / "filter_stats.json").is_file()
