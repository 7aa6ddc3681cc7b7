"""The training loop's callbacks (trainers/callbacks.py), each alone: built, fed the hooks the
loop would call, and judged by what it decides and writes. No model, no process group."""

from __future__ import annotations

import json
import math

import torch

from infra.files import write_atomic
from model.spec import NonFiniteConfig, SpikeSkipConfig, TrainSpec
from model.token_shards import MixtureLoader, MixturePlan
from trainers.callbacks import Callbacks, NonFiniteRollback, RunInfo, SpikeSkip
from trainers.monitor import SKIP_FILE, plan_skip, read_nonfinite


def run_info(tmp_path, plan_path, resume_state=None, start_step=0) -> RunInfo:
    spec = TrainSpec(steps=10, global_batch=4, micro_batch=4, out_dir=str(tmp_path), mixture_plan=str(plan_path))
    loader = MixtureLoader(MixturePlan.load(plan_path))
    return RunInfo(spec, 0, 1, torch.device("cpu"), "stage1", 32, 128, loader, start_step, resume_state)


def events(tmp_path) -> list[dict]:
    path = tmp_path / "monitor" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


LOSSES = [2.0, 2.02, 1.98, 2.01, 1.99, 2.0, 2.03, 1.97]  # a calm history: mean 2.0, deviation ~0.02


def test_spike_skip_withholds_a_spike_and_a_resumed_copy_decides_as_the_original(tmp_path, plan_path):
    config = SpikeSkipConfig(window=8, sigma=3.0, min_history=4)
    spikes = SpikeSkip(config)
    spikes.pre_train(run_info(tmp_path, plan_path))
    decided = [spikes.skip_update(step, loss, 1.0 + loss / 100) for step, loss in enumerate(LOSSES, 1)]
    assert decided == [False] * len(LOSSES)
    state = spikes.state_dict()  # what a checkpoint after step 8 keeps
    assert spikes.skip_update(9, 5.0, 1.05) is True  # 150 deviations out: not applied
    (flag,) = events(tmp_path)
    assert flag["kind"] == "skipped_step" and flag["step"] == 9 and "not applied" in flag["message"]
    fields: dict = {}
    spikes.metrics(9, fields, {})
    assert fields == {"skipped_steps": 1}

    # Resumed from the checkpoint after step 8, a fresh callback judges step 9 the same way.
    resumed = SpikeSkip(config)
    resumed.pre_train(run_info(tmp_path / "resumed", plan_path, resume_state={"monitor": state}, start_step=8))
    assert resumed.skip_update(9, 5.0, 1.05) is True and resumed.skipped == 1
    assert resumed.state_dict() == spikes.state_dict()

    # Off (skip_spikes: null): nothing is withheld, nothing is saved, every line counts 0.
    off = SpikeSkip(None)
    off.pre_train(run_info(tmp_path / "off", plan_path))
    assert not off.skip_update(1, 1e9, 1e9) and off.state_dict() == {}
    assert Callbacks([off]).metrics(1) == ({"skipped_steps": 0}, {})


def test_nonfinite_rollback_skips_the_planned_data_and_records_where_each_step_began(tmp_path, plan_path):
    # The pretrain step planned a window after an earlier failure: sequences 4..10 are skipped.
    window = {"from": 4, "to": 10, "failed_step": 2, "what": "loss", "checkpoint_step": 0}
    write_atomic(tmp_path / SKIP_FILE, json.dumps([window]))
    run = run_info(tmp_path, plan_path)
    rollback = NonFiniteRollback()
    rollback.pre_train(run)
    for step in (1, 2):  # the hooks the loop calls around each step's reads
        rollback.pre_step(step)
        run.loader.next_batch(4)
    assert run.loader.sequence == 14  # 4 read, 6 skipped at step 2's start, 4 read
    (flag,) = events(tmp_path)
    assert flag["kind"] == "data_skipped" and flag["step"] == 2 and flag["value"] == 6 * 32

    rollback.nonfinite(2, "loss", math.nan, None)  # step 2's loss is NaN: nothing saved yet
    record = read_nonfinite(tmp_path)
    assert record["checkpoint_step"] == 0 and record["checkpoint_sequence"] == 0
    assert record["step_sequences"] == {"1": 0, "2": 10} and record["sequence_after"] == 14
    assert events(tmp_path)[-1]["kind"] == "nonfinite"
    # The step side plans the next window from it: step 2's own data (10..14), nothing before.
    planned = plan_skip(tmp_path, record, NonFiniteConfig(retries=2, skip_steps=1))
    assert (planned["from"], planned["to"], planned["failed_step"]) == (10, 14, 2)

    # After a checkpoint at step 2, a failure rolls back to it and skips only what came after.
    rollback.post_checkpoint(2)
    rollback.pre_step(3)
    run.loader.next_batch(4)
    rollback.nonfinite(3, "gradient norm", math.inf, "ckpt/step_2")
    record = read_nonfinite(tmp_path)
    assert (record["checkpoint"], record["checkpoint_step"], record["checkpoint_sequence"]) == ("ckpt/step_2", 2, 14)
    assert record["step_sequences"] == {"3": 14} and record["sequence_after"] == 18


def test_a_failure_noticed_at_a_later_metrics_line_still_skips_only_through_its_own_steps_data(tmp_path, plan_path):
    """The loop reads a step's values only at metrics lines: a NaN at step 2 is noticed after
    step 4. The record still ends the window with step 2's data, not with what steps 3 and 4 read."""
    run = run_info(tmp_path, plan_path)
    rollback = NonFiniteRollback()
    rollback.pre_train(run)
    for step in (1, 2, 3, 4):
        rollback.pre_step(step)
        run.loader.next_batch(4)
    rollback.nonfinite(2, "loss", math.nan, None)
    record = read_nonfinite(tmp_path)
    assert record["step_sequences"] == {"1": 0, "2": 4, "3": 8, "4": 12} and record["sequence_after"] == 8
    planned = plan_skip(tmp_path, record, NonFiniteConfig(retries=2, skip_steps=1))
    assert (planned["from"], planned["to"], planned["failed_step"]) == (4, 8, 2)
