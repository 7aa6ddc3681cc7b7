"""Post-training steps retry a killed trainer within the run, as a pretraining stage does.

A real SFT step runs through the flow runner (Prefect task, lineage rows): its trainer's rank is
SIGKILLed from outside (as the OOM killer would) once a checkpoint is published; the attempt is
recorded `retried` with the signal and the checkpoint, Prefect runs the step again and the new
trainer resumes from that checkpoint. A Python error in a trainer is not retried (the runner's
tests: tests/pipeline/test_runner.py). The retry delay is the step's own (30 s) in every run;
this test runs the same step definition with a 1 s delay.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from infra.launchers import LaunchConfig
from pipeline.artifact import MARKER, Artifact
from tasks.posttrain.data import posttrain_data
from tests.tasks.test_posttrain_steps import DATA, corpus_texts, make_corpora, make_tiny_model
from tests.trainers.test_posttrain import Killer
from trainers.posttrain.sections import ChatDataSpec, PosttrainConfig, PosttrainSpec, SFTConfig

SFT = SFTConfig(max_steps=6, batch=8, max_length=256, save_steps=2)


def test_every_post_training_trainer_retries_a_transient_failure_like_pretrain():
    from tasks.posttrain.distill import distill
    from tasks.posttrain.grpo import grpo
    from tasks.posttrain.preference import preference
    from tasks.posttrain.sao import sao
    from tasks.posttrain.sft import sft
    from tasks.pretrain import pretrain

    for d in (sft, preference, grpo, sao, distill):
        assert (d.retries, d.retry_delay, d.resumable) == (pretrain.retries, pretrain.retry_delay, True), d


@pytest.fixture(scope="module")
def base_and_data(tmp_path_factory) -> tuple[Artifact, Artifact]:
    root = tmp_path_factory.mktemp("retry")
    corpora = make_corpora(root / "corpora")
    model = make_tiny_model(root, corpus_texts(corpora))
    posttrain_data(ChatDataSpec(data=DATA), corpora, out=root / "data", log=lambda _: None)
    (root / "data" / MARKER).write_text("{}")
    (root / "base").mkdir()
    (root / "base" / MARKER).write_text("{}")
    base = Artifact(kind="hf_model", uri=str(root / "base"), fingerprint="b" * 64, meta={"model_dir": str(model)})
    return base, Artifact(kind="corpus", uri=str(root / "data"), fingerprint="d" * 64, meta={})


@pytest.mark.slow
def test_a_killed_sft_trainer_is_retried_in_the_run_and_resumes_from_its_checkpoint(
    tmp_path, prefect_harness, base_and_data
):
    from prefect import flow

    from flows.recipe import load_recipe, run_setup
    from pipeline.graph import Given, Graph
    from pipeline.lineage import Lineage
    from pipeline.runner import run_flow
    from pipeline.workspace import Workspace
    from tasks.posttrain.sft import sft

    base, data = base_and_data
    recipe = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}"])
    run = PosttrainSpec.of(
        SFT, PosttrainConfig(device="cpu"), launch=LaunchConfig(module="trainers.posttrain"), threads=1
    )
    quick = dataclasses.replace(sft, retry_delay=1.0)  # the real step, a shorter wait

    @flow(name="posttrain-retry-test")
    def retry_flow() -> dict:
        g = Graph("posttrain-retry-test")
        g.final = g.add(quick, run, label="sft", model=Given(base), data=Given(data))
        return run_flow("posttrain-retry-test", g, run_setup(recipe, "tiny"))

    killer = Killer(Workspace.at(recipe.workspace).path, "sft")
    killer.start()
    result = retry_flow()
    killer.join(timeout=5)
    assert killer.killed_after is not None, "the trainer finished before it could be killed"
    lineage = Lineage(tmp_path / "ws" / "lineage.duckdb")
    rows = lineage.steps_of(result["run_id"])
    assert [r["state"] for r in rows] == ["retried", "completed"], rows
    assert "rank 0 killed by SIGKILL" in rows[0]["error"], rows[0]["error"]
    assert f"a retry resumes from step {killer.killed_after}" in rows[0]["error"]
    meta = result["final"]["meta"]
    assert meta["resumed_from_step"] == killer.killed_after and meta["steps"] == SFT.max_steps
    assert Path(meta["model_dir"], "model.safetensors").is_file()
