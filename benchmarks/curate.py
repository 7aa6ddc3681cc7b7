"""Curation throughput: our curate step against the same datatrove pipeline run bare.

Builds the built-in `prose` corpus (web preset: Gopher repetition and quality, C4, FineWeb) in a
temporary folder and curates it twice, printing documents/s of each and their ratio:

- step: the `tasks.curate.curate` step (counted reading, preset filters with removed-document
  samples, exact dedup, MinHash dedup, statistics rows, output count);
- bare: the same filters and dedup stages written by hand with datatrove's stock JsonlReader,
  no exclusion writers, run by LocalPipelineExecutor, nothing read back afterwards.

    .venv/bin/python benchmarks/curate.py                 # one round
    .venv/bin/python benchmarks/curate.py --rounds 2 --source code

The ratio is step/bare documents per second: what our accounting costs.

`--scale` measures how curation uses its cores instead: an English web corpus of each size
(`--sizes`, MB of UTF-8 text: documents of sentences drawn, seeded, from the built-in prose, so
every document is distinct and passes for web text) is read by the source step (dealt into 8
shards) and curated by the step with the `web` preset (language ID, Gopher, C4, FineWeb, exact
and MinHash dedup) in 8 tasks at each worker count (`--workers`). It prints wall seconds, CPU
seconds (this process and its workers) per MB, the speedup over the first worker count, and
whether the curated output is byte-identical across worker counts:

    .venv/bin/python benchmarks/curate.py --scale --sizes 20,100 --workers 1,2
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bare_pipeline(preset: str, train: Path, out: Path) -> None:
    """The datatrove pipeline a user would write by hand for the same curation."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.exact_dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    from curation.heldout import exact_text
    from curation.presets import PRESETS

    exact = ExactDedupConfig(content_getter=exact_text, hash_config=HashConfig(precision=64))
    mh = MinhashConfig(hash_config=HashConfig(precision=64))
    w = str(out)
    stages = [
        (
            [
                JsonlReader(str(train)),
                *PRESETS.get(preset).filters(),
                JsonlWriter(f"{w}/filtered"),
                ExactDedupSignature(f"{w}/es", config=exact),
            ],
            1,
        ),
        ([ExactFindDedups(f"{w}/es", f"{w}/ed", config=exact)], 1),
        (
            [
                JsonlReader(f"{w}/filtered"),
                ExactDedupFilter(f"{w}/ed", config=exact),
                JsonlWriter(f"{w}/unique"),
                MinhashDedupSignature(f"{w}/ms", config=mh),
            ],
            1,
        ),
        ([MinhashDedupBuckets(f"{w}/ms", f"{w}/mb", config=mh)], mh.num_buckets),
        ([MinhashDedupCluster(f"{w}/mb", f"{w}/mr", config=mh)], 1),
        ([JsonlReader(f"{w}/unique"), MinhashDedupFilter(f"{w}/mr"), JsonlWriter(f"{w}/train")], 1),
    ]
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=f"{w}/logs/{i}").run()


def english_sentences() -> list[str]:
    """Plain English sentences of the built-in prose (pydoc topics, package descriptions,
    docstrings): letters, digits and ordinary punctuation only, 40-240 characters."""
    from curation.source_kinds import BuiltinProse, Document, SourceConfig

    kind = BuiltinProse(SourceConfig(name="prose", uri="builtin:prose", domain="web"), 0)
    plain = re.compile(r"^[A-Z][A-Za-z0-9 ,;:'()-]+[.?!]$")
    found: dict[str, None] = {}
    for record in kind.records():
        if isinstance(record, Document):
            for sentence in re.split(r"(?<=[.?!])\s+", " ".join(record.text.split())):
                if 40 <= len(sentence) <= 240 and plain.match(sentence):
                    found.setdefault(sentence)
    return list(found)


def web_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL file of `megabytes` MB of distinct English documents (3-6 paragraphs of 3-6
    sentences drawn at random); returns the number of documents."""
    rng = random.Random(seed)
    pool = english_sentences()
    target, size, n = int(megabytes * 1e6), 0, 0
    with path.open("w", encoding="utf-8") as fh:
        while size < target:
            paragraphs = [" ".join(rng.sample(pool, rng.randint(3, 6))) for _ in range(rng.randint(3, 6))]
            text = "\n\n".join(paragraphs)
            fh.write(json.dumps({"id": f"w{n}", "text": text}) + "\n")
            size += len(text.encode())
            n += 1
    return n


class CpuMeter:
    """CPU seconds of this process and every process under it while it runs.

    datatrove's local executor starts its workers from a forkserver (a child that outlives the
    stage), so the kernel's RUSAGE_CHILDREN never sees them: the process tree is polled every
    0.2 s instead and each process counts with the last CPU time seen (a process that ends
    between two polls loses at most 0.2 s).
    """

    def __init__(self) -> None:
        import threading

        import psutil

        self._me = psutil.Process()
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            for proc in self._me.children(recursive=True):
                try:
                    t = proc.cpu_times()
                    self._seen[proc.pid] = t.user + t.system
                except psutil.Error:
                    continue

    def __enter__(self) -> CpuMeter:
        t = self._me.cpu_times()
        self._start = t.user + t.system
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        t = self._me.cpu_times()
        self.seconds = t.user + t.system - self._start + sum(self._seen.values())


def curated_text(folder: Path) -> list[str]:
    lines = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            lines += [f"{path.name}\t{line}" for line in fh]
    return lines


def scale(sizes: list[float], workers: list[int], root: Path) -> None:
    """Wall and CPU seconds per MB of the curate step at each corpus size and worker count."""
    import os

    from curation.source_kinds import SourceConfig
    from pipeline.artifact import Artifact
    from tasks.curate import CurationConfig, curate
    from tasks.sources import SourceSpec
    from tasks.sources import source as source_step

    quiet = lambda *a, **k: None  # noqa: E731
    print(f"cores available: {len(os.sched_getaffinity(0))}; load at start: {os.getloadavg()}")
    print("| MB | documents | workers | wall s | CPU s | CPU-s per MB | speedup | kept | output identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mb in sizes:
        src = root / f"src-{mb:g}"
        src.mkdir()
        docs = web_corpus(root / f"web-{mb:g}.jsonl", mb)
        cfg = SourceConfig(name="web", uri=f"files:{root / f'web-{mb:g}.jsonl'}", domain="web", shards=8)
        meta = source_step(SourceSpec(source=cfg, seed=0), out=src, log=quiet)
        corpus = Artifact(kind="corpus", uri=str(src), fingerprint="d".ljust(64, "0"), meta=meta)
        megabytes = (meta["characters"] + meta["heldout_characters"]) / 1e6
        first_wall, first_text = None, None
        for w in workers:
            out = root / f"cur-{mb:g}-{w}"
            out.mkdir()
            wall0 = time.perf_counter()
            with CpuMeter() as meter:
                kept = curate(CurationConfig(tasks=8, workers=w), corpus, out=out, log=quiet)["documents"]
            wall, cpu = time.perf_counter() - wall0, meter.seconds
            text = curated_text(out / "train") + curated_text(out / "heldout")
            first_wall = first_wall or wall
            first_text = first_text if first_text is not None else text
            print(
                f"| {megabytes:.1f} | {docs} | {w} | {wall:.1f} | {cpu:.1f} | {cpu / megabytes:.2f} | "
                f"{first_wall / wall:.2f}x | {kept} | {'yes' if text == first_text else 'NO'} |",
                flush=True,
            )
    print(f"load at end: {os.getloadavg()}")


def main() -> None:
    from curation.source_kinds import SourceConfig
    from pipeline.artifact import Artifact
    from tasks.curate import CurationConfig, curate
    from tasks.sources import SourceSpec, source

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--source", choices=["prose", "code", "math"], default="prose")
    parser.add_argument("--scale", action="store_true", help="CPU-s per MB and wall per worker count")
    parser.add_argument("--sizes", default="20,100", help="--scale: corpus sizes in MB")
    parser.add_argument("--workers", default="1,2", help="--scale: worker counts")
    args = parser.parse_args()
    quiet = lambda *a, **k: None  # noqa: E731
    if args.scale:
        with tempfile.TemporaryDirectory(prefix="bench-curate-scale-") as tmp:
            scale([float(x) for x in args.sizes.split(",")], [int(x) for x in args.workers.split(",")], Path(tmp))
        return

    root = Path(tempfile.mkdtemp(prefix="bench-curate-"))
    domain = {"prose": "web", "code": "code", "math": "math"}[args.source]
    src = root / "src"
    src.mkdir()
    cfg = SourceConfig(name=args.source, uri=f"builtin:{args.source}", domain=domain, held_out_fraction=0.0)
    meta = source(SourceSpec(source=cfg), out=src, log=quiet)
    corpus = Artifact(kind="corpus", uri=str(src), fingerprint="c".ljust(64, "0"), meta=meta)
    docs = meta["documents"]
    print(f"{args.source}: {docs} documents, {meta['characters'] / 1e6:.1f}M characters, preset {domain}")

    for r in range(args.rounds):
        out = root / f"step-{r}"
        out.mkdir()
        start = time.perf_counter()
        kept = curate(CurationConfig(), corpus, out=out, log=quiet)["documents"]
        step_s = time.perf_counter() - start

        start = time.perf_counter()
        bare_pipeline(domain, src / "train", root / f"bare-{r}")
        bare_s = time.perf_counter() - start
        print(
            f"round {r + 1}: step {docs / step_s:,.1f} docs/s ({step_s:.2f}s, kept {kept}), "
            f"bare datatrove {docs / bare_s:,.1f} docs/s ({bare_s:.2f}s), "
            f"ratio step/bare {bare_s / step_s:.2f}"
        )


if __name__ == "__main__":  # guarded: datatrove's executor may start processes that import this
    main()
