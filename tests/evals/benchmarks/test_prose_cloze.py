"""The prose_cloze eval task (evals/benchmarks/prose_cloze.py), with passkey items drawn from the
same random stream after it, as the suite draws them."""

from __future__ import annotations

import random

from evals.benchmarks.passkey import passkey_items
from evals.benchmarks.prose_cloze import prose_items
from tasks.evaluate import EvalConfig


def test_prose_and_passkey_items(tmp_path):
    rng = random.Random(1)
    docs = [" ".join(f"w{d}_{i}" for i in range(400)) for d in range(5)]
    cfg = EvalConfig(items_per_task=10)
    items = prose_items(docs, cfg, rng)
    assert len(items) == 10
    for it in items:
        gold = it["choices"][it["gold"]]
        doc = next(d for d in docs if it["context"] in d)
        assert it["context"] + " " + gold in doc  # the gold continues the context
    keys = passkey_items(50, cfg, rng)
    for it in keys:
        assert f"The pass key is {it['choices'][it['gold']]}." in it["context"]
