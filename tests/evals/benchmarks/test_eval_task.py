"""What every eval task shares (evals/benchmarks/eval_task.py): the interface, the multiple-choice
item, the worked-solution shape."""

from __future__ import annotations

import random

import pytest

from evals.benchmarks.eval_task import WORKED_SOLUTION, EvalTask, choice_item


def test_a_choice_item_keeps_the_gold_among_the_shuffled_choices():
    items = [choice_item("2 + 2 =", "4", ["3", "5", "22"], random.Random(seed), delimiter=" ") for seed in range(20)]
    assert all(it["choices"][it["gold"]] == "4" and sorted(it["choices"]) == ["22", "3", "4", "5"] for it in items)
    assert len({it["gold"] for it in items}) > 1  # shuffled: the gold is not always first
    assert {it["delimiter"] for it in items} == {" "} and {it["context"] for it in items} == {"2 + 2 ="}


def test_a_worked_solution_reads_as_problem_solution_answer():
    m = WORKED_SOLUTION.match("Problem: What is 1 + 1?\nSolution: 1 + 1 = 2.\nAnswer: 2\n")
    assert (m["problem"], m["solution"], m["answer"]) == ("What is 1 + 1?", "1 + 1 = 2.", "2")
    assert WORKED_SOLUTION.match("Problem: x\nAnswer: 2") is None


def test_a_task_without_its_build_and_task_file_is_refused():
    class Half(EvalTask):
        name = names = "half"
        output_type = "multiple_choice"
        headline = "acc"

        def build(self, heldout, spec, rng):
            return {}

    with pytest.raises(TypeError, match="task_yaml"):
        Half()
