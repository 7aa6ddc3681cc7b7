"""datatrove's cluster executors as the recipe selects them (tasks/curate.py `make_executors`):

- Slurm: the sbatch scripts datatrove would submit for the real curation stages, rendered without
  submitting, then a small two-stage pipeline run for real on the one-node test Slurm cluster
  (`local_slurm`), chained by `afterok` exactly as curation chains its stages;
- Ray: the same two-stage pipeline on a local Ray instance (`ray.init(num_cpus=2)`).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from curation.stages import plan_stages
from tasks.curate import CurationConfig

# One private Slurm cluster per test process: under pytest-xdist these tests share one worker.
pytestmark = pytest.mark.xdist_group("slurm")

VENV_ACTIVATE = str(Path(sys.executable).parent / "activate")


def write_docs(folder: Path, shards: int = 2, per_shard: int = 5) -> None:
    folder.mkdir(parents=True)
    for s in range(shards):
        with gzip.open(folder / f"{s:05d}.jsonl.gz", "wt") as fh:
            for i in range(per_shard):
                fh.write(json.dumps({"id": f"{s}-{i}", "text": f"document {s} {i} " * 5}) + "\n")


def read_docs(folder: Path) -> list[str]:
    ids = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as fh:
            ids += [json.loads(line)["id"] for line in fh]
    return sorted(ids)


def two_stages(tmp_path: Path) -> list[tuple[str, list, int]]:
    """copy: 2 tasks, input -> mid; again: 2 tasks, mid -> out (needs the first stage's output)."""
    src, mid, out = tmp_path / "input", tmp_path / "mid", tmp_path / "out"
    write_docs(src)
    return [
        ("copy", [JsonlReader(str(src)), JsonlWriter(str(mid))], 2),
        ("again", [JsonlReader(str(mid)), JsonlWriter(str(out))], 2),
    ]


def test_slurm_executors_for_the_curation_stages_render_valid_sbatch_without_submitting(tmp_path):
    config = CurationConfig(
        executor="slurm",
        tasks=8,
        workers=4,
        slurm=SlurmExecutorConfig(
            partition="cpu",
            time="04:00:00",
            cpus_per_task=2,
            mem_per_cpu_gb=3,
            qos="high",
            venv_path="/fsx/venv/bin/activate",
            sbatch_args={"account": "lm"},
        ),
    )
    stages = plan_stages(config, "web", tmp_path / "corpus" / "train", tmp_path / "out", tasks=8)
    executors = make_executors(config, stages, tmp_path / "logs")
    from datatrove.executor import SlurmPipelineExecutor

    assert [name for name, _, _ in stages] == ["filter", "exact", "unique", "buckets", "cluster", "final"]
    assert all(isinstance(ex, SlurmPipelineExecutor) for ex in executors)
    for previous, ex in zip(executors, executors[1:], strict=False):
        assert ex.depends is previous  # launched together, each after the one before (afterok)
    for (name, _, tasks), ex in zip(stages, executors, strict=True):
        script = ex.get_launch_file_contents(
            ex.get_sbatch_args(max_array=tasks), "srun -l -n 1 launch_pickled_pipeline executor.pik"
        )
        path = tmp_path / f"{name}.slurm"
        path.write_text(script)
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        lines = [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]
        for expected in (
            "--partition=cpu",
            "--time=04:00:00",
            "--cpus-per-task=2",
            "--mem-per-cpu=3G",
            "--qos=high",
            "--account=lm",
            "--requeue",
            f"--job-name=curate-{name}",
        ):
            assert f"#SBATCH {expected}" in lines, (name, expected)
        workers = min(4, tasks)
        assert f"#SBATCH --array=0-{tasks - 1}%{workers}" in lines
        assert "source /fsx/venv/bin/activate" in script
    assert ex.logging_dir.path.endswith("logs/final")

    with pytest.raises(ValueError, match="curation.slurm is not set"):
        make_executors(CurationConfig(executor="slurm"), stages, tmp_path / "logs2")


@pytest.mark.slow
def test_slurm_executor_runs_a_chained_pipeline_on_real_slurm(local_slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    config = CurationConfig(
        executor="slurm",
        tasks=2,
        workers=2,
        slurm=SlurmExecutorConfig(
            partition="debug",
            time="00:10:00",
            cpus_per_task=1,
            mem_per_cpu_gb=1,
            venv_path=VENV_ACTIVATE,
            poll_seconds=0.5,
        ),
    )
    stages = two_stages(tmp_path)
    executors = make_executors(config, stages, tmp_path / "logs")
    run_executors(config, executors, tmp_path / "logs")  # submits both, waits for the last
    assert read_docs(tmp_path / "out") == read_docs(tmp_path / "input")
    assert executors[1].get_incomplete_ranks() == []
    assert (tmp_path / "logs" / "again" / "launch_script.slurm").is_file()
    assert executors[1].depends_job_id == executors[0].job_id  # afterok on the first stage


@pytest.fixture
def local_ray():
    """A local Ray instance (2 CPUs) for the test; afterwards the process's `RAY_*` environment is
    put back and Ray reads its auth settings again: Ray 2.60's `ray.init` turns token
    authentication on for a cluster it starts and leaves `RAY_AUTH_MODE=token` in `os.environ`."""
    import os

    import ray

    from curation.executors import _reload_ray_auth

    saved = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=100 * 1024 * 1024,
    )
    try:
        yield
    finally:
        ray.shutdown()
        for key in [k for k in os.environ if k.startswith("RAY_")]:
            del os.environ[key]
        os.environ.update(saved)
        _reload_ray_auth()


@pytest.mark.slow
def test_ray_executor_runs_a_chained_pipeline_on_local_ray(local_ray, tmp_path):
    from datatrove.executor import RayPipelineExecutor

    config = CurationConfig(
        executor="ray", tasks=2, workers=2, ray=RayExecutorConfig(cpus_per_task=1, mem_per_cpu_gb=0.25)
    )
    stages = two_stages(tmp_path)
    executors = make_executors(config, stages, tmp_path / "logs")
    assert all(isinstance(ex, RayPipelineExecutor) for ex in executors)  # datatrove's, with our run loop
    run_executors(config, executors, tmp_path / "logs")
    assert read_docs(tmp_path / "out") == read_docs(tmp_path / "input")
    assert executors[1].get_incomplete_ranks() == []


@pytest.mark.slow
def test_a_ray_task_past_its_time_limit_is_killed_and_rerun_and_a_failing_one_is_named(local_ray, tmp_path):
    """Faults put in the pipeline from outside the executor: a step that hangs the first time
    each rank runs it (a marker file says it ran) is killed at the time limit and rerun, and the
    stage finishes with every document (the limit counts from when the worker began the task,
    so a worker slow to start on a loaded machine does not use it up); one that always hangs
    fails the stage after its retries, and one that raises fails it at once (not retried), each
    naming the task and the reason."""
    src, out = tmp_path / "input", tmp_path / "out"
    write_docs(src)
    markers = tmp_path / "ran"
    markers.mkdir()

    def hang(first_time_only: bool):
        def step(data, rank, world_size):  # nested: pickled by value into the Ray worker
            marker = markers / str(rank)
            if not (first_time_only and marker.exists()):
                marker.touch()
                time.sleep(3600)
            yield from data

        return step

    def broken(data, rank, world_size):
        raise ValueError(f"bad shard {rank}")
        yield

    def stage(name: str, step, retries: int):
        config = CurationConfig(
            executor="ray",
            tasks=2,
            workers=2,
            ray=RayExecutorConfig(cpus_per_task=1, mem_per_cpu_gb=0.25, time_limit_s=5, retries=retries),
        )
        pipeline = [JsonlReader(str(src)), step, JsonlWriter(str(out / name))]
        return config, make_executors(config, [(name, pipeline, 2)], tmp_path / "logs")

    logged: list[str] = []
    config, executors = stage("once", hang(first_time_only=True), retries=1)
    run_executors(config, executors, tmp_path / "logs", logged.append)
    assert read_docs(out / "once") == read_docs(src)
    reruns = [line for line in logged if "ran past its time limit of 5 s: running it again" in line]
    assert sorted(line.split("task ")[1].split()[0] for line in reruns) == ["0", "1"], logged
    assert all("(attempt 2 of 2)" in line for line in reruns)

    config, executors = stage("always", hang(first_time_only=False), retries=0)
    with pytest.raises(
        RuntimeError,
        match=r"'always' on Ray: 2 of 2 tasks did not finish \(task 0 ran past its time limit of 5 s \(1 attempt\); task 1 ",
    ) as err:
        run_executors(config, executors, tmp_path / "logs", logged.append)
    assert str(tmp_path / "logs" / "always") in str(err.value)

    logged.clear()
    config, executors = stage("broken", broken, retries=3)
    with pytest.raises(
        RuntimeError,
        match=r"2 of 2 tasks did not finish \(task 0 ValueError: bad shard 0; task 1 ValueError: bad shard 1\)",
    ):
        run_executors(config, executors, tmp_path / "logs", logged.append)
    assert not [line for line in logged if "running it again" in line]  # an exception is not retried


@pytest.mark.slow
def test_a_failing_stage_stops_the_wait_instead_of_hanging(local_slurm, tmp_path):
    """tasks/curate.py polls get_incomplete_ranks() only: after a failed stage the next one stays
    pending forever (afterok never satisfied). wait_for_datatrove notices and cancels the chain."""
    from infra.launchers import LaunchFailed
    from infra.launchers.slurm import job_states, wait_for_datatrove

    config = CurationConfig(
        executor="slurm",
        tasks=1,
        workers=1,
        slurm=SlurmExecutorConfig(
            partition="debug",
            time="00:10:00",
            cpus_per_task=1,
            mem_per_cpu_gb=1,
            venv_path=VENV_ACTIVATE,
            poll_seconds=0.5,
        ),
    )
    src, mid = tmp_path / "input", tmp_path / "mid"
    src.mkdir()
    (src / "00000.jsonl.gz").write_bytes(b"this is not gzip")  # the first stage's task fails
    stages = [
        ("broken", [JsonlReader(str(src)), JsonlWriter(str(mid))], 1),
        ("after", [JsonlReader(str(mid)), JsonlWriter(str(tmp_path / "out"))], 1),
    ]
    executors = make_executors(config, stages, tmp_path / "logs")
    executors[-1].run()  # submits both stages, chained
    with pytest.raises(LaunchFailed, match=r"datatrove stage 'curate-broken' \(Slurm job \d+\) stopped: FAILED"):
        wait_for_datatrove(executors, poll_seconds=0.5)
    second = str(executors[1].job_id)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the dependent stage was cancelled
        states = [s for s, _ in job_states(second)]
        if not states or all(s == "CANCELLED" for s in states):
            break
        time.sleep(0.5)
    assert not states or all(s == "CANCELLED" for s in states), states
