"""The run-wide views (tasks/run_report.py): one loss curve over the stages of a run on the
run's step axis, one eval table over every evaluated model, and the step that publishes them."""

from __future__ import annotations

import json

import pytest

from evals.report import eval_rows, run_series
from evals.training_metrics import stage_rows
from pipeline.artifact import Artifact
from tasks.run_report import RunReportSpec, run_report
from tests.evals.test_report import eval_artifacts

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "max_seq_len": 64,
}


# One pytest-xdist worker runs this module, so its module fixture (the two trained stages) is built once,
# not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("run-report-stages")


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """Two real stages of one WSD schedule (3 + 3 steps, the decay in the second), trained by the
    pretrain step's build: stage 2 continues stage 1's checkpoint and schedule."""
    from model.spec import OptimizerConfig, ScheduleSpec, TrainSpec
    from tasks.pretrain import StageSpec, pretrain
    from tests.model.conftest import write_two_source_plan

    root = tmp_path_factory.mktemp("stages")
    plan = write_two_source_plan(root / "plan")
    mixture = Artifact(kind="mixture", uri=str(plan.parent), fingerprint="m" * 64, meta={})
    out, previous = [], None
    for i, name in enumerate(("stage1", "stage2")):
        spec = TrainSpec(
            stage=name,
            steps=3,
            global_batch=8,
            micro_batch=8,
            seq_len=32,
            num_threads=1,
            device="cpu",
            model_overrides=TINY,
            optimizer=OptimizerConfig(lr=1e-3),
            schedule=ScheduleSpec(kind="wsd", warmup_steps=2, decay_fraction=0.5, total_steps=6, start_step=3 * i),
        )
        folder = root / "pretrain" / name
        folder.mkdir(parents=True)
        inputs = {"mixture": mixture, **({"init": previous} if previous else {})}
        meta = pretrain(StageSpec(spec=spec, threads=1), **inputs, out=folder, log=lambda _: None)
        previous = Artifact(kind="checkpoint", uri=str(folder), fingerprint=name * 10, meta=meta)
        out.append((name, previous))
    return out


@pytest.mark.slow
def test_one_loss_curve_on_the_runs_step_axis_with_the_one_schedule(two_stages, tmp_path):
    from model.schedule import lr_at
    from model.spec import ScheduleSpec

    stages = stage_rows(two_stages)
    assert [(s["label"], s["first_step"], s["steps"], s["first_token"], s["tokens"]) for s in stages] == [
        ("stage1", 0, 3, 0, 3 * 8 * 32),
        ("stage2", 3, 3, 3 * 8 * 32, 3 * 8 * 32),
    ]
    series = run_series(stages)
    assert [s["x"] for s in series] == [[1, 2, 3], [4, 5, 6]]  # one axis, no restart at stage 2
    schedule = ScheduleSpec(kind="wsd", warmup_steps=2, decay_fraction=0.5, total_steps=6)
    lrs = [lr for s in series for lr in s["lr"]]
    assert lrs == pytest.approx([lr_at(x - 1, 1e-3, schedule, 6) for x in range(1, 7)])
    assert lrs[-1] < lrs[2]  # the decay is in stage 2

    # the trackers draw the same axis: stage 2 continues stage 1's global step and tokens
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for (name, art), first in zip(two_stages, (0, 3), strict=True):
        board = EventAccumulator(art.meta["tracker_dir"])
        board.Reload()
        assert [e.step for e in board.Scalars("train/loss")] == [first + 1, first + 2, first + 3], name
        assert [e.value for e in board.Scalars("progress/tokens_seen")] == [(first + i) * 8 * 32 for i in (1, 2, 3)]

    inputs = {"stages": tuple(a for _, a in two_stages), "evals": ()}
    out = tmp_path / "report"
    out.mkdir()
    meta = run_report(RunReportSpec(stages=("stage1", "stage2")), out=out, log=lambda _: None, **inputs)
    assert meta["steps"] == 6 and meta["tokens"] == 6 * 8 * 32
    assert meta["final_loss"] == two_stages[-1][1].meta["final_loss"]
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")
    table = (out / "stages.md").read_text()
    assert "| stage2 | pretrain | 4-6 | 768 |" in table
    assert "MFU" in table and "(none: no datasheet peak for cpu float32" in table  # no peak here: said so
    with pytest.raises(ValueError, match="2 `stages` inputs but 1 labels in config.stages"):
        run_report(RunReportSpec(stages=("stage1",)), out=out, **inputs)


def test_run_report_step_publishes_two_artifacts_under_stable_keys(two_stages, tmp_path, prefect_harness):
    from prefect import flow
    from prefect.artifacts import Artifact as PrefectArtifact

    from tasks.run_report import publish_run_report, run_report

    evals = eval_artifacts(tmp_path)
    config = RunReportSpec(stages=("stage1", "stage2"), evals=tuple(label for label, _ in evals))
    inputs = {"stages": tuple(a for _, a in two_stages), "evals": tuple(a for _, a in evals)}
    out = tmp_path / "run_report"
    out.mkdir()
    lines: list[str] = []
    meta = run_report.run(config, inputs, out, log=lines.append)
    assert meta["models"] == ["stage1", "stage2", "sft"] and "0.400±0.112 (n=20)" in lines[0]
    assert json.loads((out / "evals.json").read_text()) == eval_rows(evals)
    flow(publish_run_report)(Artifact(kind="report", uri=str(out), fingerprint="r" * 64, meta=meta), None, "smollm3")
    curve = PrefectArtifact.get("smollm3-loss-curve")
    assert "data:image/png;base64," in curve.data and "| stage1 | pretrain | 1-3 |" in curve.data
    assert (
        "| sft | - | 0.400±0.112 (n=20) | 0.100±0.043 (n=50) | 0.300±0.065 (n=50, think 41.5 tok, 90% closed) "
        "| per task |" in PrefectArtifact.get("smollm3-evals").data
    )


def test_the_report_flags_a_step_that_moved_no_score_beyond_noise(tmp_path):
    evals = eval_artifacts(tmp_path)  # stage1, stage2 (the same scores), sft (prose_cloze 0.40±0.112 vs 0.31±0.046)
    labels = tuple(label for label, _ in evals)
    config = RunReportSpec(evals=labels, parents=(("stage2", "stage1"), ("sft", "stage2")))
    out = tmp_path / "report"
    out.mkdir()
    lines: list[str] = []
    meta = run_report(config, evals=tuple(a for _, a in evals), out=out, log=lines.append)
    assert meta["moved"] == [] and meta["unmoved"] == ["stage2", "sft"]
    assert "sft vs stage2: NO CHANGE BEYOND NOISE on any task (largest: prose_cloze +0.090, +0.7 se)" in lines[0]
    assert "- stage2 vs stage1: NO CHANGE BEYOND NOISE" in (out / "evals.md").read_text()
    with pytest.raises(ValueError, match=r"parents name labels that are no evals: \['grpo'\]"):
        RunReportSpec(evals=labels, parents=(("grpo", "sft"),))
