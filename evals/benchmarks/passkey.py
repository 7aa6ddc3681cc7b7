"""The `passkey_<length>` eval tasks: a pass key hidden in `length` words of filler, one task per
context length of the recipe (`eval.passkey_lengths`); run after context extension."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.benchmarks.eval_task import EvalTask, choice_item, task_yaml

_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ").split()


def passkey_items(length_words: int, cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """A pass key hidden at a random depth in `length_words` words of filler."""
    items = []
    for _ in range(cfg.passkey_items):
        key = rng.randint(10000, 99999)
        filler = [_FILLER[i % len(_FILLER)] for i in range(length_words)]
        depth = rng.randint(0, length_words)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key.".split()
        words = filler[:depth] + needle + filler[depth:]
        context = " ".join(words) + "\nWhat is the pass key? The pass key is"
        wrong = [str(k) for k in rng.sample(range(10000, 100000), cfg.choices - 1) if k != key]
        items.append(choice_item(context, str(key), wrong[: cfg.choices - 1], rng))
    return items


class Passkey(EvalTask):
    name = "passkey"
    names = r"passkey_[1-9][0-9]{0,6}"
    output_type = "multiple_choice"
    headline = "acc"
    contamination = False  # synthetic filler: nothing to find in training text
    long_context = True

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        return {f"passkey_{length}": passkey_items(length, spec.eval, rng) for length in spec.eval.passkey_lengths}

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return task_yaml(name, data_file, " ")
