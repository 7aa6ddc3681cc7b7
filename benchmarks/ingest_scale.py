"""Peak memory of each ingestion task against the source's size: flat, not growing with it.

    python benchmarks/ingest_scale.py                      # 10k, 100k and 1M documents
    python benchmarks/ingest_scale.py --sizes 10000 100000

A synthetic `files:` source of short distinct documents (ids in an `id` field, 1 in 1,000 an
id seen before, so the duplicate-id stage finds some and the finish stage rewrites shards), in
files of `--per-file` documents: the source grows in files, as a real one does, and each file
is one read task and each read task one id bucket (the recipe's `curation.tasks` plays that
part at scale). Each task of each stage (curation/ingest.py: read, ids, finish) runs in a
process of its own (forked from this one, so its peak includes this process's ~100 MB of
imports, printed as the baseline); a stage's figure is its largest task's peak resident set.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from curation.ingest import ingest_stages, merge_stats  # noqa: E402
from curation.source_kinds import SourceConfig  # noqa: E402

WORDS = "the of and to in is was for on that with as by at from this are be or an it not which".split()


def corpus(folder: Path, documents: int, per_file: int, seed: int = 0) -> int:
    """`documents` JSON lines of ~160 characters in files of `per_file`; returns the files."""
    import json

    rng = random.Random(seed)
    files = -(-documents // per_file)
    for f in range(files):
        with open(folder / f"part-{f:05d}.jsonl", "w", encoding="utf-8") as fh:
            for i in range(f * per_file, min(documents, (f + 1) * per_file)):
                doc_id = f"w{rng.randrange(i)}" if i and rng.random() < 0.001 else f"w{i}"
                text = f"document {i}: " + " ".join(rng.choice(WORDS) for _ in range(30))
                fh.write(json.dumps({"id": doc_id, "text": text}) + "\n")
    return files


def forked_peak(run) -> int:
    """Peak resident bytes of a child process that runs `run()`."""
    pid = os.fork()
    if pid == 0:
        try:
            run()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    _, status, usage = os.wait4(pid, 0)
    if status != 0:
        raise RuntimeError(f"a task failed (status {status}); its traceback is above")
    return usage.ru_maxrss * 1024


def measure(documents: int, per_file: int, cap: int) -> dict:
    """Each stage's largest per-task peak, the tasks and the seconds, for one source size."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "src"
        folder.mkdir()
        tasks = corpus(folder, documents, per_file)
        cfg = SourceConfig(name="web", uri=f"files:{folder}/*.jsonl", domain="web", id_field="id")
        out = Path(tmp) / "out"
        start = time.monotonic()
        peaks = {}
        for name, pipeline, n in ingest_stages(cfg, 0, out, tasks, tasks, cap):
            step = pipeline[0]
            peaks[name] = max(forked_peak(lambda r=r, step=step, n=n: step.run(rank=r, world_size=n)) for r in range(n))
        stats = merge_stats(out / "work", tasks)
        seconds = time.monotonic() - start
    kept = sum(stats["documents"].values())
    return {"documents": documents, "tasks": tasks, "seconds": seconds, "kept": kept, **peaks, "stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--per-file", type=int, default=10_000, help="documents per source file (one read task each)")
    ap.add_argument("--cap", type=int, default=2000, help="held-out documents at most (curation.heldout.max_docs)")
    args = ap.parse_args()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"baseline (this process, imports): {baseline / 1e6:.0f} MB")
    print(
        f"{'documents':>10} {'tasks':>6} {'read MB':>8} {'ids MB':>8} {'finish MB':>10} {'seconds':>8} {'duplicates':>11}"
    )
    rows = []
    for n in args.sizes:
        r = measure(n, args.per_file, args.cap)
        rows.append(r)
        print(
            f"{n:>10,} {r['tasks']:>6} {r['read'] / 1e6:>8.0f} {r['ids'] / 1e6:>8.0f} {r['finish'] / 1e6:>10.0f} "
            f"{r['seconds']:>8.1f} {r['stats']['rejected'].get('duplicate_id', 0):>11,}"
        )
    worst = max(rows, key=lambda r: max(r["read"], r["ids"], r["finish"]))
    stage = max(("read", "ids", "finish"), key=lambda s: worst[s])
    growth = max(max(r["read"], r["ids"], r["finish"]) for r in rows) - min(
        max(r["read"], r["ids"], r["finish"]) for r in rows
    )
    print(
        f"worst per-task peak: {worst[stage] / 1e6:.0f} MB ({stage}, {worst['documents']:,} documents); "
        f"spread over {rows[0]['documents']:,}-{rows[-1]['documents']:,} documents: {growth / 1e6:.0f} MB"
    )


if __name__ == "__main__":
    main()
