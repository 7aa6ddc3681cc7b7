"""Tests for benchmarks/heldout_leakage.py, the outside check of held-out leakage: it finds a
planted copy and a planted near copy in a workspace's curated train, and passes a clean one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tasks.datafiles import PARAGRAPHS, doc_line, write_lines

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout_leakage.py"


def _workspace(root: Path, train: list[tuple[str, str]]) -> Path:
    held = [("h1", PARAGRAPHS[0]), ("h2", PARAGRAPHS[1])]
    write_lines(root / "source" / "aaa" / "heldout" / "00000.jsonl.gz", [doc_line(i, t) for i, t in held])
    write_lines(root / "curate" / "bbb" / "heldout" / "00000.jsonl.gz", [doc_line(i, t) for i, t in held])
    write_lines(root / "curate" / "bbb" / "train" / "00000.jsonl.gz", [doc_line(i, t) for i, t in train])
    return root


def _run(ws: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(ws)], capture_output=True, text=True, timeout=60)


def test_clean_train_passes(tmp_path):
    done = _run(_workspace(tmp_path, [("t1", PARAGRAPHS[2])]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical to a held-out document: 0" in done.stdout and "pairs at or above it: 0" in done.stdout


def test_copies_are_found_and_named(tmp_path):
    near = PARAGRAPHS[1].replace("tulips", "roses").replace("beans", "peas")
    done = _run(_workspace(tmp_path, [("copy", PARAGRAPHS[0]), ("near", near), ("t1", PARAGRAPHS[2])]))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "identical to a held-out document: 1" in done.stdout
    assert "pairs at or above it: 4" in done.stdout  # each copy against both held-out forms
    assert "held-out curate/bbb:h2  <->  train curate/bbb:near" in done.stdout
