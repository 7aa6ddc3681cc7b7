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
"""

from __future__ import annotations

import argparse
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

    from tasks.curate import PRESETS, exact_text

    exact = ExactDedupConfig(content_getter=exact_text, hash_config=HashConfig(precision=64))
    mh = MinhashConfig(hash_config=HashConfig(precision=64))
    w = str(out)
    stages = [
        (
            [
                JsonlReader(str(train)),
                *PRESETS.get(preset)(),
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


def main() -> None:
    from pipeline.artifact import Artifact
    from tasks.curate import CurationConfig, curate
    from tasks.sources import SourceConfig, SourceSpec, source

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--source", choices=["prose", "code", "math"], default="prose")
    args = parser.parse_args()
    quiet = lambda *a, **k: None  # noqa: E731

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
