"""The arithmetic_cloze eval task (evals/benchmarks/arithmetic_cloze.py)."""

from __future__ import annotations

import random

from evals.benchmarks.arithmetic_cloze import arithmetic_items
from tasks.evaluate import EvalConfig


def test_arithmetic_items_hold_the_right_answer(tmp_path):
    rng = random.Random(0)
    docs = [
        "Problem: What is 12 + 30?\nSolution: 12 + 30 = 42.\nAnswer: 42",
        "Problem: Ada buys 3 books at 5 dollars each. How many dollars does Ada spend?\n"
        "Solution: Each costs 5 dollars, so 3 cost 3 * 5 = 15 dollars.\nAnswer: 15",
    ]
    items = arithmetic_items(docs, EvalConfig(), rng)
    assert [it["choices"][it["gold"]] for it in items] == ["42", "15"]
    assert items[0]["context"].endswith("12 + 30 =") and "42" not in items[0]["context"]
    assert all(len(set(it["choices"])) == 4 for it in items)
