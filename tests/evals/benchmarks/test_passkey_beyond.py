"""The passkey_beyond_<length> eval task (evals/benchmarks/passkey_beyond.py)."""

from __future__ import annotations

import random

from evals.benchmarks.passkey_beyond import PasskeyBeyond
from evals.harness import stage_tasks
from evals.suite import SUITE_TASK, task_of
from pipeline.artifact import Artifact
from tasks.evaluate import EvalConfig, SuiteSpec


def test_one_task_at_the_recipes_length_run_only_past_the_trained_length():
    spec = SuiteSpec(eval=EvalConfig(beyond_factor=2.0, beyond_passkey_words=300, passkey_items=3))
    tasks = PasskeyBeyond().build({}, spec, random.Random(0))
    assert list(tasks) == ["passkey_beyond_300"]
    for it in tasks["passkey_beyond_300"]:
        key = it["choices"][it["gold"]]
        filler_and_needle, question = it["context"].split("\n")
        assert filler_and_needle.count(key) == 2 and len(filler_and_needle.split()) == 300 + 12
        assert question == "What is the pass key? The pass key is"
    task = task_of("passkey_beyond_300")
    assert isinstance(task, PasskeyBeyond) and task.beyond_training and not task.contamination
    assert SUITE_TASK.fullmatch("passkey_beyond_0") is None
    # Unset: no items, so the suite leaves it out.
    assert PasskeyBeyond().build({}, SuiteSpec(eval=EvalConfig()), random.Random(0)) == {}
    # Which evaluations run it: only those past the trained length, and only it there.
    suite = Artifact(
        kind="eval",
        uri="/x",
        fingerprint="s" * 64,
        meta={"tasks": {"prose_cloze": 5, "passkey_30": 3, "passkey_beyond_300": 3}},
    )
    cfg = EvalConfig()
    assert stage_tasks(cfg, suite, long_context=True) == ["prose_cloze", "passkey_30"]
    assert stage_tasks(cfg, suite, long_context=True, cloze=False, beyond=True) == ["passkey_beyond_300"]
