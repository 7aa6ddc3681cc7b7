"""The Slurm launcher against a real one-node Slurm cluster (started by `local_slurm`).

The rendered script is submitted with sbatch, runs `srun torchrun` with a c10d rendezvous on the
node, and trains the tiny model on 2 ranks; a second submission of a longer spec resumes from the
first job's checkpoint (what a requeue does); a job whose trainer fails is reported with its log.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from infra.launchers import LaunchConfig, LaunchFailed, SlurmLaunchConfig, get_launcher
from tests.infra.launch_fixtures import write_plan, write_spec

# One private Slurm cluster per test process: under pytest-xdist these tests share one worker.
pytestmark = pytest.mark.xdist_group("slurm")

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def slurm_config(procs: int = 2, **kw) -> LaunchConfig:
    return LaunchConfig(
        kind="slurm",
        nodes=1,
        procs_per_node=procs,
        torchrun=TORCHRUN,
        slurm=SlurmLaunchConfig(time="00:10:00", cpus_per_task=2, poll_seconds=0.5, job_name="smollm3-test", **kw),
    )


@pytest.mark.slow
def test_sbatch_srun_torchrun_trains_then_a_resubmission_resumes(local_slurm, tmp_path):
    plan = write_plan(tmp_path / "shards")
    out = tmp_path / "stage"
    launcher = get_launcher(slurm_config())
    lines: list[str] = []
    spec = write_spec(out / "spec.json", plan, out, steps=2)
    launcher.launch(spec, out, lines.append)
    first = json.loads((out / "result.json").read_text())
    assert first["world_size"] == 2 and first["final_step"] == 2 and first["resumed_from"] is None
    text = "\n".join(lines)
    assert "[launch] submitted Slurm job" in text
    assert "rendezvous " in text and "on 1 node(s)" in text  # the script's own banner, streamed
    assert "srun exited with code 0" in text and lines[-1].endswith("completed")

    # The same stage, longer: a requeued or resubmitted job continues from the checkpoint.
    spec = write_spec(out / "spec.json", plan, out, steps=4)
    launcher.launch(spec, out, lambda _: None)
    second = json.loads((out / "result.json").read_text())
    assert second["final_step"] == 4 and second["resumed_from"].endswith("step_00000002")
    assert len(list(out.glob("slurm-*.log"))) == 2


@pytest.mark.slow
def test_a_failing_job_is_reported_with_its_log(local_slurm, tmp_path):
    out = tmp_path / "bad"
    spec = write_spec(out / "spec.json", tmp_path / "no-such-plan.json", out)
    with pytest.raises(LaunchFailed, match=r"Slurm job \d+ ended FAILED \(exit 1:0\)") as err:
        get_launcher(slurm_config(procs=1, requeue=False)).launch(spec, out, lambda _: None)
    # the rank's exception, not only torchrun's summary, reaches the message
    assert err.value.first_error.startswith("FileNotFoundError")
    assert "no-such-plan.json" in err.value.first_error
    assert "srun exited with code 1" in str(err.value)


@pytest.mark.slow
def test_a_post_training_step_runs_on_slurm_through_accelerate(local_slurm, tmp_path):
    """An SFT step whose launch is Slurm + `accelerate launch` (CPU DDP config, 2 ranks): the
    job runs `-m trainers.posttrain` on the allocation, its log streams into the step's log, and the
    loss curve is the one of a local single-process run."""
    from infra.launchers import SlurmLaunchConfig
    from pipeline.artifact import MARKER, Artifact
    from tasks.posttrain.data import posttrain_data
    from tests.tasks.test_posttrain_steps import DATA, corpus_texts, make_corpora, make_tiny_model
    from trainers.posttrain.launch import launch_trainer
    from trainers.posttrain.sections import ChatDataSpec, PosttrainConfig, PosttrainSpec, SFTConfig

    corpora = make_corpora(tmp_path / "corpora")
    base = make_tiny_model(tmp_path, corpus_texts(corpora))
    posttrain_data(ChatDataSpec(data=DATA), corpora, out=tmp_path / "data", log=lambda _: None)
    (tmp_path / "data" / MARKER).write_text("{}")
    section = SFTConfig(max_steps=3, batch=8, max_length=128, save_steps=2)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    slurm = LaunchConfig(
        kind="slurm",
        nodes=1,
        procs_per_node=2,
        module="trainers.posttrain",
        accelerate_config="configs/accelerate/cpu-ddp.yaml",
        accelerate=accelerate,
        slurm=SlurmLaunchConfig(time="00:10:00", cpus_per_task=2, poll_seconds=0.5, job_name="smollm3-posttrain-test"),
    )
    runs = {
        name: PosttrainSpec.of(section, PosttrainConfig(device="cpu"), launch=launch, threads=1)
        for name, launch in (("slurm", slurm), ("local", LaunchConfig(module="trainers.posttrain")))
    }
    lines: list[str] = []
    metas = {
        name: launch_trainer(
            "sft", run, base, tmp_path / "data", tmp_path / name, lines.append if name == "slurm" else (lambda _: None)
        )
        for name, run in runs.items()
    }
    assert metas["slurm"]["world_size"] == 2 and metas["slurm"]["launch"].startswith("slurm, 1 node x 2")
    script = (tmp_path / "slurm" / "launch" / "train.sbatch").read_text()
    assert "accelerate launch --config_file configs/accelerate/cpu-ddp.yaml" in script
    text = "\n".join(lines)
    assert "[launch] submitted Slurm job" in text and "step 3/3 | loss " in text  # the trainer's log
    curves = {
        name: [
            (json.loads(line)["step"], json.loads(line)["loss"])
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)
        ]
        for name in runs
    }
    assert [s for s, _ in curves["slurm"]] == [1, 2, 3]
    for (_, a), (_, b) in zip(curves["slurm"], curves["local"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert (
        Artifact(kind="hf_model", uri=metas["slurm"]["model_dir"], fingerprint="x" * 64)
        .path.joinpath("model.safetensors")
        .is_file()
    )


@pytest.mark.slow
def test_sao_trains_on_a_rollout_pool_that_runs_as_a_slurm_job(local_slurm, tmp_path):
    """SAO's rollout pool (`rollout_nodes: 1`) as a real Slurm job beside the trainer (here the
    trainer runs in this process): the job's task runs the pool node on the allocation, the
    trainer trains on its samples and starts no worker, and its end completes the job."""
    from infra.launchers.pool import PoolRunner, read_pool_record
    from pipeline.artifact import MARKER
    from tasks.posttrain.data import posttrain_data
    from tests.tasks.test_posttrain_steps import DATA, corpus_texts, make_corpora, make_tiny_model
    from trainers.posttrain.launch import rollout_pool
    from trainers.posttrain.sao import train_sao
    from trainers.posttrain.sections import ChatDataSpec, SAOConfig

    corpora = make_corpora(tmp_path / "corpora")
    base = make_tiny_model(tmp_path, corpus_texts(corpora))
    posttrain_data(ChatDataSpec(data=DATA), corpora, out=tmp_path / "data", log=lambda _: None)
    (tmp_path / "data" / MARKER).write_text("{}")
    section = SAOConfig(
        enabled=True,
        max_steps=2,
        value_warmup=1,
        batch=4,
        max_completion_length=12,
        rollout_nodes=1,
        rollout_timeout_s=300,
    )
    slurm = LaunchConfig(
        kind="slurm",
        module="trainers.posttrain",
        python=sys.executable,
        slurm=SlurmLaunchConfig(time="00:10:00", cpus_per_task=2, poll_seconds=0.5, job_name="smollm3-pool-test"),
    )
    out = tmp_path / "sao"
    launcher = get_launcher(slurm)
    lines: list[str] = []
    with PoolRunner(launcher, rollout_pool(section, out), out, lines.append, poll_s=0.5):
        job = read_pool_record(out, "rollout")["job"]
        meta = train_sao(section, base, tmp_path / "data", out, device="cpu", log=lines.append)
        for _ in range(240):  # the trainer's `done` ends the pool's task, which completes the job
            if launcher.pool_state(rollout_pool(section, out), job) is not None:
                break
            time.sleep(0.5)
        assert launcher.pool_state(rollout_pool(section, out), job) == "completed"
    text = "\n".join(lines)
    assert f"rollouts from the rollout pool Slurm job {job} (1 node)" in text and "no local worker" in text, text
    assert meta["steps"] == 3 and meta["samples"] >= 12 and meta["rollout_restarts"] == 0
    assert not (out / "rollout" / "workers.json").exists()
    log = (out / f"rollout-{job}.log").read_text()
    assert "rollout pool node 0/1" in log and "the trainer is done" in log and "srun exited with code 0" in log, log
    script = (out / "launch" / "rollout.sbatch").read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --no-requeue" in script
