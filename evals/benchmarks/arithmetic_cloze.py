"""The `arithmetic_cloze` eval task: a worked solution up to its final result; the choices are the
right number and near misses."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.benchmarks.eval_task import WORKED_SOLUTION, EvalTask, choice_item, task_yaml


def _wrong_numbers(answer: int, k: int, rng: random.Random) -> list[str]:
    candidates = {answer + d for d in (-10, -2, -1, 1, 2, 10, 100)} | {int(str(abs(answer))[::-1] or 0)}
    candidates.discard(answer)
    picked = rng.sample(sorted(candidates), min(k, len(candidates)))
    return [str(n) for n in picked]


def arithmetic_items(docs: Sequence[str], cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """The worked solution up to its final result; choices = the right number and near misses."""
    items = []
    for text in docs:
        m = WORKED_SOLUTION.match(text.strip())
        if not m:
            continue
        answer, solution = m["answer"], m["solution"]
        cut = solution.rfind(answer)
        if cut <= 0:
            continue
        context = f"Problem: {m['problem']}\nSolution: {solution[:cut].rstrip()}"
        items.append(choice_item(context, answer, _wrong_numbers(int(answer), cfg.choices - 1, rng), rng))
        if len(items) >= cfg.items_per_task:
            break
    return items


class ArithmeticCloze(EvalTask):
    name = names = "arithmetic_cloze"
    output_type = "multiple_choice"
    headline = "acc"  # numbers: length normalisation would favour long numbers

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        return {self.name: arithmetic_items(heldout["math"], spec.eval, rng)}

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return task_yaml(name, data_file, " ")
