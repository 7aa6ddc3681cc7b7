"""Data-source kinds (curation/source_kinds.py): the offline check of a source's files and
fields, the state a source's fingerprint reads, the stdlib files the builtin sources read."""

from __future__ import annotations

import json

from curation.source_kinds import SourceConfig, check_sources, source_state


def _cfg(**kw) -> SourceConfig:
    base = {"name": "s", "uri": "builtin:math", "domain": "math"}
    return SourceConfig(**{**base, **kw})


def test_a_text_field_that_holds_no_strings_is_refused_by_the_check(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": {"body": "a struct, not text", "lang": "en"}, "id": "1"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    (tmp_path / "l.jsonl").write_text(json.dumps({"text": ["a", "list"]}) + "\n")
    datasets.Dataset.from_dict({"text": [[1, 2]]}).save_to_disk(str(tmp_path / "ds"))
    problems = check_sources(
        [
            _cfg(name="pq", uri=f"files:{tmp_path}/s.parquet", domain="web"),
            _cfg(name="js", uri=f"files:{tmp_path}/l.jsonl", domain="web"),
            _cfg(name="ds", uri=f"hf:{tmp_path / 'ds'}", domain="web"),
        ]
    )
    assert [p.split(":")[0] for p in problems] == [
        "sources[pq].text_field",
        "sources[js].text_field",
        "sources[ds].text_field",
    ]
    assert all("holds no strings" in p for p in problems)


def test_files_source_state_follows_the_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    cfg = _cfg(uri=f"files:{tmp_path}/*.jsonl", domain="web")
    before = source_state(cfg, 0)
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert source_state(cfg, 0) != before


def test_check_sources_names_the_field_and_the_fields_present(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("p.parquet", "q.parquet"):
        pq.write_table(pa.Table.from_pylist([{"content": "a", "url": "u"}] * 3), tmp_path / name)
    (tmp_path / "j.jsonl").write_text('{"body": "x", "id": 1}\n{"body": "y", "id": 2}\n')
    (tmp_path / "notes.csv").write_text("a,b\n")
    (tmp_path / "array.json").write_text('[{"text": "x"}, {"text": "y"}]\n')
    problems = check_sources(
        [
            _cfg(name="ok", uri="builtin:prose", domain="web"),
            _cfg(name="hub", uri="hf:HuggingFaceFW/fineweb-edu", domain="web"),  # not checked offline
            _cfg(name="none", uri=f"files:{tmp_path}/missing/*.jsonl", domain="web"),
            _cfg(name="pq", uri=f"files:{tmp_path}/*.parquet", domain="web"),
            _cfg(name="js", uri=f"files:{tmp_path}/j.jsonl", domain="web", text_field="body", id_field="doc_id"),
            _cfg(name="csv", uri=f"files:{tmp_path}/*", domain="web"),
            _cfg(name="arr", uri=f"files:{tmp_path}/array.json", domain="web"),
        ]
    )
    assert len(problems) == 5, problems
    none, pq_, js, csv, arr = problems
    assert none.startswith("sources[none].uri: no files match") and none.endswith(
        "fix the glob or give an absolute one"
    )
    assert pq_.startswith("sources[pq].text_field: 'text' is not a field of") and "(fields: content, url)" in pq_
    assert "p.parquet (nor of 1 more of the first 8 files)" in pq_  # one error for the field
    assert js.startswith("sources[js].id_field: 'doc_id'") and "(fields: body, id)" in js
    assert csv.startswith("sources[csv].uri: 1 of the 5 matched files are not JSONL or Parquet")
    assert arr.startswith("sources[arr].uri: cannot read") and "JSON lines expected" in arr


def test_check_sources_reads_a_save_to_disk_folder_without_loading_it(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["a"]})}).save_to_disk(str(tmp_path / "ds"))
    ok = _cfg(uri=f"hf:{tmp_path / 'ds'}", domain="web", text_field="body")
    assert check_sources([ok]) == []
    split = ok.model_copy(update={"hf_split": "validation"})
    column = ok.model_copy(update={"text_field": "text"})
    missing = _cfg(uri=f"hf:{tmp_path / 'nothing'}", domain="web")
    assert check_sources([split, column, missing]) == [
        f"sources[s].hf_split: 'validation' is not a split of {tmp_path / 'ds'} (splits: train)",
        f"sources[s].text_field: 'text' is not a column of {tmp_path / 'ds'} (columns: body)",
        f"sources[s].uri: {tmp_path / 'nothing'} is not a folder; hf:/PATH takes a folder written by datasets' save_to_disk",
    ]


def test_stdlib_files_are_what_rglob_finds_without_walking_site_packages():
    """The builtin sources' fingerprint reads these files: the fast walk must list exactly what
    `rglob` did, in the same order, or every tiny-recipe fingerprint would move."""
    import sysconfig
    from pathlib import Path

    from curation.source_kinds import _stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
    expected = [p for p in sorted(root.rglob("*.py")) if not skip.intersection(p.relative_to(root).parts)]
    assert len(expected) > 100 and _stdlib_files() == expected


def test_a_save_to_disk_folder_is_read_in_contiguous_blocks_of_rows_with_the_same_ids(tmp_path):
    """Each task reads a block of rows; a row's id (`row N`, no id_field) is the same for 1 or 3 tasks."""
    import datasets

    from curation.source_kinds import resolve_kind

    datasets.Dataset.from_dict({"text": [f"row text {i}" for i in range(10)]}).save_to_disk(str(tmp_path / "ds"))
    kind = resolve_kind("hf:")(_cfg(name="ds", uri=f"hf:{tmp_path / 'ds'}", domain="web"), 0)
    one = [(d.id, d.text) for d in kind.task_records(0, 1)]
    parts = [[(d.id, d.text) for d in kind.task_records(r, 3)] for r in range(3)]
    assert [len(p) for p in parts] == [3, 3, 4] and sum(parts, []) == one
    assert one[4] == ("row 4", "row text 4") and kind.max_tasks(3) == 3


def test_builtin_math_with_max_operand_asks_only_small_operands_and_its_answers_are_right():
    import random
    import re

    from curation.source_kinds import math_problem

    rng = random.Random(5)
    for _ in range(400):
        problem, solution, answer = math_problem(rng, max_operand=9)
        equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution)
        assert equations and all(eval(f"{x} {op} {y}") == int(z) for x, op, y, z in equations)
        assert equations[-1][3] == answer
        x, op, y, z = equations[0]
        # the operands drawn are at most 9; a division's dividend is a product of two of them
        assert max(int(y), int(z)) <= 9 if op == "/" else max(int(x), int(y)) <= 9
    # without it the generator draws what it always did: sums of up to 999
    plain = [math_problem(random.Random(5)) for _ in range(1)] + [math_problem(rng) for _ in range(50)]
    assert max(int(n) for problem, _, _ in plain for n in re.findall(r"\d+", problem)) > 99


def test_max_operand_is_for_builtin_math_only_and_out_of_the_identity_while_unset():
    import pytest
    from pydantic import ValidationError

    from pipeline.artifact import identity
    from tasks.sources import SourceSpec

    with pytest.raises(ValidationError, match="max_operand"):
        _cfg(name="p", uri="builtin:prose", domain="web", max_operand=9)
    assert "max_operand" not in identity(SourceSpec(source=_cfg(), seed=0))["source"]
    assert identity(SourceSpec(source=_cfg(max_operand=9), seed=0))["source"]["max_operand"] == 9
