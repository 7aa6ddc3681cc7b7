"""The eval suite (evals/suite.py): its registry drives what the suite builds and what the
evaluation regenerates, and the contamination report."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import evals.benchmarks
from curation.source_kinds import math_problem
from evals.benchmarks.eval_task import EvalTask, choice_item, task_yaml
from evals.benchmarks.passkey import Passkey
from evals.benchmarks.prose_cloze import ProseCloze
from evals.suite import TASKS, build_suite, contamination, registry, suite_task_yaml, task_of
from tasks.evaluate import EvalConfig, SuiteSpec


def _heldout(seed: int = 0) -> dict[str, list[str]]:
    """Held-out texts per domain, enough for a few items of every task."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(500)]
    web = [" ".join(rng.choice(vocab) for _ in range(400)) for _ in range(8)]
    code = [
        "\n".join(f"    value_{d}_{i} = compute(value_{d}_{i - 1}, {i})  # step {i}" for i in range(1, 80))
        for d in range(4)
    ]
    math = ["Problem: {}\nSolution: {}\nAnswer: {}".format(*math_problem(rng)) for _ in range(40)]
    return {"web": web, "code": code, "math": math}


_SPEC = SuiteSpec(
    eval=EvalConfig(items_per_task=5, passkey_lengths=(40, 90), passkey_items=2, beyond_passkey_words=150),
    generation_items=3,
    max_gen_tokens=20,
    think_gen_tokens=64,
)


class ReversedCloze(EvalTask):
    """A task defined here and registered nowhere: a web passage's words reversed, continue it."""

    name = names = "reversed_cloze"
    output_type = "multiple_choice"
    headline = "acc_norm"

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        words = [w for text in heldout["web"] for w in reversed(text.split())]
        items = [choice_item(" ".join(words[i : i + 10]), words[i + 10], ["zz", "yy"], rng) for i in range(0, 60, 20)]
        return {self.name: items}

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return task_yaml(name, data_file, " ")


def test_every_registered_task_is_in_the_suite_with_the_task_file_the_evaluation_regenerates(tmp_path):
    meta = build_suite(_SPEC, _heldout(), [], tmp_path, log=lambda _: None)
    built = list(meta["tasks"])
    assert built == [
        "prose_cloze",
        "code_cloze",
        "arithmetic_cloze",
        "passkey_40",
        "passkey_90",
        "arithmetic_exact",
        "passkey_beyond_150",
        "arithmetic_exact_think",
    ]
    assert {task_of(name).name for name in built} == {task.name for task in TASKS}
    for name in built:
        data = tmp_path / "tasks" / f"{name}.jsonl"
        assert len(data.read_text(encoding="utf-8").splitlines()) == meta["tasks"][name]
        gen = _SPEC.think_gen_tokens if name == "arithmetic_exact_think" else _SPEC.max_gen_tokens
        assert (tmp_path / "tasks" / f"{name}.yaml").read_text() == suite_task_yaml(name, data, gen)
    # the contamination report covers the tasks that ask for it, in registry order
    assert list(meta["contamination"]) == ["prose_cloze", "code_cloze", "arithmetic_cloze"]


def test_a_task_is_in_the_suite_once_registered_and_leaves_the_others_unchanged(tmp_path):
    build_suite(_SPEC, _heldout(), [], tmp_path / "registered", log=lambda _: None)
    meta = build_suite(_SPEC, _heldout(), [], tmp_path / "more", log=lambda _: None, tasks=(*TASKS, ReversedCloze()))
    assert list(meta["tasks"])[-1] == "reversed_cloze" and meta["tasks"]["reversed_cloze"] == 3
    assert (tmp_path / "more" / "tasks" / "reversed_cloze.yaml").is_file()
    assert "reversed_cloze" in meta["contamination"]
    for path in (tmp_path / "registered" / "tasks").iterdir():  # a task added last moves no other item
        other = (tmp_path / "more" / "tasks" / path.name).read_text()
        assert other == path.read_text().replace(str(tmp_path / "registered"), str(tmp_path / "more"))
    # the module's class alone, unregistered, is not in the suite, and the evaluation refuses it
    assert not (tmp_path / "registered" / "tasks" / "reversed_cloze.yaml").exists()
    assert task_of("reversed_cloze") is None
    with pytest.raises(ValueError, match="'reversed_cloze' is not a task the eval suite builds"):
        suite_task_yaml("reversed_cloze", tmp_path / "x.jsonl")


def test_every_task_module_is_registered_once():
    """Each `EvalTask` defined in evals/benchmarks/ is in `TASKS` exactly once (the one line)."""
    defined = set()
    for info in pkgutil.iter_modules(evals.benchmarks.__path__):
        module = importlib.import_module(f"evals.benchmarks.{info.name}")
        defined |= {
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, EvalTask) and cls is not EvalTask and cls.__module__ == module.__name__
        }
    assert sorted(c.__name__ for c in defined) == sorted(type(t).__name__ for t in TASKS)
    assert len({type(t) for t in TASKS}) == len(TASKS)


def test_the_registry_refuses_a_name_twice_or_inside_another_tasks_names():
    with pytest.raises(ValueError, match="eval task 'prose_cloze' is registered twice"):
        registry(ProseCloze(), ProseCloze())

    class Passkey7(ReversedCloze):
        name = names = "passkey_7"

    with pytest.raises(ValueError, match="eval task 'passkey_7': its name is one of 'passkey''s task names"):
        registry(Passkey(), Passkey7())


def test_no_multiple_choice_item_is_an_error_naming_the_heldout_splits(tmp_path):
    spec = SuiteSpec(eval=EvalConfig(passkey_lengths=()), generation_items=3)
    with pytest.raises(ValueError, match="no eval items could be built: the held-out splits are empty"):
        build_suite(spec, {"web": [], "code": [], "math": []}, [], tmp_path, log=lambda _: None)


def test_contamination_finds_planted_overlap():
    items = {
        "t": [
            {
                "context": "the quick brown fox jumps over the lazy",
                "choices": ["dog today", "cat"],
                "gold": 0,
                "delimiter": " ",
            },
            {
                "context": "entirely fresh words never seen in training",
                "choices": ["ok", "no"],
                "gold": 0,
                "delimiter": " ",
            },
        ]
    }
    report = contamination(items, ["yesterday the quick brown fox jumps over the lazy dog today again"], n=8)
    assert report["t"] == {"items": 2, "contaminated": 1, "rate": 0.5}
