"""Lineage under contention: 4 writer processes x N rows, with the file free and while an outside
process holds it with a plain `duckdb.connect(path, read_only=True)`.

Prints wall seconds, rows that landed and failed writes for each case. The baseline is the free
file: the held case shows what an outside reader costs (ingestion waits, nothing is lost).

    .venv/bin/python benchmarks/lineage_writers.py            # 200 rows per writer
    .venv/bin/python benchmarks/lineage_writers.py --rows 50
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOLDER = (
    "import duckdb, sys; con = duckdb.connect(sys.argv[1], read_only=True); "
    "print('held', flush=True); sys.stdin.readline()"
)


def writer(path: str, worker: int, rows: int) -> None:
    from pipeline.lineage import Lineage

    lin = Lineage(path)
    for i in range(rows):
        lin.record_rows("metrics", [(f"w{worker}", i, "loss", float(i))])


def run(rows: int, held: bool) -> tuple[float, int, int]:
    from pipeline.lineage import Lineage

    path = str(Path(tempfile.mkdtemp()) / "lineage.duckdb")
    Lineage(path).record_rows("metrics", [("seed", 0, "loss", 0.0)])
    holder = None
    if held:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        holder.stdout.readline()
    ctx = mp.get_context("spawn")
    start = time.perf_counter()
    procs = [ctx.Process(target=writer, args=(path, w, rows)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    seconds = time.perf_counter() - start
    if holder is not None:
        holder.communicate("\n")
    landed = Lineage(path).query("SELECT count(*) FROM metrics WHERE fingerprint <> 'seed'")[0][0]
    return seconds, landed, sum(p.exitcode != 0 for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200, help="rows per writer process")
    args = ap.parse_args()
    for held in (False, True):
        seconds, landed, failed = run(args.rows, held)
        print(
            f"{'held by an outside reader' if held else 'free file':26s} 4 x {args.rows} writes: "
            f"{seconds:6.1f} s, {landed}/{4 * args.rows} rows landed, {failed} writers failed"
        )


if __name__ == "__main__":
    main()
