"""The code_cloze eval task (evals/benchmarks/code_cloze.py)."""

from __future__ import annotations

import random
from pathlib import Path

from evals.benchmarks.code_cloze import CodeCloze, code_items
from tasks.evaluate import EvalConfig


def test_code_items_continue_the_context_with_its_next_line():
    docs = ["\n".join(f"    total_{d} = total_{d} + item_{i}  # line {i}" for i in range(60)) for d in range(4)]
    cfg = EvalConfig(items_per_task=6, code_context_lines=5)
    items = code_items(docs, cfg, random.Random(0))
    assert len(items) == 6
    for it in items:
        gold = it["choices"][it["gold"]]
        assert it["delimiter"] == "" and it["context"].endswith("\n") and len(it["context"].splitlines()) == 5
        assert any(it["context"] + gold + "\n" in d for d in docs)  # the gold is the line after the context
        assert len(set(it["choices"])) == cfg.choices
    # the context ends with its newline: lm-eval puts nothing between it and a choice
    assert 'target_delimiter: ""' in CodeCloze().task_yaml("code_cloze", Path("/s/code_cloze.jsonl"), 48)
