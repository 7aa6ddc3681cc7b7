"""The `arithmetic_exact` eval task (chat models, post-training suites): a held-out math problem,
answered by generation and scored by exact match on the final `Answer: N`.

The prompt our tokenizer's dual-mode template renders for a no-think question (a `/no_think`
system turn, as the built-in SFT data has, or `enable_thinking=False`: the same string, with the
empty think block the answer follows) is written into the prompt itself (not lm-eval's
--apply_chat_template), so the task file alone reproduces the score and a base model sees the
same string (tests/tasks/test_chat_template.py checks it against the template); generation stops
at the end of the assistant turn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
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


def generation_task_yaml(name: str, data_file: Path, max_gen_toks: int = 48) -> str:
    """An lm-eval `generate_until` task: greedy answer, exact match on the final integer."""
    return "\n".join(
        [
            *local_json_task(name, data_file),
            "output_type: generate_until",
            f"doc_to_text: {json.dumps(CHAT_PROMPT)}",
            'doc_to_target: "{{answer}}"',
            "generation_kwargs:",
            '  until: ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]',
            f"  max_gen_toks: {max_gen_toks}",
            "  do_sample: false",
            "filter_list:",
            "  - name: answer",
            "    filter:",
            "      - function: regex",
            f"        regex_pattern: {json.dumps(ANSWER_PATTERN)}",
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
