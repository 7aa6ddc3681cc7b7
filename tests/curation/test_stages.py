"""The curation stages the curate step runs (curation/stages.py): language ID only with a model,
and a recipe threshold reaching the filter of the planned pipeline."""

from __future__ import annotations

import pytest
from datatrove.data import Document

from curation.stages import plan_stages
from flows.recipe import load_recipe
from tasks.curate import CurationConfig


def test_language_filter_only_with_a_local_model(tmp_path):
    train = tmp_path / "train"
    names = lambda cfg: [type(s).__name__ for _, p, _ in plan_stages(cfg, "none", train, tmp_path, 1) for s in p]  # noqa: E731
    assert "LanguageFilter" not in names(CurationConfig())
    with pytest.raises(FileNotFoundError, match="language_model 'missing.bin'"):
        names(CurationConfig(language_model="missing.bin"))


def _gopher_quality(stages) -> object:
    """The GopherQualityFilter of the first (filter) stage the curate step would run."""
    from datatrove.pipeline.filters import GopherQualityFilter

    return next(c for c in stages[0][1] if isinstance(c, GopherQualityFilter))


def test_a_recipe_threshold_reaches_the_filter_the_step_runs(tmp_path):
    """`curation.filters.docs.gopher_quality.min_doc_words` is the threshold of the Gopher filter
    in the pipeline the curate step builds: a document of exactly that many words is kept, one
    word more in the threshold drops it as too short; the preset's other thresholds stay."""
    # 60 words as spaCy counts them (no punctuation, no contractions), passing Gopher's other rules
    text = " ".join(["the", "reading", "room", "and", "the", "garden", "open", "early", "with", "light"] * 6)
    words = 60

    def verdict(overrides: list[str]) -> tuple[object, object]:
        cfg = load_recipe("tiny", overrides).curation
        gopher = _gopher_quality(plan_stages(cfg, "docs", tmp_path / "train", tmp_path / "out", 1))
        return gopher, gopher.filter(Document(text=text, id="d"))

    gopher, kept = verdict([])
    assert gopher.min_doc_words == 50 and gopher.max_non_alpha_words_ratio == 0.7 and kept is True
    gopher, kept = verdict([f"curation.filters.docs.gopher_quality.min_doc_words={words}"])
    assert gopher.min_doc_words == words and kept is True
    gopher, dropped = verdict([f"curation.filters.docs.gopher_quality.min_doc_words={words + 1}"])
    assert dropped == (False, "gopher_short_doc")
    assert gopher.max_non_alpha_words_ratio == 0.7  # the docs preset's own default is kept under the override


def test_stage_stats_are_summed_from_the_tasks_files_in_the_local_executors_form(tmp_path):
    """On Slurm and Ray datatrove's merged stats.json (written by a later job on Slurm) holds a
    per-task counter as a summary; read_stage_stats sums the tasks' own files and gives totals."""
    import json

    from curation.stages import read_stage_stats

    folder = tmp_path / "filter" / "stats"
    folder.mkdir(parents=True)
    for rank, (rejected, docs) in enumerate([(1, 10), (2, 12)]):
        task = [
            {
                "name": "reader",
                "time_stats": 0,
                "stats": {"rejected_too_large": rejected, "doc_len": {"total": docs * 5, "n": docs, "mean": 5}},
            }
        ]
        (folder / f"{rank:05d}.json").write_text(json.dumps(task))
    (tmp_path / "filter" / "stats.json").write_text("[]")  # a merge job's file, stale or late: not read
    [entry] = read_stage_stats(tmp_path, "filter")
    assert entry["stats"]["rejected_too_large"] == 3 and entry["stats"]["doc_len"]["total"] == 110
    assert read_stage_stats(tmp_path, "nothing") == []


def test_publication_records_each_steps_own_rows_and_a_low_kept_share_once():
    """The curate step publishes its rows; the decontaminate step after it only its own (the
    rows from `published_rows` on), so a source's rows in lineage are its whole table once; the
    Prefect table is the whole table; a low kept share the curate step published is not again."""
    from curation.stages import publication

    def row(position, name, docs_in, docs_out):
        return {
            "position": position,
            "filter": name,
            "docs_in": docs_in,
            "docs_out": docs_out,
            "chars_in": 10 * docs_in,
            "chars_out": 10 * docs_out,
            "reasons": {name: docs_in - docs_out} if docs_in > docs_out else {},
        }

    rows = [row(0, "read", 10, 10), row(1, "exact_dedup", 10, 8), row(2, "heldout_decont", 8, 1)]
    low = {"kept_share": 0.1, "floor": 0.2, "filter": "heldout_decont", "removed": 7, "reasons": {}, "message": "m"}
    curated = publication("a" * 64, "src", rows[:2], {})
    assert [r[3] for r in curated["filter_stats"]] == ["read", "exact_dedup"] and curated["event"] is None
    clean = publication("b" * 64, "src", rows, {"published_rows": 2, "low_kept_share": low})
    assert [(r[0][0], r[2], r[3]) for r in clean["filter_stats"]] == [("b", 2, "heldout_decont")]
    assert [r["filter"] for r in clean["table"]["table"]] == ["read", "exact_dedup", "heldout_decont"]
    assert clean["table"]["key"] == curated["table"]["key"] == "curate-src"
    assert clean["event"]["event"] == "smollm3.curation.low_kept_share" and len(clean["data_events"]) == 1
    again = publication(
        "b" * 64, "src", rows, {"published_rows": 2, "low_kept_share": low, "low_kept_share_published": True}
    )
    assert again["event"] is None and again["data_events"] == []
