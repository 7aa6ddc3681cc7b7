"""datatrove's cluster executors as the recipe selects them (tasks/curate.py `make_executors`):

- Slurm: the sbatch scripts datatrove would submit for the real curation stages, rendered without
  submitting, then a small two-stage pipeline run for real on the one-node test Slurm cluster
  (`local_slurm`), chained by `afterok` exactly as curation chains its stages;
- Ray: tests/curation/test_ray_stage.py.
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

from curation.executors import SlurmExecutorConfig, make_executors, run_executors
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
