"""The fertility step: its outputs, and the text it measures on (the measures and the rule are
tests/evals/test_tokenizer_fertility.py's)."""

from __future__ import annotations

import json

import pytest

from pipeline.artifact import Artifact
from tasks.fertility import FertilityConfig, FertilitySpec, fertility
from tests.evals.test_tokenizer_fertility import TEXTS, char_level, word_level
from tests.tasks.datafiles import PARAGRAPHS, corpus


def test_build_writes_table_chart_and_decision(tmp_path):
    word_level(tmp_path / "words.json")
    tok_dir = tmp_path / "trained"
    tok_dir.mkdir()
    char_level(tok_dir / "tokenizer.json")
    trained = Artifact(kind="tokenizer", uri=str(tok_dir), fingerprint="1" * 64, meta={})
    web = corpus(tmp_path / "web", [("t", "ab")], heldout=[("h1", TEXTS[0])], source="web")
    code = corpus(tmp_path / "code", [("t", "ab")], heldout=[("h2", TEXTS[1])], source="code")
    out = tmp_path / "out"
    out.mkdir()
    config = FertilityConfig(candidates=(str(tmp_path / "words.json"),))
    meta = fertility(FertilitySpec(fertility=config, weights={"web": 0.5, "code": 0.5}), trained, [web, code], out=out)
    assert meta["selected"]["name"] == str(tmp_path / "words.json")
    assert meta["selected"]["eos_token"] == "<|endoftext|>" and meta["selected"]["eos_id"] == 0
    assert meta["candidates"] == ["trained", str(tmp_path / "words.json")]
    csv_lines = (out / "fertility.csv").read_text().splitlines()
    assert csv_lines[0].startswith("tokenizer,source,text,words,tokens,fertility,continued_words")
    assert len(csv_lines) == 1 + 2 * 2
    assert "Selected: **" in (out / "fertility.md").read_text()
    assert (out / "fertility.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "decision.json").read_text())["tokenizer"]["path"].endswith("words.json")
    with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
        fertility(
            FertilitySpec(fertility=FertilityConfig(candidates=("./missing/tokenizer.json",))), corpora=[web], out=out
        )


def test_measured_on_curated_text_and_says_which(tmp_path):
    """Fertility reads what curation keeps (here the prose of a README, not its markup and
    code), falls back to curated train when the curated held-out split is empty, and says which
    text it used per source; an uncurated corpus is named as such."""
    import csv

    from curation.filters import prose_text
    from tasks.curate import CurationConfig, DecontaminationConfig, curate

    words = tmp_path / "words.json"
    word_level(words)
    readme = (
        f"Library\n=======\n\n{PARAGRAPHS[0]}\n\n    >>> ab(cd)\n    {{'abc': d}}\n\n"
        f"| ab | cd |\n|---|---|\n\n```\nabc = d\n```\n\n{PARAGRAPHS[1]}\n\n{PARAGRAPHS[2]}"
    )
    train = "\n\n".join(PARAGRAPHS[::-1])
    raw = corpus(tmp_path / "raw", [("t", train)], heldout=[("h", readme)], source="docs")
    out = tmp_path / "cur"
    out.mkdir()
    cfg = CurationConfig(
        presets={"docs": "docs"}, exact_dedup=False, minhash=False, decontamination=DecontaminationConfig(enabled=False)
    )
    meta = curate(cfg, raw, out=out, log=lambda _: None)
    assert meta["heldout_documents"] == 1
    curated = Artifact(kind="corpus", uri=str(out), fingerprint="c" * 64, meta=meta)
    emptied = corpus(tmp_path / "code", [("t", "abc d ab cd")], heldout=[], source="code")
    emptied = emptied.model_copy(update={"meta": {**emptied.meta, "heldout_curated": True}})
    other = corpus(tmp_path / "web", [("t", "ab")], heldout=[("h", "ab cd")], source="web")

    logs: list[str] = []
    fert = tmp_path / "fert"
    fert.mkdir()
    meta = fertility(
        FertilitySpec(fertility=FertilityConfig(candidates=(str(words),))),
        corpora=[curated, emptied, other],
        out=fert,
        log=logs.append,
    )
    assert meta["text"] == {"docs": "curated held-out", "code": "curated train sample", "web": "uncurated held-out"}
    rows = {r["source"]: r for r in csv.DictReader(open(fert / "fertility.csv"))}
    assert int(rows["docs"]["words"]) == len(prose_text(readme).split()) < len(readme.split())
    assert rows["docs"]["text"] == "curated held-out" and "| curated held-out |" in (fert / "fertility.md").read_text()
    assert any("source code is measured on its curated train sample" in line for line in logs)
    assert any("source web is measured on its uncurated held-out" in line for line in logs)
