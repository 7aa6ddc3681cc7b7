"""curation/io.py: the JSONL reader that counts each line it rejects, under its reason, and reads
one file per rank when asked; the writer that keeps a few removed documents per reason."""

from __future__ import annotations

import gzip
import json

from datatrove.data import Document

from curation.io import READ_REASONS, CountingJsonlReader, SampleWriter

LINES = [
    json.dumps({"text": "a good document", "id": "d1"}).encode(),
    b"{not json",
    b'{"text": "\xff\xfe broken utf-8"}',
    json.dumps({"title": "no text field"}).encode(),
    json.dumps({"text": "   "}).encode(),
    json.dumps({"text": "x" * 50}).encode(),
    b"   ",
    json.dumps(["a list, not a record"]).encode(),
    json.dumps({"text": "second good one"}).encode(),
]


def _write(folder, name, lines):
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / name, "wb") as fh:
        fh.write(b"\n".join(lines) + b"\n")


def test_every_line_is_a_document_or_a_counted_rejection(tmp_path):
    _write(tmp_path / "in", "00000.jsonl.gz", LINES)
    reader = CountingJsonlReader(str(tmp_path / "in"), max_chars=40)
    docs = list(reader.run())
    assert [d.text for d in docs] == ["a good document", "second good one"]
    # a record without an id gets its location as id, so every document stays traceable
    assert docs[0].id == "d1" and docs[1].id.endswith("00000.jsonl.gz:9")
    stats = {k: v.total for k, v in reader.stats.stats.items()}
    expected = {
        "malformed_json": 2,  # the broken line and the list
        "invalid_utf8": 1,
        "missing_text_field": 1,
        "empty": 1,
        "too_large": 1,
        "blank_line": 1,
    }
    assert set(expected) == set(READ_REASONS)
    assert {r: stats.get(f"rejected_{r}", 0) for r in READ_REASONS} == expected
    assert stats["rejected"] == sum(expected.values()) == len(LINES) - len(docs)


def test_rank_files_reads_exactly_that_ranks_file(tmp_path):
    folder = tmp_path / "in"
    _write(folder, "00000.jsonl.gz", [json.dumps({"text": "rank zero"}).encode()])
    _write(folder, "00001.jsonl.gz", [json.dumps({"text": "rank one"}).encode()])
    reader = CountingJsonlReader(str(folder), rank_files=True)
    assert [d.text for d in reader.run(rank=1, world_size=2)] == ["rank one"]
    assert [d.text for d in CountingJsonlReader(str(folder), rank_files=True).run(rank=0, world_size=2)] == [
        "rank zero"
    ]
    assert list(CountingJsonlReader(str(folder), rank_files=True).run(rank=2, world_size=3)) == []


def test_the_sample_writer_keeps_at_most_n_documents_per_reason(tmp_path):
    writer = SampleWriter(str(tmp_path / "removed"), per_reason=2)
    with writer:
        for i in range(5):
            writer.write(Document(text=f"short {i}", id=f"s{i}", metadata={"filter_reason": "too_short"}))
        writer.write(Document(text="dup", id="d0", metadata={}))  # no reason: a duplicate
    with gzip.open(tmp_path / "removed" / "00000.jsonl.gz", "rt") as fh:
        kept = [json.loads(line)["id"] for line in fh]
    assert kept == ["s0", "s1", "d0"]
