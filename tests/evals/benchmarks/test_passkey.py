"""The passkey_<length> eval tasks (evals/benchmarks/passkey.py)."""

from __future__ import annotations

import random

from evals.benchmarks.passkey import Passkey
from evals.suite import SUITE_TASK, task_of
from tasks.evaluate import EvalConfig, SuiteSpec


def test_one_task_per_context_length_each_key_hidden_in_its_filler():
    spec = SuiteSpec(eval=EvalConfig(passkey_lengths=(30, 200), passkey_items=3))
    tasks = Passkey().build({}, spec, random.Random(0))
    assert list(tasks) == ["passkey_30", "passkey_200"]
    for name, items in tasks.items():
        length = int(name.removeprefix("passkey_"))
        assert len(items) == 3 and isinstance(task_of(name), Passkey) and task_of(name).long_context
        for it in items:
            key = it["choices"][it["gold"]]
            filler_and_needle, question = it["context"].split("\n")
            assert filler_and_needle.count(key) == 2 and len(filler_and_needle.split()) == length + 12
            assert question == "What is the pass key? The pass key is"
    assert SUITE_TASK.fullmatch("passkey_0") is None and SUITE_TASK.fullmatch("passkey_") is None
