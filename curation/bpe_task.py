"""The tokenizer step's training as a one-task datatrove stage, so it runs on the recipe's
executor (a Slurm array job of one task with the memory the recipe declares, a Ray task, or a
local process) instead of in the flow host's step process.

`TrainTokenizer` streams the sample (curation/bpe.py `sample_texts`: an equal character budget
per source, in shard order) into the BPE trainer, saves the Hugging Face folder into `out` and
writes the facts the step's meta needs (`out/train.json`). The trainer holds the sample's word
counts and pair index, not the sample: its memory grows with the distinct words of the sample
(benchmarks/data_scale.py's `tokenizer train`: 9.9 GB projected at the 3B recipe's 2e9 characters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from datatrove.pipeline.base import PipelineStep

from curation.bpe import sample_texts, save_hf_tokenizer, train_bpe

FACTS = "train.json"  # the task's facts, written last: the step reads them


class TrainTokenizer(PipelineStep):
    """One task: a byte-level BPE trained on the corpora's sample, saved into `out`."""

    name = "🔤 Train BPE"
    type = "🔢 - TOKENIZER"

    def __init__(self, corpora: tuple[Any, ...], sample_chars: int, vocab_size: int, min_frequency: int, out: Path):
        super().__init__()
        self.corpora, self.sample_chars = tuple(corpora), sample_chars
        self.vocab_size, self.min_frequency, self.out = vocab_size, min_frequency, Path(out)

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> None:
        sample = {"chars": 0, "documents": 0}

        def counted():
            for text in sample_texts(self.corpora, self.sample_chars):
                sample["chars"] += len(text)
                sample["documents"] += 1
                yield text

        tok = train_bpe(counted(), self.vocab_size, self.min_frequency)
        meta = save_hf_tokenizer(tok, self.out)
        self.stat_update("sample_chars", value=sample["chars"])
        facts = self.out / FACTS
        tmp = facts.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "sample": sample}), encoding="utf-8")
        tmp.replace(facts)  # after the folder: a killed task leaves no facts a rerun would take
