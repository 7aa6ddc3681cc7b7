"""curation/languages.py: the language table the presets judge by, against the real paragraphs of
tests/tasks/data/multilingual.json."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from curation.languages import LANGUAGES

DATA = json.loads((Path(__file__).parents[1] / "tasks" / "data" / "multilingual.json").read_text(encoding="utf-8"))[
    "documents"
]


def test_the_data_holds_every_language_of_the_table():
    """Every language with a preset (the 3B recipe's FineWeb-2 languages among them: Thai and
    Korean too) has at least two real multi-paragraph documents, and short one-paragraph good
    documents are there in scripts with and without sentence punctuation."""
    good = Counter(d["source_language"] for d in DATA if d["kind"] == "good")
    assert set(good) == set(LANGUAGES) and min(good.values()) >= 2
    short = {d["source_language"] for d in DATA if d["kind"] == "good_short"}
    assert {"en", "fr", "th"} <= short


def test_scripts_without_spaces_count_characters_and_drop_word_length_rules():
    """A `chars` language counts letters as words: Gopher's word-length rules cannot apply, and its
    repetition rules use character n-grams (longer n); spaced scripts keep Gopher's defaults."""
    for code, s in LANGUAGES.items():
        assert s.code == code and s.name and s.lid_threshold == 0.65
        chars = s.words == "chars"
        assert (s.min_avg_word_length is None) == chars and (s.max_avg_word_length is None) == chars
        assert (s.top_n_grams is not None) == chars and (s.dup_n_grams is not None) == chars
        if chars:
            assert min(n for n, _ in s.top_n_grams) > 2 and min(n for n, _ in s.dup_n_grams) > 5
        # a stop-word rule needs more distinct stop words in its list than it asks for
        assert not s.stop_words or len(set(s.stop_words)) > s.min_stop_words
    # Thai alone ends sentences without punctuation (a space); its stop-word rule is off
    assert [c for c, s in LANGUAGES.items() if not s.sentence_punctuation] == ["th"]
    assert LANGUAGES["th"].stop_words == ()
