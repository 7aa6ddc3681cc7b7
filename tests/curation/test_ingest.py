"""Ingestion's duplicate-id stage: ids partitioned by hash, each bucket task reporting the
duplicates of its bucket after their first occurrence in read order (curation/ingest.py)."""

from __future__ import annotations

import json

from curation.ingest import IdBucketTask, id_bucket
from curation.source_kinds import SourceConfig


def _bucket_files(work, task, ids, buckets, candidates=()):
    """What read task `task` writes: each kept id to its bucket, with its position."""
    for position, doc_id in enumerate(ids):
        folder = work / "ids" / f"{task:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{id_bucket(doc_id, buckets):05d}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps([position, int(doc_id in candidates), doc_id]) + "\n")


def test_ids_are_spread_over_the_buckets_the_same_way_in_every_process():
    ids = [f"doc-{i}" for i in range(4000)]
    per_bucket = [sum(id_bucket(i, 4) == b for i in ids) for b in range(4)]
    assert all(800 < n < 1200 for n in per_bucket)  # no bucket holds every id
    assert id_bucket("doc-7", 4) == id_bucket("doc-7", 4) and 0 <= id_bucket("x", 1) < 1


def test_a_duplicate_across_two_read_tasks_is_found_by_its_bucket_alone(tmp_path):
    """Task 0 read d1, d2, d3; task 1 read d4, d2, d5, d2: each bucket task reads only its bucket
    of both tasks; d2's bucket reports task 1's two copies (positions 1 and 3), none of task 0."""
    buckets = 3
    _bucket_files(tmp_path / "work", 0, ["d1", "d2", "d3"], buckets)
    _bucket_files(tmp_path / "work", 1, ["d4", "d2", "d5", "d2"], buckets, candidates={"d2"})
    source = SourceConfig(name="s", uri="builtin:math", domain="math")
    step = IdBucketTask(source, 0, tmp_path, buckets, cap=10)
    for bucket in range(buckets):
        step.run(rank=bucket, world_size=buckets)
    found = {}
    for path in sorted((tmp_path / "work" / "drops").rglob("*.jsonl")):
        assert int(path.stem) == id_bucket("d2", buckets)  # only d2's bucket found anything
        found[int(path.parent.name)] = [json.loads(line) for line in path.read_text().splitlines()]
    assert found == {1: [[1, "d2"], [3, "d2"]]}
    dropped = (tmp_path / "work" / "dropped_candidates" / f"{id_bucket('d2', buckets):05d}.tsv").read_text()
    assert dropped.splitlines() == ["1\t1", "1\t3"]  # held-out candidates among them: out of the cap
