"""The arithmetic_exact eval task (evals/benchmarks/arithmetic_exact.py) and its think-mode twin
(the answer read after the closed think block, the mean think length and the share of completions
closing it, on hand-made completions; built in post-training suites only, leaving the no-think
task's files unchanged), each item carrying its chat prompt in its mode, and the constant-guess
baseline of exact match; scored through lm-eval in tests/evals/test_harness.py, the prompts against
the training rows in tests/tasks/test_chat_template.py."""

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
    constant_guess,
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
    spec = SuiteSpec(eval=EvalConfig(), generation_items=5)
    built = ArithmeticExact().build({"math": docs}, spec, rng)
    assert built == {
        "arithmetic_exact": [
            {"problem": "What is 2 + 3?", "answer": "5", "prompt": spec.chat_prompt("What is 2 + 3?", think=False)},
            {"problem": "What is 7 - 9?", "answer": "-2", "prompt": spec.chat_prompt("What is 7 - 9?", think=False)},
        ]
    }
    # the prompt: the no-think system turn and the question, the empty think block opened for the answer
    prompt = built["arithmetic_exact"][0]["prompt"]
    assert "Reasoning Mode: /no_think\n" in prompt and "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    assert rng.getstate() == state  # the multiple-choice tasks' items do not depend on it
    yaml = ArithmeticExact().task_yaml("arithmetic_exact", Path("/s/arithmetic_exact.jsonl"), 64)
    assert "output_type: generate_until" in yaml and "\n  max_gen_toks: 64\n" in yaml
    assert '\ndoc_to_text: "{{prompt}}"\n' in yaml  # the item's own prompt
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
    assert "  max_gen_toks: 64" in yaml and '\ndoc_to_text: "{{prompt}}"\n' in yaml
    assert f"regex_pattern: {json.dumps(THINK_ANSWER_PATTERN)}" in yaml
    # the same questions as the no-think task, each asked in think mode: the think system turn,
    # the assistant turn left open for the model's own <think>
    rows = {
        n: [json.loads(line) for line in (tmp_path / "b" / "tasks" / f"{n}.jsonl").read_text().splitlines()]
        for n in ("arithmetic_exact", "arithmetic_exact_think")
    }
    drop = lambda rs: [{k: v for k, v in r.items() if k != "prompt"} for r in rs]  # noqa: E731
    assert drop(rows["arithmetic_exact"]) == drop(rows["arithmetic_exact_think"])
    for r in rows["arithmetic_exact_think"]:
        assert r["prompt"] == think.chat_prompt(r["problem"], think=True)
        assert "Reasoning Mode: /think\n" in r["prompt"] and "Think step by step, then answer.\n" in r["prompt"]
        assert r["prompt"].endswith(f"<|im_start|>user\n{r['problem']}<|im_end|>\n<|im_start|>assistant\n")
    # a suite without the think task (pretraining's) keeps its identity; the post-training one's changes
    assert "think_gen_tokens" not in identity(plain) and identity(think)["think_gen_tokens"] == 64
    assert ArithmeticExactThink().build(_heldout(), plain, random.Random(0)) == {}


def test_the_prompts_carry_the_recipes_reasoning_modes_and_enter_the_suites_identity():
    from trainers.posttrain.sections import ReasoningModesConfig

    own = ReasoningModesConfig(think_system="Reason it out. /think", no_think_system="Be brief. /no_think")
    default = SuiteSpec(eval=EvalConfig(), generation_items=2, think_gen_tokens=8)
    spec = default.model_copy(update={"modes": own})
    assert "## Custom Instructions\n\nReason it out.\n\n<|im_end|>" in spec.chat_prompt("q", think=True)
    assert "## Custom Instructions\n\nBe brief.\n\n<|im_end|>" in spec.chat_prompt("q", think=False)
    assert "modes" not in identity(default) and identity(spec)["modes"] == own.model_dump()


def test_the_constant_guess_is_the_most_common_answers_share():
    assert constant_guess(["6", "6", "10", "3", "6 "]) == 3 / 5
    assert constant_guess(["1", "2"]) == 0.5 and constant_guess([]) == 0.0
