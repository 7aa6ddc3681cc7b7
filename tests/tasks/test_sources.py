"""Data sources: built-in corpora, local files with bad input, HF folders, held-out splits."""

from __future__ import annotations

import gzip
import json

import pytest

from curation.source_kinds import SourceConfig, check_sources, is_held_out, read_shards, source_state
from tasks.sources import SourceSpec, source


def _cfg(**kw) -> SourceConfig:
    base = {"name": "s", "uri": "builtin:math", "domain": "math"}
    return SourceConfig(**{**base, **kw})


def _texts(folder):
    return [d["text"] for d in read_shards(folder)]


def test_builtin_math_is_deterministic_per_seed(tmp_path):
    cfg = _cfg(max_documents=300)
    a = source(SourceSpec(source=cfg), out=tmp_path / "a", log=lambda _: None)
    b = source(SourceSpec(source=cfg), out=tmp_path / "b", log=lambda _: None)
    c = source(SourceSpec(source=cfg, seed=1), out=tmp_path / "c", log=lambda _: None)
    assert _texts(tmp_path / "a" / "train") == _texts(tmp_path / "b" / "train")
    assert _texts(tmp_path / "a" / "train") != _texts(tmp_path / "c" / "train")
    assert a["documents"] + a["heldout_documents"] == 300 == c["documents"] + c["heldout_documents"]
    assert b == a
    doc = next(read_shards(tmp_path / "a" / "train"))
    answer = doc["metadata"]["answer"]
    assert doc["text"].startswith("Problem: ") and doc["text"].endswith(f"Answer: {answer}")


def test_math_answers_are_correct(tmp_path):
    source(SourceSpec(source=_cfg(max_documents=200), seed=3), out=tmp_path, log=lambda _: None)
    checked = 0
    for doc in read_shards(tmp_path / "train"):
        first = doc["text"].split("\n")[0]
        if first.startswith("Problem: What is "):
            expr = first.removeprefix("Problem: What is ").rstrip("?").replace("/", "//")
            assert str(eval(expr)) == doc["metadata"]["answer"]  # noqa: S307 - our own arithmetic
            checked += 1
    assert checked > 20


def test_builtin_prose_and_code(tmp_path):
    prose = source(
        SourceSpec(source=_cfg(uri="builtin:prose", domain="web", max_documents=80)),
        out=tmp_path / "p",
        log=lambda _: None,
    )
    code = source(
        SourceSpec(source=_cfg(uri="builtin:code", domain="code", max_documents=30)),
        out=tmp_path / "c",
        log=lambda _: None,
    )
    kinds = {d["metadata"]["kind"] for d in read_shards(tmp_path / "p" / "train")}
    assert "pydoc_topic" in kinds and prose["characters"] > 50_000
    code_docs = list(read_shards(tmp_path / "c" / "train"))
    assert all(d["id"].startswith("stdlib:") and d["id"].endswith(".py") for d in code_docs)
    assert any("def " in d["text"] for d in code_docs) and code["documents"] > 20


def test_held_out_split_is_disjoint_and_stable(tmp_path):
    meta = source(SourceSpec(source=_cfg(max_documents=2000, held_out_fraction=0.1)), out=tmp_path, log=lambda _: None)
    train = {d["id"] for d in read_shards(tmp_path / "train")}
    held = {d["id"] for d in read_shards(tmp_path / "heldout")}
    assert not train & held
    assert 120 <= len(held) <= 280 and meta["heldout_documents"] == len(held)
    assert all(is_held_out("s", i, 0.1) for i in held)
    assert not any(is_held_out("s", i, 0.1) for i in train)


def _write_bad_jsonl(path):
    with open(path, "wb") as fh:
        fh.write(json.dumps({"text": "a good document about cats", "id": "g1"}).encode() + b"\n")
        fh.write(b'{"text": "broken json"\n')  # malformed
        fh.write(b'{"text": "bad \xff\xfe bytes"}\n')  # invalid UTF-8
        fh.write(json.dumps({"content": "no text field"}).encode() + b"\n")
        fh.write(json.dumps({"text": "   "}).encode() + b"\n")  # empty
        fh.write(json.dumps({"text": "x" * 5000}).encode() + b"\n")  # too large for the config
        fh.write(json.dumps([1, 2, 3]).encode() + b"\n")  # not an object
        fh.write(json.dumps({"text": "another good document", "id": "g2", "lang": "en"}).encode() + b"\n")


def test_files_source_counts_every_bad_record(tmp_path):
    _write_bad_jsonl(tmp_path / "a.jsonl")
    cfg = _cfg(
        uri=f"files:{tmp_path}/*.jsonl", domain="web", id_field="id", max_document_chars=1000, held_out_fraction=0.0
    )
    logs: list[str] = []
    meta = source(SourceSpec(source=cfg), out=tmp_path / "out", log=logs.append)
    assert meta["documents"] == 2
    assert meta["rejected"] == {
        "malformed_json": 2,
        "invalid_utf8": 1,
        "missing_text_field": 1,
        "empty": 1,
        "too_large": 1,
    }
    assert meta["rejected_examples"]["invalid_utf8"] == ["a.jsonl:3"]
    assert any("rejected 6 records" in line for line in logs)
    docs = list(read_shards(tmp_path / "out" / "train"))
    assert [d["id"] for d in docs] == ["g1", "g2"] and docs[1]["metadata"]["lang"] == "en"


def test_files_source_reads_gzip_and_parquet_and_writes_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"body": "gzip document"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"body": "parquet document", "n": 1}]), tmp_path / "b.parquet")
    cfg = _cfg(
        uri=f"files:{tmp_path}/*", domain="web", text_field="body", held_out_fraction=0.0, output_format="parquet"
    )
    meta = source(SourceSpec(source=cfg), out=tmp_path / "out", log=lambda _: None)
    assert meta["shards"]["train"] == ["00000.parquet", "00001.parquet"]  # dealt: one document each
    assert sorted(_texts(tmp_path / "out" / "train")) == ["gzip document", "parquet document"]


def test_train_split_is_dealt_into_enough_shards_for_the_tasks(tmp_path):
    """A source under documents_per_shard still splits into `shards` near-equal shards (so
    curation runs that many tasks), and a large one into shards of documents_per_shard."""
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i}", "id": str(i)}) + "\n" for i in range(100))
    )
    small = _cfg(uri=f"files:{tmp_path}/d.jsonl", domain="web", id_field="id", held_out_fraction=0.0, shards=8)
    meta = source(SourceSpec(source=small, seed=0), out=tmp_path / "small", log=lambda _: None)
    sizes = [len(list(read_shards_file(tmp_path / "small" / "train" / n))) for n in meta["shards"]["train"]]
    assert len(sizes) == 8 and sorted(sizes) == [12] * 4 + [13] * 4
    assert meta["shards"]["heldout"] == []  # one stream, no documents
    capped = small.model_copy(update={"shards": 2, "documents_per_shard": 10})
    meta = source(SourceSpec(source=capped, seed=0), out=tmp_path / "capped", log=lambda _: None)
    assert len(meta["shards"]["train"]) == 10  # two streams, each rolled over every 10 documents
    texts = [t for n in meta["shards"]["train"] for t in read_shards_file(tmp_path / "capped" / "train" / n)]
    assert sorted(texts) == sorted(f"document {i}" for i in range(100))


def read_shards_file(path):
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


def test_blank_lines_of_a_jsonl_file_are_counted(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n   \n{"text": "two"}\n')
    cfg = _cfg(uri=f"files:{tmp_path}/b.jsonl", domain="web", held_out_fraction=0.0)
    meta = source(SourceSpec(source=cfg, seed=0), out=tmp_path / "out", log=lambda _: None)
    assert meta["documents"] == 2 and meta["rejected"] == {"blank_line": 2}
    assert meta["rejected_examples"]["blank_line"] == ["b.jsonl:2", "b.jsonl:3"]


def test_no_matching_files_is_a_clear_error(tmp_path):
    cfg = _cfg(uri=f"files:{tmp_path}/nothing-*.jsonl", domain="web")
    with pytest.raises(ValueError, match=r"sources\[s\]\.uri: no files match"):
        source(SourceSpec(source=cfg), out=tmp_path / "out", log=lambda _: None)
    with pytest.raises(FileNotFoundError, match=r"sources\[s\]\.uri: no files match"):
        source_state(cfg, 0)  # the fingerprint, computed before the step runs, says the same


def test_parquet_without_the_text_column_is_counted_unread_and_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(8):  # check() reads the first 8 files' schemas; the 9th is read by the step
        pq.write_table(pa.Table.from_pylist([{"text": f"doc {k}"}]), tmp_path / f"a{k}.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"content": f"doc {i}", "url": "u"} for i in range(10)]), tmp_path / "z.parquet"
    )
    cfg = _cfg(uri=f"files:{tmp_path}/*.parquet", domain="web", held_out_fraction=0.0)
    meta = source(SourceSpec(source=cfg), out=tmp_path / "out", log=lambda _: None)
    assert meta["documents"] == 8 and meta["rejected"] == {"missing_text_field": 10}
    assert meta["rejected_examples"]["missing_text_field"] == ["z.parquet: all 10 rows"]
    only_bad = _cfg(uri=f"files:{tmp_path}/z.parquet", domain="web")
    with pytest.raises(
        ValueError, match=r"sources\[s\]\.text_field: 'text' is not a field of .*z.parquet \(fields: content, url\)"
    ):
        source(SourceSpec(source=only_bad), out=tmp_path / "out2", log=lambda _: None)


def test_no_documents_because_of_the_text_field_says_so(tmp_path):
    # the first records hold strings (what the check reads), the rest numbers: only reading tells
    lines = [{"text": "a document", "id": "0"}] + [{"text": i, "id": str(i)} for i in range(1, 30)]
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = _cfg(uri=f"files:{tmp_path}/n.jsonl", domain="web", id_field="id", held_out_fraction=0.0)
    assert check_sources([cfg]) == []  # of the first 20 records, one holds text in the field
    meta = source(SourceSpec(source=cfg, seed=0), out=tmp_path / "out", log=lambda _: None)
    assert meta["documents"] == 1 and meta["rejected"] == {"missing_text_field": 29}
    numbers = _cfg(uri=f"files:{tmp_path}/n.jsonl", domain="web")
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[1:]))
    with pytest.raises(ValueError, match=r"sources\[s\]\.text_field: 'text' of .* holds no strings"):
        source(SourceSpec(source=numbers, seed=0), out=tmp_path / "out2", log=lambda _: None)


def _numbered(path, ids):
    with open(path, "w") as fh:
        for i in ids:
            fh.write(json.dumps({"id": f"d{i}", "text": f"document number {i} of the capped source"}) + "\n")


def test_the_held_out_split_is_capped_in_documents_whatever_the_read_order(tmp_path):
    from curation.source_kinds import held_out_rank

    n, cap = 600, 25
    _numbered(tmp_path / "a.jsonl", range(n))
    _numbered(tmp_path / "b.jsonl", reversed(range(n)))  # the same documents, read in another order
    selected = [f"d{i}" for i in range(n) if is_held_out("s", f"d{i}", 0.3)]
    assert len(selected) > cap  # the fraction alone would hold out ~180
    smallest = sorted(selected, key=lambda i: held_out_rank("s", i))[:cap]
    splits = {}
    for name in ("a", "b"):
        cfg = _cfg(uri=f"files:{tmp_path}/{name}.jsonl", domain="web", id_field="id", held_out_fraction=0.3)
        logs: list[str] = []
        meta = source(SourceSpec(source=cfg, held_out_max_documents=cap), out=tmp_path / name, log=logs.append)
        held = [d["id"] for d in read_shards(tmp_path / name / "heldout")]
        train = [d["id"] for d in read_shards(tmp_path / name / "train")]
        assert sorted(held) == sorted(smallest) and meta["heldout_documents"] == cap
        assert meta["documents"] == n - cap and sorted(held + train) == sorted(f"d{i}" for i in range(n))
        assert meta["heldout_capped"] == len(selected) - cap and meta["heldout_max_documents"] == cap
        assert any(f"held-out split capped at {cap} documents" in line for line in logs)
        splits[name] = held
    assert splits["a"] == sorted(smallest, key=lambda i: int(i[1:]))  # written in read order
    # without a cap: the fraction alone, as before
    cfg = _cfg(uri=f"files:{tmp_path}/a.jsonl", domain="web", id_field="id", held_out_fraction=0.3)
    meta = source(SourceSpec(source=cfg), out=tmp_path / "plain", log=lambda _: None)
    assert [d["id"] for d in read_shards(tmp_path / "plain" / "heldout")] == selected
    assert meta["heldout_capped"] == 0 and meta["heldout_max_documents"] is None


def test_a_cap_a_source_cannot_reach_changes_no_fingerprint():
    from pipeline.artifact import identity

    small = _cfg(max_documents=2000)
    assert SourceSpec.of(small, 0, 2000).held_out_max_documents is None  # at most 2,000 documents at all
    assert SourceSpec.of(_cfg(max_documents=2001), 0, 2000).held_out_max_documents == 2000
    web = _cfg(uri="hf:org/web", domain="web")
    assert SourceSpec.of(web, 0, 2000).held_out_max_documents == 2000
    assert SourceSpec.of(web.model_copy(update={"held_out_fraction": 0.0}), 0, 2000).held_out_max_documents is None
    assert identity(SourceSpec.of(small, 0, 2000)) == identity(SourceSpec.of(small, 0))
    assert identity(SourceSpec.of(web, 0, 2000)) != identity(SourceSpec.of(web, 0))


def _three_files(tmp_path, ids=True):
    """Three JSONL files with bad records in each and duplicate ids across and within them."""
    rows = {
        "a": [{"id": "x1", "text": "first x1"}, {"id": "x2", "text": "   "}, {"id": "x3", "text": "a three"}],
        "b": [{"id": "x4", "text": "b four"}, {"id": "x1", "text": "second x1"}, {"id": "x5", "text": "y" * 5000}],
        "c": [{"id": "x6", "text": "c six"}, {"id": "x4", "text": "second x4"}, {"id": "x7", "text": "c seven"}],
    }
    for name, records in rows.items():
        with open(tmp_path / f"{name}.jsonl", "w") as fh:
            for r in records:
                fh.write(json.dumps(r if ids else {"text": r["text"]}) + "\n")
            fh.write('{"text": broken\n')  # malformed, one per file
    return f"files:{tmp_path}/*.jsonl"


@pytest.mark.parametrize("tasks", [1, 3])
def test_duplicate_ids_across_read_tasks_are_found_and_rejections_counted(tmp_path, tasks):
    """Read by 3 datatrove tasks (one file each), ids checked in 3 hash buckets: the copies of x1
    and x4 in later files are dropped as duplicate_id exactly as one reader drops them, and every
    rejection is counted under its reason whichever task met it."""
    cfg = _cfg(uri=_three_files(tmp_path), domain="web", id_field="id", held_out_fraction=0.0, max_document_chars=1000)
    meta = source(SourceSpec(source=cfg, read_tasks=tasks), out=tmp_path / "out", log=lambda _: None)
    assert meta["read_tasks"] == tasks
    assert meta["rejected"] == {"empty": 1, "too_large": 1, "malformed_json": 3, "duplicate_id": 2}
    assert meta["rejected_examples"]["duplicate_id"] == ["x1", "x4"]  # in read order
    assert meta["rejected_examples"]["malformed_json"] == ["a.jsonl:4", "b.jsonl:4", "c.jsonl:4"]
    docs = list(read_shards(tmp_path / "out" / "train"))
    assert sorted(d["text"] for d in docs) == ["a three", "b four", "c seven", "c six", "first x1"]
    assert meta["documents"] == 5 and meta["characters"] == sum(len(d["text"]) for d in docs)
    assert not (tmp_path / "out" / "work").exists()  # the id buckets are gone with the step
    names = sorted(p.name for p in (tmp_path / "out" / "train").iterdir())
    assert names == sorted(meta["shards"]["train"])  # a shard emptied by the drops is gone too


def test_a_source_without_ids_gets_file_and_line_ids_in_every_task(tmp_path):
    cfg = _cfg(uri=_three_files(tmp_path, ids=False), domain="web", held_out_fraction=0.0, max_document_chars=1000)
    meta = source(SourceSpec(source=cfg, read_tasks=3), out=tmp_path / "out", log=lambda _: None)
    ids = sorted(d["id"] for d in read_shards(tmp_path / "out" / "train"))
    assert ids == ["a.jsonl:1", "a.jsonl:3", "b.jsonl:1", "b.jsonl:2", "c.jsonl:1", "c.jsonl:2", "c.jsonl:3"]
    assert "duplicate_id" not in meta["rejected"]  # the text repeats nothing of the ids


def test_the_held_out_cap_holds_across_read_tasks(tmp_path):
    """Four files read by 4 tasks keep the same held-out split under the cap as one reader: the
    `cap` smallest hashes of the whole source, with duplicates counted once."""
    from curation.source_kinds import held_out_rank

    n, cap = 800, 30
    for k in range(4):  # d0..d799 over four files, and every 50th id again in the next file
        ids = list(range(k * 200, (k + 1) * 200)) + [i for i in range(0, k * 200, 50)]
        _numbered(tmp_path / f"{k}.jsonl", ids)
    cfg = _cfg(uri=f"files:{tmp_path}/*.jsonl", domain="web", id_field="id", held_out_fraction=0.3)
    metas, held = {}, {}
    for tasks in (1, 4):
        out = tmp_path / f"out{tasks}"
        metas[tasks] = source(SourceSpec(source=cfg, held_out_max_documents=cap, read_tasks=tasks), out=out, log=print)
        held[tasks] = sorted(d["id"] for d in read_shards(out / "heldout"))
        train = [d["id"] for d in read_shards(out / "train")]
        assert sorted(held[tasks] + train) == sorted(f"d{i}" for i in range(n))  # each once
    selected = [f"d{i}" for i in range(n) if is_held_out("s", f"d{i}", 0.3)]
    assert held[4] == sorted(sorted(selected, key=lambda i: held_out_rank("s", i))[:cap]) == held[1]
    for key in ("documents", "heldout_documents", "heldout_capped", "rejected"):
        assert metas[1][key] == metas[4][key], key
    assert metas[4]["rejected"] == {"duplicate_id": 4 + 8 + 12}
    assert metas[4]["heldout_capped"] == len(selected) - cap


def test_the_recipe_curation_section_sets_the_read_tasks_and_executor_of_uncapped_sources_only():
    from pipeline.artifact import identity
    from tasks.curate import CurationConfig

    curation = CurationConfig(tasks=64, workers=2)
    capped = SourceSpec.of(_cfg(max_documents=3000), 0, None, curation)  # read by one task anyway
    assert capped.read_tasks is None and capped.workers == 2
    assert identity(capped) == identity(SourceSpec.of(_cfg(max_documents=3000), 0))  # tiny's fingerprints hold
    web = SourceSpec.of(_cfg(uri="hf:org/web", domain="web"), 0, 2000, curation)
    assert web.read_tasks == 64 and identity(web) != identity(SourceSpec.of(web.source, 0, 2000))
    assert identity(web) == identity(web.model_copy(update={"workers": 8, "executor": "ray"}))  # operational
    assert SourceSpec.of(_cfg(uri="builtin:prose", domain="web"), 0, None, curation).read_tasks is None  # one reader
