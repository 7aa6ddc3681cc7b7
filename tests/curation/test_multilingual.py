"""curation/multilingual.py: offline word tokenizers per script, py3langid's bundled model and a
local fastText model behind datatrove's language filter."""

from __future__ import annotations

import pickle

import pytest
from datatrove.data import Document

from curation.languages import LANGUAGES
from curation.multilingual import CharWordTokenizer, OfflineSpaCyTokenizer, language_id, word_tokenizer
from tasks.curate import CurationConfig


def test_each_script_gets_a_tokenizer_that_works_offline_and_pickles_by_code():
    assert word_tokenizer(LANGUAGES["fr"]) == "fr"  # datatrove's own table resolves it
    th = word_tokenizer(LANGUAGES["th"])  # a letter with its combining marks is one word
    assert isinstance(th, CharWordTokenizer) and th.word_tokenize("แมว กิน") == ["แ", "ม", "ว", "กิ", "น"]
    ja = word_tokenizer(LANGUAGES["ja"])  # runs of Latin letters and digits stay whole
    assert ja.word_tokenize("猫が寝る。ABC 12") == ["猫", "が", "寝", "る", "。", "ABC", "12"]
    assert ja.sent_tokenize("猫が寝る。犬も！\nabc") == ["猫が寝る。", "犬も！", "abc"]
    ko = word_tokenizer(LANGUAGES["ko"])
    assert isinstance(ko, OfflineSpaCyTokenizer) and ko.word_tokenize("고양이가 밥을 먹는다.")[:3] == [
        "고양이가",
        "밥을",
        "먹는다",
    ]
    hi = word_tokenizer(LANGUAGES["hi"])
    assert isinstance(hi, OfflineSpaCyTokenizer) and hi.word_tokenize("यह एक वाक्य है।") == ["यह", "एक", "वाक्य", "है", "।"]
    for tok in (th, ko, hi):  # datatrove's workers get them pickled: by language only
        again = pickle.loads(pickle.dumps(tok))
        assert type(again) is type(tok) and again.word_tokenize("abc def") == tok.word_tokenize("abc def")


def test_the_bundled_identifier_names_the_language_it_finds():
    lid = language_id("fr", 0.65)
    fr = "Le chat dort sur le canapé pendant que la pluie tombe doucement sur la ville endormie."
    en = "The cat sleeps on the sofa while the rain falls softly over the sleeping town."
    assert lid.filter(Document(text=fr, id="fr")) is True
    doc = Document(text=en, id="en")
    assert lid.filter(doc) == (False, "wrong_language") and doc.metadata["language"] == "en"


def test_language_filter_reads_a_local_fasttext_model(tmp_path):
    """`curation.language_model` replaces py3langid by a local fastText model (no download)."""
    import subprocess
    import sys

    from datatrove.data import Document

    from curation.multilingual import language_id

    en = ["the cat sat on the mat", "a river runs through the green valley", "we read books every day"]
    fr = ["le chat est sur le tapis", "une rivière traverse la vallée", "nous lisons des livres"]
    train = tmp_path / "lid.txt"
    train.write_text("".join(f"__label__en {a}\n__label__fr {b}\n" for a, b in zip(en, fr, strict=True)) * 30)
    # A tiny stand-in for lid.176.bin, trained offline. In a fresh process: inside the test
    # session fastText's training hits NaN (some library loaded earlier changes float state).
    script = (
        "import fasttext, sys; m = fasttext.train_supervised(sys.argv[1], epoch=50, lr=0.1, "
        "minn=2, maxn=4, dim=16, bucket=5000, thread=1, verbose=0); m.save_model(sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", script, str(train), str(tmp_path / "lid.bin")], check=True)
    lid = language_id("en", 0.65, str(tmp_path / "lid.bin"))
    assert lid.filter(Document(text="the cat and the river", id="en")) is True
    assert lid.filter(Document(text="le chat et la rivière", id="fr")) == (False, "wrong_language")
    from curation.presets import quality_filters

    with pytest.raises(FileNotFoundError, match="language_model 'missing.bin'"):
        quality_filters(CurationConfig(language_model="missing.bin"), "web")
