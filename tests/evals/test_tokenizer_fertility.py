"""Tokenizer fertility: the playbook's measures on hand-checkable tokenizers, the choice rule, and
what a hub candidate that cannot be fetched says."""

from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from evals.tokenizer_fertility import decide, load_candidate, measure

TEXTS = ["ab cd", "abc d"]


def word_level(path=None) -> Tokenizer:
    """One token per whitespace word (fertility 1)."""
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "ab": 2, "cd": 3, "abc": 4, "d": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if path:
        tok.save(str(path))
    return tok


def char_level(path=None) -> Tokenizer:
    """One token per character, spaces included (fertility = characters per word)."""
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, " ": 2, "a": 3, "b": 4, "c": 5, "d": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if path:
        tok.save(str(path))
    return tok


def test_measures_match_hand_counts():
    words = measure(word_level(), TEXTS)
    assert words == {
        "words": 4,
        "tokens": 4,
        "fertility": 1.0,
        "continued_words": 0.0,
        "bytes_per_token": 10 / 4,
        "vocab_used": 4 / 6,
    }
    chars = measure(char_level(), TEXTS)
    # "ab cd": a b ' ' c d; "abc d": a b c ' ' d -> 10 tokens over 4 words; 3 of 4 words split
    assert chars["tokens"] == 10 and chars["fertility"] == 2.5
    assert chars["continued_words"] == 0.75 and chars["bytes_per_token"] == 1.0
    assert chars["vocab_used"] == 5 / 7


def _rows(fert: dict[tuple[str, str], float]):
    return [{"tokenizer": t, "source": s, "fertility": f} for (t, s), f in fert.items()]


def test_rule_weighs_sources_by_mixture_weight_and_choose_fixes_the_tokenizer():
    rows = _rows({("A", "web"): 1.2, ("A", "code"): 3.0, ("B", "web"): 1.5, ("B", "code"): 2.0})
    assert decide(rows, None, {"web": 0.9, "code": 0.1})["selected"] == "A"
    picked = decide(rows, None, {"web": 0.1, "code": 0.9})
    assert picked["selected"] == "B" and "weighted by mixture weight" in picked["reason"]
    fixed = decide(rows, "A", {"web": 0.1, "code": 0.9})
    assert fixed["selected"] == "A" and "fixed by the recipe" in fixed["reason"]
    with pytest.raises(ValueError, match="fertility.choose 'C' is not a candidate"):
        decide(rows, "C", {})


def test_hub_candidate_that_cannot_be_fetched_says_what_to_do(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no connection")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(RuntimeError, match="'Qwen/Qwen3-4B': cannot load it from the Hugging Face hub"):
        load_candidate("Qwen/Qwen3-4B")
