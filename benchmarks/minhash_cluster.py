"""The MinHash cluster stage at sizes where its chunk of pairs is full: peak memory per document
with a near duplicate, and time, for curation's `MinhashClusterArrays` and datatrove's
`MinhashDedupCluster` on the same pair files.

    python benchmarks/minhash_cluster.py                                  # 1M and 4M documents, both
    python benchmarks/minhash_cluster.py --documents 250000 --impl arrays

For N documents (in 100 input files), each of the 14 band files holds N/2 pairs, each document
joined to one of its next 3 (7 pairs per document, as many as a near duplicate found in every
band). Each run is a fresh process; its peak is the VmHWM of the run alone (reset through
/proc/self/clear_refs once the pair files are written), less the resident set it started from.
The last lines give each stage's growth between the smallest and largest size: the bytes per
document in a pair past the fixed buffers (a chunk of pairs). `benchmarks/data_scale.py`
measures the stage as curation runs it, at sizes where each pair file is smaller than one chunk.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BANDS, FILES, DOCS_PER_FILE = 14, 100, 3_000_000


def _status(field: str) -> float:
    """A /proc/self/status field in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def write_pairs(folder: Path, documents: int, seed: int = 0) -> int:
    """The band files of `documents` documents; the pairs written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    files = rng.integers(0, FILES, documents, dtype=np.uint32)
    docs = rng.integers(0, DOCS_PER_FILE, documents, dtype=np.uint32)
    folder.mkdir(parents=True)
    pairs = 0
    for band in range(BANDS):
        first = rng.permutation(documents)[: documents // 2]
        second = (first + 1 + rng.integers(0, 3, len(first))) % documents
        rows = np.stack([files[first], docs[first], files[second], docs[second]], 1).astype("<u4")
        (folder / f"{band:05d}_00.dups").write_bytes(rows.tobytes())
        pairs += len(rows)
    return pairs


def measure(impl: str, documents: int, work: Path) -> dict:
    """One run in this process: pairs written, then the stage, its own peak above its start."""
    import gc

    pairs = write_pairs(work / "dups", documents)
    gc.collect()
    if impl == "arrays":
        from curation.minhash_cluster import MinhashClusterArrays as Stage
    else:
        from datatrove.pipeline.dedup import MinhashDedupCluster as Stage
    step = Stage(str(work / "dups"), str(work / "remove"))
    start_mb = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on: the run alone
    t0 = time.perf_counter()
    step.run(None, 0, 1)
    seconds = time.perf_counter() - t0
    peak_mb = _status("VmHWM") - start_mb
    nodes = int(step.stats["duplicates"].total)
    return {
        "impl": impl,
        "documents": nodes,
        "pairs": pairs,
        "seconds": round(seconds, 1),
        "peak_mb": round(peak_mb, 1),
        "bytes_per_document": round(peak_mb * 2**20 / nodes, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, nargs="+", default=[1_000_000, 4_000_000])
    ap.add_argument("--impl", nargs="+", choices=("arrays", "datatrove"), default=["arrays", "datatrove"])
    ap.add_argument("--measure", nargs=3, metavar=("IMPL", "N", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        impl, n, work = args.measure
        print(json.dumps(measure(impl, int(n), Path(work))))
        return
    import os

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("| stage | documents in a pair | pairs | peak above start MB | bytes per document | seconds |")
    print("|---|---|---|---|---|---|")
    got: dict[str, list[dict]] = {impl: [] for impl in args.impl}
    for n in args.documents:
        for impl in args.impl:
            with tempfile.TemporaryDirectory(prefix="bench-minhash-cluster-") as tmp:
                cmd = [sys.executable, __file__, "--measure", impl, str(n), tmp]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            got[impl].append(r)
            name = "MinhashClusterArrays" if impl == "arrays" else "MinhashDedupCluster (datatrove)"
            print(
                f"| {name} | {r['documents']:,} | {r['pairs']:,} | {r['peak_mb']:,.1f} | "
                f"{r['bytes_per_document']:.1f} | {r['seconds']:.1f} |",
                flush=True,
            )
    for impl, rows in got.items():  # the growth past the fixed buffers: between the smallest and largest
        if len(rows) > 1 and rows[-1]["documents"] > rows[0]["documents"]:
            slope = (rows[-1]["peak_mb"] - rows[0]["peak_mb"]) * 2**20 / (rows[-1]["documents"] - rows[0]["documents"])
            print(f"{impl}: {slope:.1f} bytes per more document in a pair")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
