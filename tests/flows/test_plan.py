"""`smollm3 plan`: exact run/reuse predictions and the config fields that changed."""

from __future__ import annotations

import pytest

from flows.plan import diff, plan
from flows.smollm3 import smollm3
from tasks.recipe import load_recipe
from tests.conftest import DATA_ONLY


def test_diff_names_changed_fields():
    assert diff({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}, "d": 4}) == [
        "b.c: 2 -> 3", "d: (new) -> 4"
    ]


@pytest.mark.slow
def test_plan_predicts_exactly_what_a_run_does(tmp_path, prefect_harness):
    over = [*DATA_ONLY, f"workspace={tmp_path}"]
    before = plan(load_recipe("tiny", over))
    assert {r.action for r in before} == {"run"} and {r.reason for r in before} == {"never built"}
    smollm3(overrides=over)
    after = plan(load_recipe("tiny", over))
    assert [r.fingerprint for r in after] == [r.fingerprint for r in before]
    assert {r.action for r in after} == {"reuse"}
    changed = {f"{r.step}[{r.label}]": r for r in plan(load_recipe("tiny", [*over, "sources.math.max_documents=150"]))}
    assert changed["source[math]"].action == "run"
    assert "max_documents: 200 -> 150" in changed["source[math]"].reason
    assert changed["curate[math]"].reason.startswith("inputs changed")
    assert changed["source[prose]"].action == "reuse"


def test_the_published_recipe_resolves_without_compute():
    rows = plan(load_recipe("smollm3-3b", ["workspace=/nonexistent-smollm3-plan"]))
    steps = {r.step for r in rows}
    assert {"source", "curate", "tokenize", "mixture", "preflight", "pretrain", "export", "evaluate"} <= steps
    assert sum(r.step == "pretrain" for r in rows) == 5 and all(r.action == "run" for r in rows)
