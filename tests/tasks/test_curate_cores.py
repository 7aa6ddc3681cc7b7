"""Every core: a source is dealt into enough shards for its tasks, and the curated output is the
same whatever the worker count (workers are operational: they never enter a fingerprint); the
default worker count per stage: tests/curation/test_executors.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from curation.source_kinds import SourceConfig
from pipeline.artifact import Artifact
from tasks.curate import CurationConfig, curate
from tasks.sources import SourceSpec
from tasks.sources import source as source_step

DATA = json.loads((Path(__file__).parent / "data" / "multilingual.json").read_text(encoding="utf-8"))["documents"]


def english_source(tmp_path: Path) -> SourceConfig:
    """English paragraphs with exact and near copies, as a JSONL source of 120 documents."""
    good = [d["text"] for d in DATA if d["source_language"] == "en" and d["kind"] == "good"]
    junk = [d["text"] for d in DATA if d["source_language"] == "en" and d["kind"] != "good"]
    lines = []
    for i in range(120):
        base = good[i % 2]
        if i % 3 == 0:
            text = base  # exact copies of the two documents
        elif i % 3 == 1:
            text = base + f"\n\nThis copy is number {i}."  # near copies
        else:
            text = junk[i % len(junk)] if i % 10 == 2 else base.replace("the", f"the {i}", 1) + f" Note {i}."
        lines.append(json.dumps({"text": text, "id": f"d{i}"}))
    path = tmp_path / "en.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return SourceConfig(name="en", uri=f"files:{path}", domain="web", id_field="id", shards=8, held_out_fraction=0)


def contents(folder: Path) -> dict[str, list[str]]:
    out = {}
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            out[path.name] = fh.read().splitlines()
    return out


@pytest.mark.slow
def test_the_output_is_the_same_whatever_the_worker_count(tmp_path):
    source = english_source(tmp_path)
    meta = source_step(SourceSpec(source=source, seed=0), out=tmp_path / "corpus", log=lambda _: None)
    assert len(meta["shards"]["train"]) == 8
    art = Artifact(kind="corpus", uri=str(tmp_path / "corpus"), fingerprint="1" * 64, meta=meta)
    results = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        cfg = CurationConfig(tasks=4, workers=workers)
        m = curate(cfg, art, out=out, log=lambda _: None)
        results[workers] = (contents(out / "train"), contents(out / "heldout"), m["removed"], m["documents"])
        assert m["tasks"] == 4
    assert results[1] == results[2]
    train, _, removed, kept = results[1]
    assert 0 < len(train) <= 4 and kept > 0  # one output file per task that kept documents
    assert any(k.startswith("exact") for k in removed) and any(k.startswith("minhash") for k in removed)
