"""The `arithmetic_exact` eval task (chat models, post-training suites): a held-out math problem,
answered by generation and scored by exact match on the final `Answer: N`.

The prompt our tokenizer's dual-mode template renders for a no-think question (a `/no_think`
system turn, as the built-in SFT data has, or `enable_thinking=False`: the same string, with the
empty think block the answer follows) is written into the prompt itself (not lm-eval's
--apply_chat_template), so the task file alone reproduces the score and a base model sees the
same string (tests/tasks/test_chat_template.py checks it against the template); generation stops
at the end of the assistant turn.

Post-training suites also carry its think-mode twin, `arithmetic_exact_think` (`ArithmeticExactThink`,
built only where the suite's `think_gen_tokens` is set, so pretraining suites are unchanged): the
same items under the `/think` system turn (`enable_thinking=True`), the assistant turn left open
for the model's `<think>` block; exact match reads the `Answer: N` after a closed `</think>` only,
and the evaluation records each model's mean think length and the share of answers that close the
block (`think_stats`).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from evals.benchmarks.eval_task import WORKED_SOLUTION, EvalTask, local_json_task

CHAT_PROMPT = (
    "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: /no_think\n\n"
    "## Custom Instructions\n\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face.\n\n"
    "<|im_end|>\n<|im_start|>user\n{{problem}}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n"
)
GENERATION_TASK = "arithmetic_exact"
ANSWER_PATTERN = r"Answer:\s*(-?\d+)"  # the final answer the worked solutions end with

# Think mode: what the template renders for `/think` (or enable_thinking=True) with a generation
# prompt: the system turn says /think and the assistant turn opens bare, for the model's <think>.
# Its default custom instructions are SmolLM3's think-mode persona (curation/bpe.py THINK_PERSONA).
THINK_PERSONA = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant "
    "involves thoroughly exploring questions through a systematic thinking process before providing "
    "the final precise and accurate solutions. This requires engaging in a comprehensive cycle of "
    "analysis, summarizing, exploration, reassessment, reflection, backtracking, and iteration to "
    "develop well-considered thinking process. Please structure your response into two main sections: "
    "Thought and Solution using the specified format: <think> Thought section </think> Solution "
    "section. In the Thought section, detail your reasoning process in steps. Each step should include "
    "detailed considerations such as analysing questions, summarizing relevant findings, brainstorming "
    "new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting "
    "previous steps. In the Solution section, based on various attempts, explorations, and reflections "
    "from the Thought section, systematically present the final solution that you deem correct. The "
    "Solution section should be logical, accurate, and concise and detail necessary steps needed to "
    "reach the conclusion."
)
THINK_PROMPT = (
    CHAT_PROMPT.replace("Reasoning Mode: /no_think", "Reasoning Mode: /think")
    .replace(
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face.\n",
        THINK_PERSONA + "\n",
    )
    .removesuffix("<think>\n\n</think>\n")
)
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


def arithmetic_generation_items(docs: Sequence[str], n: int) -> list[dict[str, Any]]:
    """Held-out math problems as {problem, answer} for the exact-match generation task."""
    items = []
    for text in docs:
        m = WORKED_SOLUTION.match(text.strip())
        if m:
            items.append({"problem": m["problem"].strip(), "answer": m["answer"]})
        if len(items) >= n:
            break
    return items


def generation_task_yaml(
    name: str, data_file: Path, max_gen_toks: int = 48, prompt: str = CHAT_PROMPT, answer: str = ANSWER_PATTERN
) -> str:
    """An lm-eval `generate_until` task: greedy answer, exact match on the final integer
    (`prompt` and `answer`: the think-mode task's own)."""
    return "\n".join(
        [
            *local_json_task(name, data_file),
            "output_type: generate_until",
            f"doc_to_text: {json.dumps(prompt)}",
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
        return {self.name: arithmetic_generation_items(heldout["math"], spec.generation_items)}

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
        return {self.name: arithmetic_generation_items(heldout["math"], spec.generation_items)}

    def gen_tokens(self, spec: Any) -> int:
        return spec.think_gen_tokens

    def task_yaml(self, name: str, data_file: Path, max_gen_tokens: int) -> str:
        return generation_task_yaml(name, data_file, max_gen_tokens, THINK_PROMPT, THINK_ANSWER_PATTERN)
