"""benchmarks/minhash_cluster.py at tiny sizes: both cluster stages run on the same pair files, in
fresh processes, and the table, the growth lines and the documents clustered are as promised."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "minhash_cluster.py"
ROW = re.compile(r"^\| (MinhashClusterArrays|MinhashDedupCluster \(datatrove\)) \| ([0-9,]+) \| ([0-9,]+) \| ")


def test_both_stages_measured_on_the_same_pairs():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--documents", "2000", "6000"],
        capture_output=True,
        text=True,
        check=True,
        cwd=SCRIPT.parents[1],
    ).stdout.splitlines()
    rows = [m.groups() for m in map(ROW.match, out) if m]
    assert [r[0] for r in rows] == ["MinhashClusterArrays", "MinhashDedupCluster (datatrove)"] * 2
    # the same pair files for both: the same documents in a pair (datatrove's own count) and pairs
    assert rows[0][1:] == rows[1][1:] and rows[2][1:] == rows[3][1:]
    assert [int(r[2].replace(",", "")) for r in rows[::2]] == [14 * 1000, 14 * 3000]
    assert sum(line.startswith(("arrays: ", "datatrove: ")) and "bytes per more document" in line for line in out) == 2
