"""The `code_cloze` eval task: the next line of a code file; the distractors are lines from
elsewhere of similar length."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.benchmarks.eval_task import EvalTask, choice_item, task_yaml


def code_items(docs: Sequence[str], cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """Context = `code_context_lines` lines, gold = the next non-empty line, distractors = lines
    from elsewhere of similar length."""
    windows: list[tuple[str, str]] = []
    pool: list[str] = []
    for text in docs:
        lines = text.splitlines()
        pool += [ln for ln in lines if len(ln.strip()) > 10]
        for start in range(0, len(lines) - cfg.code_context_lines - 1, cfg.code_context_lines * 5):
            target = lines[start + cfg.code_context_lines]
            if len(target.strip()) > 10:
                windows.append(("\n".join(lines[start : start + cfg.code_context_lines]) + "\n", target))
    rng.shuffle(windows)
    items = []
    for context, gold in windows[: cfg.items_per_task]:
        candidates = [ln for ln in rng.sample(pool, min(len(pool), 50)) if ln != gold]
        candidates.sort(key=lambda ln: abs(len(ln) - len(gold)))
        if len(candidates) < cfg.choices - 1:
            continue
        items.append(choice_item(context, gold, candidates[: cfg.choices - 1], rng, delimiter=""))
    return items


class CodeCloze(EvalTask):
    name = names = "code_cloze"
    output_type = "multiple_choice"
    headline = "acc_norm"

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        return {self.name: code_items(heldout["code"], spec.eval, rng)}

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return task_yaml(name, data_file, "")  # the context ends with its newline: no space before the line
