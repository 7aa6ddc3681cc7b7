"""curation/bpe_task.py: the tokenizer's training as one datatrove task."""

from __future__ import annotations

import json

from curation.bpe import sample_texts, save_hf_tokenizer, train_bpe
from curation.bpe_task import FACTS, TrainTokenizer
from tests.tasks.datafiles import corpus


def test_the_task_trains_the_streamed_sample_and_writes_its_facts_last(tmp_path):
    docs = [(f"d{i}", f"word{i % 7} and more words {i} " * 5) for i in range(40)]
    src = corpus(tmp_path / "src", docs, source="prose")
    out = tmp_path / "out"
    TrainTokenizer((src,), 2_000, 300, 1, out).run()
    facts = json.loads((out / FACTS).read_text())
    assert facts["sample"]["chars"] == 2_000 and facts["meta"]["tokenizer_json"] == str(out / "tokenizer.json")
    direct = tmp_path / "direct"
    save_hf_tokenizer(train_bpe(sample_texts([src], 2_000), 300, 1), direct)
    assert (direct / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    assert not (out / "train.tmp").exists()
