"""The eval suite: the registry of its tasks (`TASKS`, one line per task; each task is a module of
evals/benchmarks/), the builder the `eval_suite` step (tasks/evaluate.py) runs over it, the task
files the evaluation regenerates from it, and the contamination report.

Add a task: its module in evals/benchmarks/ (an `EvalTask`: its items, its lm-eval task file)
and one line in `TASKS` (CONTRIBUTING.md, "Add an eval task").
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.benchmarks.arithmetic_cloze import ArithmeticCloze
from evals.benchmarks.arithmetic_exact import (
    ArithmeticExact,
    ArithmeticExactThink,
    arithmetic_generation_items,  # noqa: F401  re-exported: NOT YET, see below
    generation_task_yaml,  # noqa: F401  re-exported: NOT YET, see below
)
from evals.benchmarks.code_cloze import CodeCloze
from evals.benchmarks.eval_task import (
    EvalTask,
    task_yaml,  # noqa: F401  re-exported: NOT YET, see below
)
from evals.benchmarks.passkey import Passkey
from evals.benchmarks.passkey_beyond import PasskeyBeyond
from evals.benchmarks.prose_cloze import ProseCloze

# NOT YET: three names re-exported above for tests of other steps, moved by others as this lands
# (tests/tasks/test_posttrain_steps.py, tests/tasks/test_evaluate_attacks.py); they live in
# evals/benchmarks/: import them from there, then drop the re-exports.


def registry(*tasks: EvalTask) -> tuple[EvalTask, ...]:
    """The tasks in order, refusing two of one name or one whose names another's already match."""
    seen: dict[str, EvalTask] = {}
    for task in tasks:
        if task.name in seen:
            raise ValueError(f"eval task {task.name!r} is registered twice ({seen[task.name]!r}, {task!r})")
        clash = next((t.name for t in seen.values() if re.fullmatch(t.names, task.name)), None)
        if clash:
            raise ValueError(f"eval task {task.name!r}: its name is one of {clash!r}'s task names")
        seen[task.name] = task
    return tuple(tasks)


# The suite's tasks, in the order they are built: the multiple-choice tasks draw items from one
# random stream, so a new one goes after them, leaving the items of the others unchanged.
TASKS = registry(
    ProseCloze(),
    CodeCloze(),
    ArithmeticCloze(),
    Passkey(),
    ArithmeticExact(),
    PasskeyBeyond(),
    ArithmeticExactThink(),
)

SUITE_TASK = re.compile("|".join(f"(?:{task.names})" for task in TASKS))  # every task name the suite may write


def task_of(name: str, tasks: Sequence[EvalTask] = TASKS) -> EvalTask | None:
    """The registered task that writes the task `name` (None: not one of the suite's)."""
    return next((t for t in tasks if re.fullmatch(t.names, name)), None)


def suite_task_yaml(name: str, data_file: Path, max_gen_tokens: int = 48) -> str:
    """The task YAML the `eval_suite` step writes for its task `name` over `data_file`: the one
    its registered task writes (evals/harness.py regenerates the suite's files with it)."""
    task = task_of(name)
    if task is None:
        raise ValueError(f"{name!r} is not a task the eval suite builds")
    return task.task_yaml(name, data_file, max_gen_tokens)


def build_suite(
    spec: Any,
    heldout: Mapping[str, Sequence[str]],
    training_texts: Iterable[str],
    out: Path,
    log: Callable[[str], None] = print,
    tasks: Sequence[EvalTask] = TASKS,
) -> dict[str, Any]:
    """Every task of `tasks` built from the `heldout` texts per domain: its JSONL and YAML in
    `out/tasks`, and `out/contamination.json` (the share of each checked task's items sharing a
    word n-gram with `training_texts`). `spec` is the step's `SuiteSpec`. Returns the step's meta."""
    cfg = spec.eval
    rng = random.Random(f"eval-suite:{spec.seed}")
    built: dict[str, tuple[EvalTask, list[dict[str, Any]]]] = {}
    for task in tasks:
        for name, items in task.build(heldout, spec, rng).items():
            if items:
                built[name] = (task, items)
    if not any(task.output_type == "multiple_choice" for task, _ in built.values()):
        raise ValueError("no eval items could be built: the held-out splits are empty")
    task_dir = out / "tasks"
    task_dir.mkdir(parents=True, exist_ok=True)
    for name, (task, items) in built.items():
        data = task_dir / f"{name}.jsonl"
        data.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
        (task_dir / f"{name}.yaml").write_text(task.task_yaml(name, data, task.gen_tokens(spec)))
    checked = {name: items for name, (task, items) in built.items() if task.contamination}
    report = contamination(checked, training_texts, cfg.contamination_ngram)
    (out / "contamination.json").write_text(json.dumps(report, indent=2))
    for name, r in report.items():
        log(
            f"eval suite: {name}: {r['items']} items, {r['contaminated']} share a "
            f"{cfg.contamination_ngram}-gram with training data ({r['rate']:.1%})"
        )
    return {
        "tasks": {name: len(items) for name, (_, items) in built.items()},
        "choices": cfg.choices,
        "random_accuracy": 1.0 / cfg.choices,
        "contamination": {k: round(v["rate"], 4) for k, v in report.items()},
        "task_dir": str(task_dir),
    }


def ngrams(text: str, n: int) -> Iterator[int]:
    words = re.findall(r"\w+", text.lower())
    for i in range(len(words) - n + 1):
        yield hash(" ".join(words[i : i + n]))


def contamination(
    tasks: dict[str, list[dict[str, Any]]], training_texts: Iterable[str], n: int
) -> dict[str, dict[str, float]]:
    """Share of each task's items sharing a word n-gram (context + gold) with training text."""
    item_grams: dict[tuple[str, int], set[int]] = {}
    wanted: set[int] = set()
    for name, items in tasks.items():
        for i, item in enumerate(items):
            text = item["context"] + item["delimiter"] + item["choices"][item["gold"]]
            grams = set(ngrams(text, n))
            item_grams[(name, i)] = grams
            wanted |= grams
    seen: set[int] = set()
    scanned = 0
    for text in training_texts:
        scanned += 1
        seen.update(g for g in ngrams(text, n) if g in wanted)
    report = {}
    for name, items in tasks.items():
        hit = sum(1 for i in range(len(items)) if item_grams[(name, i)] & seen)
        report[name] = {"items": len(items), "contaminated": hit, "rate": hit / len(items) if items else 0.0}
    return report
