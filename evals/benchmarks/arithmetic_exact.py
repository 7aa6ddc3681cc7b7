"""The `arithmetic_exact` eval task (chat models, post-training suites): a held-out math problem,
answered by generation and scored by exact match on the final `Answer: N`.

Each item carries its prompt (`prompt`): the question as the model was trained to be asked it, the
no-think system turn of the recipe's `reasoning_modes` and the user turn rendered by the
tokenizer's dual-mode chat template with the generation prompt (the empty think block the answer
follows). The eval_suite step renders it (`spec.chat_prompt`, tasks/evaluate.py `SuiteSpec`),
with the system turn the SFT rows and reasoning traces carry, so a training row of that mode for
that question starts with exactly this string (tests/tasks/test_chat_template.py). The task file
reads the prompt from the item (`doc_to_text: "{{prompt}}"`), not from lm-eval's
--apply_chat_template: the task files alone reproduce the score and a base model sees the same
string; generation stops at the end of the assistant turn.

Post-training suites also carry its think-mode twin, `arithmetic_exact_think` (`ArithmeticExactThink`,
built only where the suite's `think_gen_tokens` is set, so pretraining suites are unchanged): the
same questions under the think system turn, the assistant turn left open for the model's `<think>`
block; exact match reads the `Answer: N` after a closed `</think>` only, and the evaluation records
each model's mean think length and the share of answers that close the block (`think_stats`).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from evals.benchmarks.eval_task import WORKED_SOLUTION, EvalTask, local_json_task

GENERATION_TASK = "arithmetic_exact"
ANSWER_PATTERN = r"Answer:\s*(-?\d+)"  # the final answer the worked solutions end with
PROMPT_FIELD = "prompt"  # the item's field holding its rendered chat prompt
THINK_TASK = "arithmetic_exact_think"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The final answer after the closed think block (an `Answer:` inside the trace does not count).
THINK_ANSWER_PATTERN = r"</think>[\s\S]*?Answer:\s*(-?\d+)"


def strip_think(completion: str) -> str | None:
    """The answer part of a think-mode completion: the text after its `</think>` (None: the block
    never closes, so there is no answer)."""
    _, closed, after = completion.partition(THINK_CLOSE)
    return after if closed else None


def think_answer(completion: str) -> str | None:
    """The final `Answer: N` of a think-mode completion after its think block, as lm-eval's filter
    of the task reads it (None: no closed block, or no answer after it)."""
    m = re.search(THINK_ANSWER_PATTERN, completion)
    return m[1] if m else None


def think_stats(completions: Sequence[str], count_tokens: Callable[[str], int]) -> dict[str, float]:
    """Over think-mode completions: `think_tokens`, the mean number of tokens between `<think>`
    and `</think>` (an unclosed block counts up to the end of the completion; a completion without
    `<think>` counts from its start), and `think_closed`, the share that close the block."""
    if not completions:
        raise ValueError("think_stats: no completions to measure")
    lengths, closed = [], 0
    for text in completions:
        start = text.find(THINK_OPEN)
        body = text[start + len(THINK_OPEN) :] if start >= 0 else text
        inside, shut, _ = body.partition(THINK_CLOSE)
        closed += bool(shut)
        lengths.append(count_tokens(inside.strip()) if inside.strip() else 0)
    return {"think_tokens": sum(lengths) / len(lengths), "think_closed": closed / len(completions)}


def arithmetic_generation_items(
    docs: Sequence[str], n: int, prompt: Callable[[str], str] | None = None
) -> list[dict[str, Any]]:
    """Held-out math problems as {problem, answer}, and with `prompt` (a question -> the chat
    prompt it is asked with) its rendered `prompt`, for the exact-match generation task."""
    items = []
    for text in docs:
        m = WORKED_SOLUTION.match(text.strip())
        if m:
            problem = m["problem"].strip()
            item = {"problem": problem, "answer": m["answer"]}
            if prompt is not None:
                item[PROMPT_FIELD] = prompt(problem)
            items.append(item)
        if len(items) >= n:
            break
    return items


def constant_guess(answers: Sequence[str]) -> float:
    """The exact match of the best constant answer: the share of the items whose answer is the
    most common one (0 without items). A model that says one number whatever the question scores
    up to this, so exact match beats guessing only above it."""
    if not answers:
        return 0.0
    return Counter(str(a).strip() for a in answers).most_common(1)[0][1] / len(answers)


def generation_task_yaml(name: str, data_file: Path, max_gen_toks: int = 48, answer: str = ANSWER_PATTERN) -> str:
    """An lm-eval `generate_until` task over items carrying their prompt: greedy answer, exact
    match on the final integer (`answer`: the think-mode task's own pattern)."""
    return "\n".join(
        [
            *local_json_task(name, data_file),
            "output_type: generate_until",
            f'doc_to_text: "{{{{{PROMPT_FIELD}}}}}"',
            'doc_to_target: "{{answer}}"',
            "generation_kwargs:",
            '  until: ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]',
            f"  max_gen_toks: {max_gen_toks}",
            "  do_sample: false",
            "filter_list:",
            "  - name: answer",
            "    filter:",
            "      - function: regex",
            f"        regex_pattern: {json.dumps(answer)}",
            "      - function: take_first",
            "metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


class ArithmeticExact(EvalTask):
    name = names = GENERATION_TASK
    output_type = "generate_until"
    headline = "exact_match"
    contamination = False  # not multiple choice: the overlap report reads a gold choice

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        """Only in a suite asking for it (`spec.generation_items`: post-training's); draws nothing
        from `rng`."""
        if not spec.generation_items:
            return {}
        ask = partial(spec.chat_prompt, think=False)
        return {self.name: arithmetic_generation_items(heldout["math"], spec.generation_items, ask)}

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return generation_task_yaml(name, data_file, max_gen_tokens)


class ArithmeticExactThink(EvalTask):
    """`arithmetic_exact`'s items in think mode (post-training suites with `think_gen_tokens`)."""

    name = names = THINK_TASK
    output_type = "generate_until"
    headline = "exact_match"
    contamination = False
    think = True  # the evaluation records its think length and closed share

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        """Only in a suite with `spec.generation_items` and `spec.think_gen_tokens`; draws nothing
        from `rng`."""
        if not spec.generation_items or not getattr(spec, "think_gen_tokens", 0):
            return {}
        ask = partial(spec.chat_prompt, think=True)
        return {self.name: arithmetic_generation_items(heldout["math"], spec.generation_items, ask)}

    def gen_tokens(self, spec: Any) -> int:
        return spec.think_gen_tokens

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return generation_task_yaml(name, data_file, max_gen_tokens, THINK_ANSWER_PATTERN)
