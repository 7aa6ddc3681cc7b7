"""The `prose_cloze` eval task: continue a web passage; the distractors are other passages."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.benchmarks.eval_task import EvalTask, choice_item, task_yaml


def prose_items(docs: Sequence[str], cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """Context of `context_words`, gold = the next words, distractors = other docs' passages."""
    need = cfg.context_words + cfg.continuation_words
    passages = []
    for text in docs:
        words = text.split()
        for start in range(0, len(words) - need + 1, need * 4):
            passages.append(words[start : start + need])
    rng.shuffle(passages)
    items = []
    for i, words in enumerate(passages[: cfg.items_per_task]):
        others = [p for j, p in enumerate(passages) if j != i]
        if len(others) < cfg.choices - 1:
            break
        distractors = [" ".join(p[cfg.context_words :]) for p in rng.sample(others, cfg.choices - 1)]
        items.append(
            choice_item(" ".join(words[: cfg.context_words]), " ".join(words[cfg.context_words :]), distractors, rng)
        )
    return items


class ProseCloze(EvalTask):
    name = names = "prose_cloze"
    output_type = "multiple_choice"
    headline = "acc_norm"  # normalised by length: no favour to short continuations

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        return {self.name: prose_items(heldout["web"], spec.eval, rng)}

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return task_yaml(name, data_file, " ")
