"""The pretrain step: the training settings declared once, the recipe's stage checks, S3
mirroring and resuming, the trainer's lines and MFU (the stages planned into launches:
tests/flows/test_stage_plan.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from flows.recipe import RecipeError, load_recipe
from flows.stage_plan import schedule_stages


def test_a_training_setting_is_declared_once_and_a_stage_may_set_its_own():
    """`TrainSettings` (model/spec.py) is the one declaration: the recipe's `training` section and
    the trainer's `TrainSpec` are it plus their own fields, a stage's overrides are derived from
    it (all optional, same constraints and identity/operational markers)."""
    from model.spec import RUN_WIDE, StageSettings, TrainSettings, TrainSpec
    from tasks.mixture import StageConfig
    from tasks.pretrain import TrainingConfig

    names = set(TrainSettings.model_fields)
    assert names <= set(TrainingConfig.model_fields) and names <= set(TrainSpec.model_fields)
    per_stage = names - set(RUN_WIDE)
    assert set(StageSettings.model_fields) == per_stage and per_stage <= set(StageConfig.model_fields)
    assert not set(RUN_WIDE) & set(StageConfig.model_fields)  # one model, one schedule's LR, one GPU
    for name in per_stage:
        declared, derived = TrainSettings.model_fields[name], StageSettings.model_fields[name]
        assert derived.default is None and derived.json_schema_extra == declared.json_schema_extra
        assert derived.metadata == declared.metadata  # gt=0 and the like
    recipe = load_recipe(
        "tiny",
        ["training.loss_chunk_tokens=64", "stages.stage2.loss_chunk_tokens=32", "stages.stage2.keep_last=5"],
    )
    runs = {r.name: r.spec for r in schedule_stages(recipe.training, recipe.stages, recipe.seed)}
    assert runs["stage2"].loss_chunk_tokens == 32 and runs["stage2"].keep_last == 5
    assert {n: (s.loss_chunk_tokens, s.keep_last) for n, s in runs.items() if n != "stage2"} == {
        n: (64, recipe.training.keep_last) for n in runs if n != "stage2"
    }
    # set above; tiny's long_context stages scale the LR and set their own batch
    changed = {"loss_chunk_tokens", "keep_last", "optimizer", "global_batch", "micro_batch"}
    for spec in runs.values():
        theirs = {k: v for k, v in spec.settings().items() if k not in changed}
        assert theirs == {k: v for k, v in recipe.training.settings().items() if k not in changed}
    # The resolved recipe lists what a stage sets, not every setting it leaves to `training`.
    stage2 = recipe.model_dump(mode="json")["stages"][1]
    assert stage2["loss_chunk_tokens"] == 32 and "tp" not in stage2 and "micro_batch" not in stage2
    with pytest.raises(RecipeError, match=r"stages\[stage2\]\.loss_chunk_tokens: .*greater than 0"):
        load_recipe("tiny", ["stages.stage2.loss_chunk_tokens=0"])
    with pytest.raises(RecipeError, match=r"stages\[stage2\]\.optimizer: unknown field"):
        load_recipe("tiny", ["stages.stage2.optimizer={lr: 0.1}"])


def test_stage_order_and_batch_layout_are_validated():
    with pytest.raises(RecipeError, match="pretrain stage must come before the long_context"):
        load_recipe("tiny", ["stages.stage2.kind=long_context"])
    with pytest.raises(RecipeError, match=r"stages\[long1\]: global_batch 10 must be a multiple of micro_batch 4"):
        load_recipe("tiny", ["stages.long1.global_batch=10"])
    with pytest.raises(RecipeError, match="global_batch 20 must be a multiple of micro_batch"):
        load_recipe("tiny", ["training.global_batch=20"])
    with pytest.raises(RecipeError, match="allowed presets: ablation_1b, smollm3_3b, tiny"):
        load_recipe("tiny", ["training.model=gpt5"])


@pytest.fixture
def s3(monkeypatch):
    from tests.infra.test_storage import s3 as moto_s3

    yield from moto_s3.__wrapped__(monkeypatch)


def small_stage_spec(steps: int):
    """A stage of a 2-layer, 64-wide model: `steps` of 32 rows, a checkpoint every 10, WSD."""
    from model.spec import OptimizerConfig, ScheduleSpec, TrainSpec

    return TrainSpec(
        stage="stage1",
        steps=steps,
        global_batch=32,
        micro_batch=8,
        checkpoint_interval=10,
        keep_last=2,
        model_preset="tiny",
        model_overrides={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "max_seq_len": 64,
        },
        optimizer=OptimizerConfig(lr=1e-3),
        schedule=ScheduleSpec(kind="wsd", decay_fraction=0.2, total_steps=steps, start_step=0),
    )


@pytest.mark.slow
def test_stage_mirrors_checkpoints_to_s3_and_resumes_from_there(tmp_path, s3, monkeypatch):
    """A stage killed after its first checkpoint, its local checkpoints then lost: the rerun pulls
    the newest complete checkpoint from S3 and continues from it instead of starting over. The
    uploads happen in the trainer (rank 0's process), never in this one (the flow's), and the
    bucket keeps what `storage.checkpoints` says: the newest one, step 20 and the stage's end."""
    from infra.storage import CheckpointRetention, S3Store
    from pipeline.artifact import Artifact
    from tasks.pretrain import StageSpec, pretrain
    from tests.infra.test_storage import cfg
    from tests.model.conftest import write_two_source_plan

    def no_upload_here(self, *args, **kwargs):
        raise AssertionError("the flow process uploaded a checkpoint")

    monkeypatch.setattr(S3Store, "upload_folder", no_upload_here)
    endpoint, client = s3
    plan = write_two_source_plan(tmp_path / "plan")
    spec = small_stage_spec(steps=60)
    storage = cfg(endpoint, "s3://ckpts/run", checkpoints=CheckpointRetention(keep_last=1, milestones=[20]))
    run = StageSpec(spec=spec, storage=storage)
    mixture = Artifact(kind="mixture", uri=str(plan.parent), fingerprint="m" * 64, meta={})
    out = tmp_path / "pretrain" / "abcdef123456"
    out.mkdir(parents=True)
    monkeypatch.setenv("SMOLLM3_INJECT_FAILURE", "stage1")  # the testing hook (tasks/pretrain.py)
    with pytest.raises(RuntimeError, match="injected failure"):
        pretrain(run, mixture=mixture, out=out, log=lambda _: None)
    remote = {k.split("/")[-2] for k in _keys(client) if k.endswith("_COMPLETE.json") or "/step_" in k}
    assert remote, "no checkpoint reached S3"
    shutil.rmtree(out / "checkpoints")  # the machine's disk is gone; the mirror is not
    (out / "metrics.jsonl").unlink()
    lines: list[str] = []
    meta = pretrain(run, mixture=mixture, out=out, log=lines.append)
    assert any("pulled step_" in line for line in lines)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert 10 < first["step"] < 60, "the rerun started from scratch instead of the S3 checkpoint"
    assert meta["resumed"] and meta["checkpoint"].endswith("step_00000060")
    rows = [json.loads(line) for line in (out / "mirror.jsonl").read_text().splitlines()]
    uploads = [r for r in rows if r["event"] == "uploaded"]
    assert uploads and os.getpid() not in {r["pid"] for r in rows}  # the trainer's process uploaded
    assert uploads[-1]["checkpoint"] == "step_00000060"
    assert any(line.startswith(f"[mirror] pid {uploads[-1]['pid']} uploaded step_00000060") for line in lines)
    prefix = "run/pretrain/abcdef123456/checkpoints/"
    complete = sorted(k[len(prefix) :].split("/")[0] for k in _keys(client) if k.endswith("_CHECKPOINT.json"))
    assert complete == ["step_00000020", "step_00000060"]  # the milestone and the stage end (the newest)
    assert {k[len(prefix) :].split("/")[0] for k in _keys(client) if k.startswith(prefix)} == set(complete)


@pytest.mark.slow
def test_on_a_cluster_launch_rank_0_pulls_the_checkpoint_and_the_step_moves_no_bytes(tmp_path, s3, monkeypatch):
    """A Slurm-kind stage (its ranks started here by the local launcher, as on a node) whose
    checkpoints are lost after a kill, with a killed pull's leftover in their folder: the step
    pulls nothing (the flow host moves no checkpoint bytes); the trainer's rank 0 pulls the newest
    checkpoint from S3, in its own process, while rank 1 waits, and both resume from it."""
    import tasks.pretrain as task
    from infra.launchers import get_launcher
    from infra.storage import S3Store
    from pipeline.artifact import Artifact
    from tests.infra.test_storage import cfg
    from tests.model.conftest import write_two_source_plan

    def not_here(*args, **kwargs):
        raise AssertionError("the flow process moved checkpoint bytes")

    monkeypatch.setattr(task, "pull_latest_checkpoint", not_here)
    monkeypatch.setattr(S3Store, "download_folder", not_here)  # the ranks' processes are not patched
    monkeypatch.setattr(S3Store, "upload_folder", not_here)
    # no cluster here: the stage's ranks start on this machine, as Slurm would start them on a node
    monkeypatch.setattr(task, "get_launcher", lambda launch: get_launcher(launch.model_copy(update={"kind": "local"})))
    monkeypatch.setattr(task, "adopt_excluded", lambda *args: None)
    endpoint, client = s3
    plan = write_two_source_plan(tmp_path / "plan")
    spec = small_stage_spec(steps=40)
    run = task.StageSpec(
        spec=spec, storage=cfg(endpoint, "s3://ckpts/run"), launch={"kind": "slurm"}, nproc_per_node=2, threads=1
    )
    assert run.launch.kind == "slurm"
    mixture = Artifact(kind="mixture", uri=str(plan.parent), fingerprint="m" * 64, meta={})
    out = tmp_path / "pretrain" / "abcdef123456"
    out.mkdir(parents=True)
    monkeypatch.setenv("SMOLLM3_INJECT_FAILURE", "stage1")
    with pytest.raises(RuntimeError, match="injected failure"):
        task.pretrain(run, mixture=mixture, out=out, log=lambda _: None)
    assert json.loads((out / "spec.json").read_text())["mirror"]["pull"] is True
    prefix = "run/pretrain/abcdef123456/checkpoints/"
    on_s3 = sorted(k[len(prefix) :].split("/")[0] for k in _keys(client) if k.endswith("_CHECKPOINT.json"))
    assert on_s3, "no checkpoint reached S3"
    shutil.rmtree(out / "checkpoints")  # the machine's disk is gone; the mirror is not
    (out / "metrics.jsonl").unlink()
    # a pull killed midway leaves its partial folder: it is neither taken as a checkpoint nor
    # mistaken for one that makes the pull unnecessary
    leftover = out / "checkpoints" / f".{on_s3[-1]}.partial"
    leftover.mkdir(parents=True)
    (leftover / "model.distcp").write_bytes(b"half")
    lines: list[str] = []
    meta = task.pretrain(run, mixture=mixture, out=out, log=lines.append)

    pulls = [json.loads(line) for line in (out / "mirror.jsonl").read_text().splitlines()]
    pulls = [r for r in pulls if r["event"] == "pulled"]
    assert [r["checkpoint"] for r in pulls] == [on_s3[-1]]
    assert pulls[0]["pid"] != os.getpid()  # rank 0's process, not the step's
    assert any(line.startswith(f"[mirror] pid {pulls[0]['pid']} pulled {on_s3[-1]} from s3://") for line in lines)
    pulled_step = int(on_s3[-1][5:])
    assert any("resumed from " in line and f"{on_s3[-1]} at step {pulled_step} " in line for line in lines)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == pulled_step + 1, "the rerun did not continue from the pulled checkpoint"
    assert meta["resumed"] and meta["checkpoint"].endswith("step_00000040")
    assert not leftover.exists()  # the pull replaced it with the complete folder


def _keys(client) -> list[str]:
    resp = client.list_objects_v2(Bucket="ckpts")
    return [o["Key"] for o in resp.get("Contents", [])]


def test_a_stage_streams_its_trainer_lines_and_measures_mfu_against_this_hosts_preflight(tmp_path):
    """A stage in a workspace where preflight calibrated this host: the trainer's step lines
    reach the step's log through the launcher, and MFU (below 1) names the calibration it used,
    in the metrics, the stage meta and its summary."""
    import socket

    import torch

    from infra.preflight.compute import cpu_matmul_gflops
    from model.spec import OptimizerConfig, ScheduleSpec, TrainSpec
    from pipeline.artifact import MARKER, Artifact
    from tasks.pretrain import StageSpec, pretrain
    from tests.model.conftest import write_two_source_plan

    ws = tmp_path / "ws"
    calibrated = ws / "preflight" / "0123456789ab"
    calibrated.mkdir(parents=True)
    source = "preflight 0123456789ab on this host: cpu_matmul fp32 1024^2, best burst, 1 thread"
    torch.set_num_threads(1)
    (calibrated / "preflight.json").write_text(
        json.dumps(
            {
                "calibration": [
                    {
                        "host": socket.gethostname(),
                        "device": "cpu",
                        "dtype": "float32",
                        "flops": cpu_matmul_gflops(1024, 1.0) * 1e9,
                        "threads": 1,
                        "source": source,
                    }
                ]
            }
        )
    )
    (calibrated / MARKER).write_text("{}")

    plan = write_two_source_plan(tmp_path / "plan")
    spec = TrainSpec(
        stage="stage1",
        steps=3,
        global_batch=8,
        micro_batch=8,
        checkpoint_interval=10,
        num_threads=1,
        device="cpu",
        model_preset="tiny",
        model_overrides={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "max_seq_len": 64,
        },
        optimizer=OptimizerConfig(lr=1e-3),
        schedule=ScheduleSpec(kind="wsd", total_steps=3, start_step=0),
    )
    mixture = Artifact(kind="mixture", uri=str(plan.parent), fingerprint="m" * 64, meta={})
    out = ws / "pretrain" / "abcdef123456"
    out.mkdir(parents=True)
    lines: list[str] = []
    meta = pretrain(StageSpec(spec=spec, threads=1), mixture=mixture, out=out, log=lines.append)

    assert [line.split(" |")[0] for line in lines if " step " in line and "/3 |" in line] == [
        "stage1 step 1/3",
        "stage1 step 2/3",
        "stage1 step 3/3",
    ]
    assert any(line.startswith("stage1 done: 3 steps in ") for line in lines)
    assert json.loads((out / "spec.json").read_text())["peak_calibration"]["source"] == source
    assert meta["mfu_peak_source"] == source and 0 < meta["mfu"] < 1
    assert f"({source})" in (out / "summary.md").read_text()
