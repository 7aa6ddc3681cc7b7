"""A planted eval-suite payload stays inert through a normal `smollm3 run tiny eval.limit=2` (issue 35).

The run goes through the CLI, as a person types it (one short stage, a 2-layer model, so the
whole DAG fits a test), in a copy of the session's finished data steps (tests/conftest.py
`workspace_copy`). Between two runs another process plants payloads into the finished
`eval_suite` folder of the workspace: a Jinja task YAML with its data and a `utils.py` beside the
suite, then one of the suite's own task YAMLs swapped for the payload. Each is shown live on that
folder (lm-eval's `TaskManager` renders it and the canary file appears), then
`smollm3 run tiny ... --refresh evaluate` scores the model again: the planted files are ignored
and the scores are those of our tasks; the swapped YAML fails the evaluate step naming the file.
The canary never appears. The same payloads through the S3 mirror: tests/tasks/test_evaluate_inert.py.
"""

from __future__ import annotations

import json

import pytest

from pipeline.lineage import Lineage
from tests.conftest import TINY_TRAIN
from tests.tasks.test_evaluate_attacks import ROW, _jinja_yaml, _load

OVERRIDES = [
    *(o for o in TINY_TRAIN if o.startswith("sources.")),  # every source keeps a held-out split
    "stages=[{name: stage1, mixture: mixtures/tiny/stage1.yaml, tokens: 8192, seq_len: 256}]",
    "training.global_batch=8",
    "training.warmup_steps=1",
    "training.decay_stages=1",
    "training.model_overrides={hidden_size: 64, intermediate_size: 192, num_layers: 2, num_heads: 2, num_kv_heads: 1}",
    "eval.items_per_task=20",
    "eval.passkey_items=5",
    "eval.limit=2",
    "preflight.max_epochs=1000",
    "posttrain=null",
    "eval.beyond_factor=null",  # one evaluation: stage 1's (no reading past its length)
    "eval.beyond_passkey_words=null",
]


def _evaluate_rows(lineage: Lineage) -> list[dict]:
    return lineage.query_dicts("SELECT * FROM steps WHERE step = 'evaluate' ORDER BY started")


@pytest.mark.slow
def test_a_planted_suite_payload_stays_inert_through_smollm3_run(tmp_path, prefect_harness, workspace_copy):
    from flows.cli import main

    # A copy of the session's data steps at these source sizes (tests/conftest.py): the run reuses
    # its sources, curations, tokenizer and shards and builds the stage, its suite and evaluation.
    ws = workspace_copy("tiny-data")
    run = ["run", "tiny", *OVERRIDES, f"workspace={ws}"]
    assert main(run) == 0
    lineage = Lineage(ws / "lineage.duckdb")
    assert [r["state"] for r in _evaluate_rows(lineage)] == ["completed"]
    (task_dir,) = ws.glob("eval_suite/*/tasks")
    canary = tmp_path / "canary"

    # files planted beside the suite: live on their own folder, ignored by the run
    (task_dir / "x.jsonl").write_text(json.dumps(ROW) + "\n")
    (task_dir / "x.yaml").write_text(_jinja_yaml("x", task_dir / "x.jsonl", canary))
    (task_dir / "utils.py").write_text(f"open({str(canary)!r}, 'w').close()\n")
    assert _load(task_dir, ["x"]) == {"x": ROW["context"]} and canary.exists()  # control
    canary.unlink()
    assert main([*run, "--refresh", "evaluate"]) == 0
    second = _evaluate_rows(lineage)[-1]
    assert second["state"] == "completed" and not canary.exists()
    (evaluation,) = [a for a in lineage.query_dicts("SELECT * FROM artifacts WHERE step = 'evaluate'")]
    scores = json.loads(evaluation["meta"])["scores"]
    assert "x" not in scores and {"prose_cloze", "arithmetic_cloze"} <= set(scores)

    # one of the suite's own task YAMLs swapped for the payload: live, and refused by the run
    swapped = task_dir / "prose_cloze.yaml"
    swapped.write_text(_jinja_yaml("prose_cloze", task_dir / "prose_cloze.jsonl", canary))
    assert _load(task_dir, ["prose_cloze"])["prose_cloze"] and canary.exists()  # control
    canary.unlink()
    with pytest.raises(Exception, match="prose_cloze.yaml") as err:  # noqa: B017  (the flow's own failure)
        main([*run, "--refresh", "evaluate"])
    last = _evaluate_rows(lineage)[-1]
    assert last["state"] == "failed" and "ForeignTaskFile" in (last["error"] or "") + str(err.value)
    assert not canary.exists()
