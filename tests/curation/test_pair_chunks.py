"""Pair chunks on disk: a chunk is done only with its counts file, assembly gives the bytes of
one list written at once, refuses a chunk not done, and leaves no output under its name when it
fails; a chunk of another span is not taken for one of this plan."""

from __future__ import annotations

import json

import pytest

from curation.pair_chunks import ChunkStore, spans
from trainers.posttrain.chat_data import write_jsonl


def _rows(a: int, b: int) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"Q{i} é"}], "chosen": f"A{i}", "mode": "think"} for i in range(a, b)
    ]


def test_spans_cover_the_prompts_in_order():
    assert spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert spans(8, 4) == [(0, 4), (4, 8)]
    assert spans(0, 4) == []
    with pytest.raises(ValueError, match="chunk size must be positive"):
        spans(3, 0)


def test_chunks_assemble_into_the_bytes_of_one_write(tmp_path):
    store = ChunkStore(tmp_path)
    plan = [("think", s) for s in spans(5, 2)] + [("no_think", s) for s in spans(3, 2)]
    for mode, (a, b) in reversed(plan):  # any order, as shards of the prompts would make them
        store.write(mode, (a, b), _rows(a, b) if mode == "think" else _rows(100 + a, 100 + b), {"pairs": b - a})
    assert store.counts("think", (2, 4)) == {"pairs": 2}
    write_jsonl(tmp_path / "whole.jsonl", _rows(0, 5) + _rows(100, 103))
    size = store.assemble(tmp_path / "pairs.jsonl", plan)
    assert (tmp_path / "pairs.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    assert size == (tmp_path / "pairs.jsonl").stat().st_size
    assert not store.dir.exists()  # the chunks are gone once assembled
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl", "whole.jsonl"]


def test_a_chunk_without_its_counts_is_not_done_and_assembly_refuses_it(tmp_path):
    store = ChunkStore(tmp_path)
    store.write("think", (0, 2), _rows(0, 2), {"pairs": 2})
    # a kill between a chunk's rows and its counts: the rows file alone
    (store.dir / "think-000000002-000000004.jsonl").write_text(json.dumps(_rows(2, 3)[0]) + "\n")
    # a kill inside write_atomic: a temporary file, never read
    (store.dir / ".think-000000004-000000006.jsonl.123.tmp").write_text("{")
    assert store.counts("think", (2, 4)) is None and store.counts("think", (4, 6)) is None
    with pytest.raises(RuntimeError, match=r"not done: think \(2, 4\), think \(4, 6\)"):
        store.assemble(tmp_path / "pairs.jsonl", [("think", s) for s in spans(6, 2)])
    assert not (tmp_path / "pairs.jsonl").exists() and store.counts("think", (0, 2)) == {"pairs": 2}
    # rewriting the unfinished chunk finishes it, with the new rows
    store.write("think", (2, 4), _rows(2, 4), {"pairs": 2})
    store.write("think", (4, 6), _rows(4, 6), {"pairs": 2})
    store.assemble(tmp_path / "pairs.jsonl", [("think", s) for s in spans(6, 2)])
    write_jsonl(tmp_path / "whole.jsonl", _rows(0, 6))
    assert (tmp_path / "pairs.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()


def test_a_chunk_of_another_span_is_not_reused(tmp_path):
    store = ChunkStore(tmp_path)
    store.write("think", (0, 4), _rows(0, 4), {"pairs": 4})  # an attempt with 4 prompts per chunk
    assert [store.counts("think", s) for s in spans(6, 2)] == [None, None, None]
    assert store.counts("no_think", (0, 4)) is None


def test_a_failed_assembly_leaves_no_output(tmp_path):
    store = ChunkStore(tmp_path)
    store.write("think", (0, 2), _rows(0, 2), {"pairs": 2})
    target = tmp_path / "pairs.jsonl"
    (target / "x").mkdir(parents=True)  # the rename onto it fails after the copy
    with pytest.raises(OSError):
        store.assemble(target, [("think", (0, 2))])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunks", "pairs.jsonl"]  # no temporary file left
    assert target.is_dir() and store.counts("think", (0, 2)) == {"pairs": 2}  # the chunks are kept
