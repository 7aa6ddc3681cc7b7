"""Filter presets and their thresholds (curation/presets.py) as the recipe overrides them."""

from __future__ import annotations

import pytest

from flows.recipe import RecipeError, load_recipe


def test_a_threshold_override_is_laid_over_its_presets_own_defaults():
    """A partial override keeps the preset's (and the language's) other defaults; a filter the
    preset does not run and an unknown threshold are refused, naming what is allowed."""
    cfg = load_recipe("tiny", ["curation.filters.web-zh.gopher_quality.min_doc_words=120"]).curation
    zh = cfg.filters["web-zh"]
    assert zh.gopher_quality.min_doc_words == 120
    assert zh.gopher_quality.min_avg_word_length is None  # Chinese: word-length rules stay off
    assert zh.fineweb_quality.short_line_length == 12 and zh.c4_quality.min_words_per_line == -1
    with pytest.raises(RecipeError, match=r"curation.filters.code.gopher_quality: preset 'code' runs no filter"):
        load_recipe("tiny", ["curation.filters.code.gopher_quality.min_doc_words=10"])
    with pytest.raises(RecipeError, match=r"curation.filters.math.length.min_char: .*allowed: min_chars"):
        load_recipe("tiny", ["curation.filters.math.length.min_char=10"])
    with pytest.raises(RecipeError, match=r"curation.filters.maths: unknown preset; allowed: code, docs, math"):
        load_recipe("tiny", ["curation.filters.maths.length.min_chars=10"])
