"""Per-megabyte costs of the source step and of the decontaminate step, for the data plan of
`smollm3 capacity --recipe` (flows/data_plan.py): CPU seconds per MB of text read and written, the
written shards' size against the text, and the process's peak memory growth per document.

    python benchmarks/data_plan_costs.py              # 20 MB of English web text
    python benchmarks/data_plan_costs.py --megabytes 5

The corpus is `benchmarks/curate.py`'s (distinct documents of English sentences, one JSONL file);
the source step reads it as a `files:` source with ids from the file and writes its gzip JSONL
shards (train and a 5% held-out split, capped at 2,000 documents). The decontaminate step then
matches those train shards, taken as a curated corpus (no filter rows before its own), against
the index of that held-out split (the heldout_index step; the recipe's index holds 71 such
splits: a lookup is a binary search, so a larger index costs a few more comparisons per n-gram),
one local task at a time in this process. Curation's cost per MB is
`benchmarks/curate.py --scale`'s and tokenization's `benchmarks/tokenize_step.py`'s (docs/data.md).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from curate import web_corpus  # noqa: E402

from curation.source_kinds import SourceConfig  # noqa: E402
from pipeline.artifact import Artifact  # noqa: E402
from tasks.decontaminate import DecontaminateSpec, decontaminate  # noqa: E402
from tasks.heldout_index import HeldoutIndexSpec, heldout_index  # noqa: E402
from tasks.sources import SourceSpec, source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megabytes", type=float, default=20.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "web.jsonl"
        documents = web_corpus(path, args.megabytes)
        text_mb = args.megabytes
        cfg = SourceConfig(name="web", uri=f"files:{path}", domain="web")
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu0, wall0 = time.process_time(), time.monotonic()
        meta = source(SourceSpec(source=cfg, held_out_max_documents=2000), out=Path(tmp) / "out", log=lambda _: None)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
        written = sum(p.stat().st_size for p in (Path(tmp) / "out").rglob("*.gz"))
        decont_cpu, removed = _decontaminate(Path(tmp), meta)
    print(f"documents {documents:,}, text {text_mb:.1f} MB, {text_mb * 1e6 / documents:,.0f} bytes per document")
    print(
        f"source step: {wall:.1f} s wall, {cpu:.1f} CPU s: {cpu / text_mb:.3f} CPU s per MB ({text_mb / cpu:.1f} MB/s)"
    )
    print(f"written shards: {written / 1e6:.1f} MB, {written / (text_mb * 1e6):.3f} of the text")
    print(f"peak memory growth: {rss / 1e6:.1f} MB, {rss / documents:.0f} bytes per document")
    print(f"train {meta['documents']:,}, held out {meta['heldout_documents']:,} (capped {meta['heldout_capped']:,})")
    print(
        f"decontaminate step: {decont_cpu:.1f} CPU s: {decont_cpu / text_mb:.3f} CPU s per MB "
        f"(index of {meta['heldout_documents']:,} held-out documents; removed {removed})"
    )


def _decontaminate(tmp: Path, meta: dict) -> tuple[float, dict]:
    """The heldout_index step over the source's held-out split, then the decontaminate step over
    its train shards (one local task at a time, in this process): the latter's CPU seconds."""
    import json

    quiet = lambda _: None  # noqa: E731
    src = tmp / "out"
    for name in ("filter_stats.json", "heldout_filter_stats.json"):  # a curated corpus's tables, empty
        (src / name).write_text("[]")
    corpus = Artifact(kind="corpus", uri=str(src), fingerprint="a" * 64, meta=meta)
    imeta = heldout_index(HeldoutIndexSpec(workers=1), [corpus], out=tmp / "index", log=quiet)
    index = Artifact(kind="heldout_index", uri=str(tmp / "index"), fingerprint="b" * 64, meta=imeta)
    cpu0 = time.process_time()
    got = decontaminate(DecontaminateSpec(workers=1), corpus, index, out=tmp / "decont", log=quiet)
    return time.process_time() - cpu0, json.loads(json.dumps(got["removed"]))


if __name__ == "__main__":
    main()
