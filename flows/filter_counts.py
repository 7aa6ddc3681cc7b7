"""`python -m flows.filter_counts RECIPE SOURCE [key=value ...] [--out DIR]`: one source read and
curated and decontaminated against its own held-out split outside any flow (no Prefect, no cache),
then its per-filter tables (train and held-out).

What docs/data.md's per-filter counts are measured with: e.g. the tiny recipe's prose under the
web preset (`curation.presets.prose=web`) and under its own docs preset.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from curation.stages import format_rows
from pipeline.artifact import Artifact
from tasks.curate import curate
from tasks.decontaminate import DecontaminateSpec, decontaminate
from tasks.heldout_index import HeldoutIndexSpec, heldout_index


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flows.filter_counts RECIPE SOURCE [key=value ...] [--out DIR]`: one source and its
    curation outside the flow (no Prefect, no cache), then the per-filter tables."""
    import argparse
    import tempfile

    from flows.recipe import load_recipe
    from tasks.sources import SourceSpec, source

    parser = argparse.ArgumentParser(prog="python -m flows.filter_counts", description=main.__doc__)
    parser.add_argument("recipe")
    parser.add_argument("source")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--out", default=None, help="folder for the corpus and curated outputs (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    config = recipe.source(args.source)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="curate-"))
    raw, cured, index, cur = root / "source", root / "curate", root / "heldout_index", root / "curated"
    for folder in (raw, cured, index, cur):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    quiet = lambda _msg: None  # noqa: E731
    meta = source(SourceSpec(source=config, seed=recipe.seed), out=raw, log=quiet)
    corpus = Artifact(kind="corpus", uri=str(raw), fingerprint="0" * 64, meta=meta)
    # as the flow's steps see it; the index holds this source's held-out split only
    cured_meta = curate(recipe.curation.for_source(config), corpus, out=cured, log=print)
    cured_art = Artifact(kind="corpus", uri=str(cured), fingerprint="1" * 64, meta=cured_meta)
    cmeta = cured_meta
    if recipe.curation.decontamination.enabled:
        imeta = heldout_index(HeldoutIndexSpec.of(recipe.curation, [config]), [corpus], out=index, log=print)
        index_art = Artifact(kind="heldout_index", uri=str(index), fingerprint="2" * 64, meta=imeta)
        cmeta = decontaminate(DecontaminateSpec.of(recipe.curation), cured_art, index_art, out=cur, log=print)
    else:
        cur = cured
    print(
        f"\nsource {args.source}: {meta['documents']} train documents, {meta['characters']:,} characters; "
        f"held-out {meta['heldout_documents']} documents; rejected {meta['rejected']}"
    )
    print(f"\ntrain ({cmeta['preset']} preset):\n")
    print(format_rows(json.loads((cur / "filter_stats.json").read_text(encoding="utf-8"))))
    print("\nheld-out:\n")
    print(format_rows(json.loads((cur / "heldout_filter_stats.json").read_text(encoding="utf-8"))))
    print(
        f"\ncurated: {cmeta['documents']} documents, {cmeta['characters']:,} characters "
        f"(held-out {cmeta['heldout_documents']}, {cmeta['heldout_characters']:,}); outputs in {root}"
    )
    return 0


if __name__ == "__main__":  # datatrove's local executor starts forkserver workers: guard the entry
    sys.exit(main())
