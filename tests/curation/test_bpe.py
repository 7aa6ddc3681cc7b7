"""curation/bpe.py: sampling the curated corpora for the tokenizer, training and saving a byte-level
BPE with our special tokens, the `.ds` token type, and which tokenizer an upstream step chose. The
chat template's renderings are tests/tasks/test_chat_template.py's."""

from __future__ import annotations

import gzip
import json

import pytest

from curation.bpe import (
    EOS,
    SPECIAL_TOKENS,
    THINK_TOKENS,
    load_tokenizer_file,
    sample_texts,
    save_hf_tokenizer,
    selected_tokenizer,
    token_dtype,
    tokenizer_folder,
    train_bpe,
)
from pipeline.artifact import Artifact

TEXTS = [f"the cat {i} sat on the mat and the dog ran after it, {i * 7} times" for i in range(200)]


def _corpus(folder, texts):
    (folder / "train").mkdir(parents=True)
    with gzip.open(folder / "train" / "00000.jsonl.gz", "wt", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}) + "\n")
    return Artifact(kind="corpus", uri=str(folder), fingerprint="c" * 64, meta={})


def test_samples_share_the_character_budget_equally_between_corpora(tmp_path):
    a = _corpus(tmp_path / "a", ["x" * 30] * 10)
    b = _corpus(tmp_path / "b", ["y" * 30] * 10)
    texts = list(sample_texts([a, b], budget=100))
    assert sum(len(t) for t in texts if t.startswith("x")) == 50 == sum(len(t) for t in texts if t.startswith("y"))
    assert texts[1] == "x" * 20  # the last text is cut at the share


def test_a_trained_tokenizer_has_the_special_tokens_first_and_saves_as_a_hf_folder(tmp_path):
    from transformers import AutoTokenizer

    tok = train_bpe(iter(TEXTS), vocab_size=300)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))  # EOS is id 0
    facts = save_hf_tokenizer(tok, tmp_path / "hf")
    assert facts["eos_id"] == 0 and facts["eos_token"] == EOS and facts["special_tokens"]["<|pad|>"] == 3
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf.eos_token == EOS and hf.pad_token == "<|pad|>" and hf.chat_template
    ids = hf.encode("<think>the cat</think>")
    assert ids[0] == hf.convert_tokens_to_ids(THINK_TOKENS[0]) and hf.convert_tokens_to_ids(THINK_TOKENS[1]) in ids
    assert hf.decode(ids, skip_special_tokens=True) == "<think>the cat</think>"  # a reply keeps its trace
    assert load_tokenizer_file(tmp_path / "hf").get_vocab_size() == facts["vocab_size"]
    with pytest.raises(FileNotFoundError, match="no tokenizer.json there"):
        load_tokenizer_file(tmp_path / "missing")


def test_token_dtype_follows_datatrove_and_the_chosen_tokenizer_is_read_from_either_step(tmp_path):
    assert token_dtype(65_536) == "uint16" and token_dtype(65_537) == "uint32"
    meta = {
        "tokenizer_json": str(tmp_path / "tok" / "tokenizer.json"),
        "vocab_size": 300,
        "eos_token": EOS,
        "eos_id": 0,
    }
    trained = Artifact(kind="tokenizer", uri=str(tmp_path / "tok"), fingerprint="t" * 64, meta=meta)
    assert selected_tokenizer(trained)["name"] == "trained"
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert tokenizer_folder(trained) == (tmp_path / "tok", 0)  # the folder holding the file
    chosen = {"name": "hub-x", "path": str(tmp_path / "x"), "vocab_size": 9, "eos_token": "</s>", "eos_id": 2}
    decision = Artifact(kind="fertility", uri=str(tmp_path / "f"), fingerprint="f" * 64, meta={"selected": chosen})
    assert selected_tokenizer(decision) == chosen and tokenizer_folder(decision) == (tmp_path / "x", 2)  # a folder
    with pytest.raises(ValueError, match="not a corpus artifact"):
        selected_tokenizer(_corpus(tmp_path / "c", ["z"]))
