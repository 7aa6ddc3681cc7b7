"""Post-training through Prefect: the real `post_train` wiring of flows/smollm3.py on tiny data.

A small flow runs the sources, a stand-in base model step (a random tiny SmolLM3 plus a BPE
tokenizer trained on the sources: the pretraining stages are tested elsewhere), then the
post-training DAG: posttrain data -> SFT -> APO -> merge -> GRPO, each scored by `evaluate` on
the cloze tasks and the held-out arithmetic exact-match task. Checks: every step completed, the
run's eval table has a row per step with the exact-match column, and the final model's lineage
reaches the raw sources; a second run comes back Cached.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from infra.artifact import Inputs
from tasks.step import many, step
from tests.conftest import SMALL

POSTTRAIN = [
    "stages=[]",
    "eval.items_per_task=8", "eval.passkey_lengths=[]", "eval.contamination_max_docs=50",
    "posttrain.device=cpu",
    "posttrain.data.math_examples=80", "posttrain.data.prose_examples=16",
    "posttrain.data.heldout_examples=8", "posttrain.data.prompts=32",
    "posttrain.sft={max_steps: 3, per_device_batch: 4, max_length: 128}",
    "posttrain.preference={max_steps: 2, per_device_batch: 4, samples_per_prompt: 2, max_new_tokens: 12}",
    "posttrain.grpo={max_steps: 2, per_device_batch: 4, num_generations: 2, max_completion_length: 12, save_steps: 2}",
    "posttrain.eval={generation_items: 6, max_gen_tokens: 12, cloze_items: 4}",
]


@step("tiny_base", version=1, kind="hf_model")
def tiny_base(config: dict, inputs: Inputs, out: Path, *, log=print) -> dict:
    """A random tiny SmolLM3 exported with a tokenizer trained on the input corpora."""
    from tests.tasks.test_posttrain_steps import corpus_texts, make_tiny_model

    folder = make_tiny_model(out, corpus_texts(list(many(inputs, "corpora"))), hidden=config["hidden"])
    return {"stage": "long2", "model_dir": str(folder)}


@flow(name="posttrain-test", task_runner=ThreadPoolTaskRunner(max_workers=64))
def posttrain_flow(overrides: list[str]) -> str:
    from flows.graph import Graph
    from flows.runner import run_flow
    from flows.smollm3 import post_train
    from tasks.recipe import load_recipe
    from tasks.sources import SourceSpec, source

    cfg = load_recipe("tiny", overrides)
    g = Graph("posttrain-test")
    corpora = [g.add(source, SourceSpec.of(s, cfg.seed), label=s.name) for s in cfg.sources]
    base = g.add(tiny_base, {"hidden": 64}, label="long2", corpora=corpora)
    post_train(g, cfg, base, corpora)
    return run_flow("posttrain-test", g, cfg, "tiny")["run_id"]


@pytest.mark.slow
def test_posttrain_dag_scores_every_step_and_keeps_lineage(tmp_path, prefect_harness):
    import torch

    from flows.report import eval_table
    from infra.lineage import Lineage

    torch.set_num_threads(2)
    ws = tmp_path / "ws"
    over = [*SMALL, *POSTTRAIN, f"workspace={ws}"]
    run_id = posttrain_flow(over)
    lineage = Lineage(ws / "lineage.duckdb")
    steps = lineage.steps_of(run_id)
    states = {f"{s['step']}[{s['label']}]": s["state"] for s in steps}
    for name in ("posttrain_data[chat]", "sft[sft]", "preference[apo]", "merge[merge]", "grpo[grpo]",
                 "eval_suite[posttrain]", "evaluate[base]", "evaluate[sft]", "evaluate[apo]",
                 "evaluate[merge]", "evaluate[grpo]"):
        assert states.get(name) == "completed", (name, states)

    table = eval_table(lineage, run_id)
    head, models, _note = table.split("\n\n")
    tasks, metrics = head.splitlines()[0].split(), head.splitlines()[1].split()
    assert tasks[-1] == "arithmetic_exact" and metrics[-1] == "exact_match", table
    assert [line.split()[0] for line in models.splitlines()] == ["base", "sft", "apo", "merge", "grpo"], table
    assert all("±" in line for line in models.splitlines()), table

    final = next(s for s in steps if s["step"] == "grpo")["fingerprint"]
    up = lineage.ancestors(final)
    assert {a["step"] for a in up} >= {"source", "tiny_base", "posttrain_data", "sft", "preference", "merge"}
    assert {a["label"] for a in up if a["step"] == "source"} == {"prose", "code", "math"}

    again = posttrain_flow(over)
    assert {s["state"] for s in lineage.steps_of(again)} == {"cached"}
