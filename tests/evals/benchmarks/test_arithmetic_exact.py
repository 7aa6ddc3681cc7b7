"""The arithmetic_exact eval task (evals/benchmarks/arithmetic_exact.py); scored through lm-eval
in tests/evals/test_harness.py."""

from __future__ import annotations

import random
import re
from pathlib import Path

from evals.benchmarks.arithmetic_exact import ANSWER_PATTERN, ArithmeticExact
from tasks.evaluate import EvalConfig, SuiteSpec


def test_generation_items_only_in_a_suite_asking_for_them_and_no_random_draw():
    docs = [
        "Problem: What is 2 + 3?\nSolution: 2 + 3 = 5.\nAnswer: 5",
        "not a worked problem",
        "Problem: What is 7 - 9?\nSolution: 7 - 9 = -2.\nAnswer: -2",
    ]
    rng = random.Random(0)
    state = rng.getstate()
    assert ArithmeticExact().build({"math": docs}, SuiteSpec(eval=EvalConfig()), rng) == {}
    built = ArithmeticExact().build({"math": docs}, SuiteSpec(eval=EvalConfig(), generation_items=5), rng)
    assert built == {
        "arithmetic_exact": [
            {"problem": "What is 2 + 3?", "answer": "5"},
            {"problem": "What is 7 - 9?", "answer": "-2"},
        ]
    }
    assert rng.getstate() == state  # the multiple-choice tasks' items do not depend on it
    yaml = ArithmeticExact().task_yaml("arithmetic_exact", Path("/s/arithmetic_exact.jsonl"), 64)
    assert "output_type: generate_until" in yaml and "\n  max_gen_toks: 64\n" in yaml
    assert re.search(ANSWER_PATTERN, "so the total is 7.\nAnswer: -2")[1] == "-2"
