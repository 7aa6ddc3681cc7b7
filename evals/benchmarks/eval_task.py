"""What every task of the eval suite is: an `EvalTask` builds its items from the held-out text and
writes its lm-eval task file; plus the pieces the multiple-choice tasks share (an item, the task
YAML) and the shape of a worked math solution the arithmetic tasks read.

A task module (evals/benchmarks/<task>.py) defines one subclass; evals/suite.py `TASKS` registers
an instance of it in one line, and the `eval_suite` step builds every registered task.
"""

from __future__ import annotations

import json
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal


class EvalTask(ABC):
    """One task of the eval suite (or a family of them: passkey retrieval writes one task per
    context length). The class attributes say how the suite and the evaluation treat it."""

    name: ClassVar[str]  # its name (a family: the stem of its names), unique in the registry
    names: ClassVar[str]  # regex every task name it writes matches (evals/suite.py SUITE_TASK)
    output_type: ClassVar[Literal["multiple_choice", "generate_until"]]  # lm-eval's output type
    headline: ClassVar[str]  # the metric it is reported by (evals/harness.py headline_metric)
    contamination: ClassVar[bool] = True  # its items are checked for n-gram overlap with training text
    long_context: ClassVar[bool] = False  # runs only after a context-extension stage
    # runs only where the last stage is read past its trained length (eval.beyond_factor), no elsewhere
    beyond_training: ClassVar[bool] = False
    think: ClassVar[bool] = False  # a think-mode generation task: its think length is measured too

    @abstractmethod
    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        """Items per task name, from the held-out texts per domain (`web`, `code`, `math`).
        `spec` is the eval_suite step's config (tasks/evaluate.py `SuiteSpec`: the recipe's eval
        section as `spec.eval`); `rng` is the suite's one random stream, shared by the tasks in
        registry order. A task with no items is left out of the suite."""

    def gen_tokens(self, spec: Any) -> int:
        """Its cap on generated tokens in the suite of config `spec` (the suite's `max_gen_tokens`)."""
        return spec.max_gen_tokens

    @abstractmethod
    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        """The lm-eval task file of its task `name` over the JSONL `data_file` (`max_gen_tokens`:
        the suite's cap on generated tokens, for generation tasks). Templates are plain
        `{{field}}` substitutions; no `!function`, no `include:` (evals/harness.py regenerates
        these files before lm-eval reads them)."""


def choice_item(
    context: str, gold: str, distractors: list[str], rng: random.Random, delimiter: str = " "
) -> dict[str, Any]:
    """A multiple-choice item: the gold answer shuffled among the distractors."""
    choices = [gold, *distractors]
    rng.shuffle(choices)
    return {"context": context, "choices": choices, "gold": choices.index(gold), "delimiter": delimiter}


def local_json_task(name: str, data_file: Path) -> list[str]:
    """The first lines of every suite task: its name and its local JSONL test split (offline)."""
    return [
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data_file))}",
        "test_split: test",
    ]


def task_yaml(name: str, data_file: Path, delimiter: str) -> str:
    """An lm-eval multiple-choice task over a local JSONL file (offline: `dataset_path: json`)."""
    return "\n".join(
        [
            *local_json_task(name, data_file),
            "output_type: multiple_choice",
            'doc_to_text: "{{context}}"',
            'doc_to_choice: "{{choices}}"',
            "doc_to_target: gold",
            f"target_delimiter: {json.dumps(delimiter)}",
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "  - metric: acc_norm",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


# A worked math solution (the builtin:math documents and the arithmetic held-out split).
WORKED_SOLUTION = re.compile(
    r"^Problem: (?P<problem>.*)\nSolution: (?P<solution>.*)\nAnswer: (?P<answer>-?\d+)\s*$", re.S
)
