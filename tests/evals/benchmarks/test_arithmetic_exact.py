"""The arithmetic_exact eval task (evals/benchmarks/arithmetic_exact.py) and its think-mode twin
(the answer read after the closed think block, the mean think length and the share of completions
closing it, on hand-made completions; built in post-training suites only, leaving the no-think
task's files unchanged); scored through lm-eval in tests/evals/test_harness.py."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from evals.benchmarks.arithmetic_exact import (
    ANSWER_PATTERN,
    THINK_ANSWER_PATTERN,
    ArithmeticExact,
    ArithmeticExactThink,
    strip_think,
    think_answer,
    think_stats,
)
from evals.suite import build_suite
from pipeline.artifact import identity
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


CLOSED = "<think>\nStep 1: 3 + 4 = 7.\nAnswer: 5\n</think>\nThe sum is 7.\nAnswer: 7"
UNCLOSED = "<think>\nStep 1: 3 + 4 = 7. Answer: 7 then more"
NO_ANSWER = "<think>\nhm\n</think>\nI do not know."


def words(text: str) -> int:
    return len(text.split())


def test_the_answer_is_read_after_the_closed_think_block_only():
    assert strip_think(CLOSED) == "\nThe sum is 7.\nAnswer: 7"
    assert think_answer(CLOSED) == "7"  # not the 5 inside the trace
    assert strip_think(UNCLOSED) is None and think_answer(UNCLOSED) is None  # no answer without </think>
    assert think_answer(NO_ANSWER) is None
    assert think_answer("<think>\n\n</think>\nAnswer: -12") == "-12"
    # lm-eval's regex filter takes the first match of the task file's pattern: the same answers
    assert re.findall(THINK_ANSWER_PATTERN, CLOSED) == ["7"]
    assert re.findall(ANSWER_PATTERN, CLOSED)[0] == "5"  # the no-think pattern would read the trace


def test_think_length_and_closed_share_over_hand_made_completions():
    stats = think_stats([CLOSED, UNCLOSED, NO_ANSWER, "<think>\n\n</think>\nAnswer: 3"], words)
    # 9 words inside the first block, 11 up to the end of the unclosed one, 1, and an empty block
    assert stats == {"think_tokens": (9 + 11 + 1 + 0) / 4, "think_closed": 3 / 4}
    assert think_stats(["Answer: 4"], words) == {"think_tokens": 2.0, "think_closed": 0.0}  # no <think>
    with pytest.raises(ValueError, match="no completions"):
        think_stats([], words)


def _heldout() -> dict[str, list[str]]:
    math = [f"Problem: What is {i} + {i}?\nSolution: {i} + {i} = {2 * i}.\nAnswer: {2 * i}" for i in range(4)]
    web = [" ".join(f"word{j}" for j in range(i, i + 60)) for i in range(8)]
    return {"web": web, "code": [], "math": math}


def test_the_think_task_is_built_only_for_post_training_suites_and_changes_no_other_file(tmp_path):
    cfg = EvalConfig(items_per_task=3, passkey_lengths=())
    plain = SuiteSpec(eval=cfg, generation_items=2, max_gen_tokens=20)
    think = plain.model_copy(update={"think_gen_tokens": 64})
    before = build_suite(plain, _heldout(), [], tmp_path / "a", log=lambda _: None)
    after = build_suite(think, _heldout(), [], tmp_path / "b", log=lambda _: None)
    assert "arithmetic_exact_think" not in before["tasks"] and after["tasks"]["arithmetic_exact_think"] == 2
    for path in (tmp_path / "a" / "tasks").iterdir():
        assert (tmp_path / "b" / "tasks" / path.name).read_text() == path.read_text().replace(
            str(tmp_path / "a"), str(tmp_path / "b")
        )
    yaml = (tmp_path / "b" / "tasks" / "arithmetic_exact_think.yaml").read_text()
    assert "  max_gen_toks: 64" in yaml and "Reasoning Mode: /think" in yaml
    assert f"regex_pattern: {json.dumps(THINK_ANSWER_PATTERN)}" in yaml
    # the same items as the no-think task
    same = [
        (tmp_path / "b" / "tasks" / f"{n}.jsonl").read_text() for n in ("arithmetic_exact", "arithmetic_exact_think")
    ]
    assert same[0] == same[1]
    # a suite without the think task (pretraining's) keeps its identity; the post-training one's changes
    assert "think_gen_tokens" not in identity(plain) and identity(think)["think_gen_tokens"] == 64
    assert ArithmeticExactThink().build(_heldout(), plain, random.Random(0)) == {}
