"""Multilingual curation on real paragraphs (tests/tasks/data/multilingual.json): each language's
web preset keeps its good text and removes wrong-language text and junk, counted per reason,
through the real datatrove pipeline of the curate step; language ID works offline."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from curation.presets import PRESETS
from pipeline.artifact import Artifact
from tasks.curate import CurationConfig, curate

DATA = json.loads((Path(__file__).parent / "data" / "multilingual.json").read_text(encoding="utf-8"))["documents"]
LANGS = sorted({d["source_language"] for d in DATA})


def corpus(folder: Path, docs: list[dict], source: str, language: str) -> Artifact:
    """A corpus artifact as the source step writes it: train shards, no held-out split."""
    (folder / "train").mkdir(parents=True)
    (folder / "heldout").mkdir()
    with gzip.open(folder / "train" / "00000.jsonl.gz", "wt", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"id": d["id"], "text": d["text"], "metadata": {}}, ensure_ascii=False) + "\n")
    meta = {"source": source, "domain": "web", "language": language, "format": "jsonl", "documents": len(docs)}
    return Artifact(
        kind="corpus", uri=str(folder), fingerprint=hashlib.sha256(str(folder).encode()).hexdigest(), meta=meta
    )


def kept(out: Path) -> dict[str, str]:
    texts = {}
    for path in sorted((out / "train").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                doc = json.loads(line)
                texts[doc["id"]] = doc["text"]
    return texts


@pytest.mark.parametrize("lang", LANGS)
def test_each_language_keeps_its_text_and_removes_wrong_language_and_junk(tmp_path, lang):
    docs = [d for d in DATA if d["source_language"] == lang]
    source = f"fw2-{lang}"
    preset = CurationConfig().preset_for(source, "web", lang)
    assert preset == ("web" if lang == "en" else f"web-{lang}") and preset in PRESETS
    cfg = CurationConfig(tasks=1, minhash=False, decontamination={"enabled": False})
    meta = curate(cfg, corpus(tmp_path / "in", docs, source, lang), out=tmp_path / "out", log=lambda _: None)
    texts = kept(tmp_path / "out")
    good = {d["id"]: d for d in docs if d["kind"] in ("good", "good_short")}
    assert set(texts) == set(good), f"{lang}: kept {sorted(texts)}, good {sorted(good)}"
    for doc_id, text in texts.items():  # nothing rewritten: paragraph breaks and all lines kept
        assert text == good[doc_id]["text"].strip()
        assert text.count("\n\n") == (2 if good[doc_id]["kind"] == "good" else 0)
    wrong = [d for d in docs if d["kind"] == "wrong_language"]
    junk = [d for d in docs if d["kind"] == "junk"]
    assert meta["removed"].get("language:wrong_language", 0) >= len(wrong)
    assert sum(meta["removed"].values()) == len(wrong) + len(junk) and meta["unaccounted"] == 0
    assert all(":" in k and not k.endswith(":") for k in meta["removed"])  # filter:reason
    rows = json.loads((tmp_path / "out" / "filter_stats.json").read_text())
    assert [r["filter"] for r in rows][:2] == ["read", "language"]


def test_wrong_language_documents_name_the_language_found(tmp_path):
    from datatrove.data import Document

    from curation.languages import LANGUAGES
    from curation.presets import web_filters, web_thresholds

    for d in (d for d in DATA if d["kind"] == "wrong_language"):
        settings = LANGUAGES[d["source_language"]]
        lid = web_filters(settings, web_thresholds(settings))[0]
        doc = Document(text=d["text"], id=d["id"])
        assert lid.filter(doc) == (False, "wrong_language")
        assert doc.metadata["language"] == d["language"] and doc.metadata["language_score"] > 0.9


def test_the_english_stack_would_remove_the_other_languages(tmp_path):
    """What the issue found: English stop words curate every other language away; the language's
    own preset keeps it (the test above)."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter

    removed = 0
    others = [d for d in DATA if d["kind"] == "good" and d["source_language"] != "en"]
    for d in others:
        doc = Document(text=d["text"], id=d["id"])
        removed += GopherRepetitionFilter().filter(doc) is not True or GopherQualityFilter().filter(doc) is not True
    assert removed == len(others)


def _verdicts(settings, thresholds, docs) -> dict[str, str]:
    """Each document's fate through the web stack: `kept` or `filter:reason`."""
    from datatrove.data import Document

    from curation.presets import web_filters

    out = {}
    for d in docs:
        doc, out[d["id"]] = Document(text=d["text"], id=d["id"]), "kept"
        for f in web_filters(settings, thresholds):
            verdict = f.filter(doc)
            if verdict is not True:
                out[d["id"]] = f"{type(f).__name__}:{verdict[1]}"
                break
    return out


def test_thai_korean_and_short_documents_were_removed_by_rules_that_do_not_fit_them():
    """The controls for the presets' changes (docs/data.md "Languages"): with FineWeb's English
    rules as they were, natural Thai is removed for lines without punctuation (Thai ends
    sentences with a space), a short good document for having fewer than 5 sentences, Korean
    news prose for too few stop words (particles attach to words); the presets keep all three."""
    from dataclasses import replace

    from curation.languages import LANGUAGES
    from curation.presets import C4Thresholds, FineWebQualityThresholds, web_thresholds

    def before(code):
        t = web_thresholds(LANGUAGES[code])
        return t.model_copy(
            update={
                "c4_quality": t.c4_quality.model_copy(update={"min_num_sentences": C4Thresholds().min_num_sentences}),
                "fineweb_quality": t.fineweb_quality.model_copy(
                    update={"line_punct_thr": FineWebQualityThresholds().line_punct_thr}
                ),
            }
        )

    thai = [d for d in DATA if d["source_language"] == "th" and d["kind"] == "good"]
    assert set(_verdicts(LANGUAGES["th"], before("th"), thai).values()) == {"FineWebQualityFilter:line_punct_ratio"}
    short = [d for d in DATA if d["kind"] == "good_short"]
    for d in short:
        code = d["source_language"]
        (verdict,) = _verdicts(LANGUAGES[code], before(code), [d]).values()
        assert verdict in ("ParagraphC4QualityFilter:too_few_sentences", "FineWebQualityFilter:line_punct_ratio")
    news = [d for d in DATA if d["id"] == "ko-good-3"]
    old_korean = replace(LANGUAGES["ko"], stop_words=LANGUAGES["ko"].stop_words[:14])  # the list as it was
    assert _verdicts(old_korean, web_thresholds(old_korean), news) == {
        "ko-good-3": "GopherQualityFilter:gopher_enough_stop_words"
    }
    for d in [*thai, *short, *news]:
        code = d["source_language"]
        assert _verdicts(LANGUAGES[code], web_thresholds(LANGUAGES[code]), [d]) == {d["id"]: "kept"}


def test_a_language_without_a_preset_is_refused_with_advice_that_works(tmp_path):
    """Turkish has no web preset: the recipe is refused naming the source, the languages that
    have one and the override that keeps it; that override then loads and curates it unfiltered."""
    from flows.recipe import RecipeError, load_recipe

    path = tmp_path / "tr.yaml"
    path.write_text(
        f"name: tr\nworkspace: {tmp_path / 'ws'}\nsources:\n  - name: tr\n    uri: builtin:prose\n"
        "    domain: web\n    language: tr\n"
    )
    with pytest.raises(RecipeError) as refused:
        load_recipe(str(path))
    message = str(refused.value)
    assert "sources[tr].language: no web preset for language 'tr'" in message
    assert "curation.presets.tr=none" in message and "th, vi, zh" in message
    recipe = load_recipe(str(path), ["curation.presets.tr=none"])
    source = recipe.sources[0]
    assert recipe.curation.preset_for(source.name, source.domain, source.language) == "none"
    with pytest.raises(RecipeError, match="'Turkish' is not a language code"):
        load_recipe(str(path), ["sources.tr.language=Turkish", "curation.presets.tr=none"])


def test_a_source_curated_far_below_what_its_preset_keeps_is_flagged_naming_the_filter(tmp_path, prefect_harness):
    """French text through the English preset keeps one English document of seven: the curate
    step still finishes, but says so in its log, its meta, lineage (`data_events`) and a Prefect
    event, naming the filter that removed the most; a source that keeps its text flags nothing."""
    from pipeline.workspace import Workspace
    from tasks.curate import publish_curated

    docs = [d for d in DATA if d["id"] == "en-good-0"] + [d for d in DATA if d["source_language"] == "fr"]
    cfg = CurationConfig(tasks=1, minhash=False, decontamination={"enabled": False}, presets={"fw2-fr": "web"})
    lines: list[str] = []
    meta = curate(cfg, corpus(tmp_path / "in", docs, "fw2-fr", "fr"), out=tmp_path / "out", log=lines.append)
    low = meta["low_kept_share"]
    assert (meta["documents"], meta["input_documents"]) == (1, 7)
    assert low["kept_share"] == round(1 / 7, 4) and low["floor"] == 0.2 and low["filter"] == "language"
    assert low["removed"] == meta["removed"]["language:wrong_language"] + meta["removed"].get("language:low_score", 0)
    (warning,) = [line for line in lines if line.startswith("WARNING")]
    assert "WARNING curate fw2-fr (web): kept 1 of 7 documents (14.3%), below curation.min_kept_share 0.2" in warning
    assert "language removed the most" in warning

    ws = Workspace.at(tmp_path / "ws")
    art = Artifact(kind="corpus", uri=str(tmp_path / "out"), fingerprint="c" * 64, meta=meta)
    publish_curated(art, ws, "fw2-fr")
    (row,) = ws.lineage().query_dicts("SELECT source, kind, value, threshold, message, facts FROM data_events")
    assert (row["source"], row["kind"], row["value"], row["threshold"]) == (
        "fw2-fr",
        "low_kept_share",
        low["kept_share"],
        0.2,
    )
    assert row["message"] == low["message"] and json.loads(row["facts"])["filter"] == "language"

    # the control: the source's own preset keeps its French text and flags nothing
    cfg = CurationConfig(tasks=1, minhash=False, decontamination={"enabled": False})
    lines.clear()
    meta = curate(cfg, corpus(tmp_path / "in2", docs, "fw2-fr", "fr"), out=tmp_path / "out2", log=lines.append)
    assert "low_kept_share" not in meta and not any(line.startswith("WARNING") for line in lines)
