"""datatrove executors of the curation stages (curation/executors.py): Slurm and Ray chains, and
the worker count per stage."""

from __future__ import annotations

import pytest

from curation.executors import SlurmExecutorConfig, machine_cores, make_executors, stage_workers
from curation.stages import plan_stages
from tasks.curate import CurationConfig


def test_slurm_and_ray_executors_are_constructed_and_chained(tmp_path):
    slurm = CurationConfig(
        executor="slurm", tasks=4, workers=2, slurm=SlurmExecutorConfig(partition="cpu", sbatch_args={"account": "lm"})
    )
    stages = plan_stages(slurm, "web", tmp_path / "train", tmp_path, 4)
    ex = make_executors(slurm, stages, tmp_path / "logs")
    assert [type(e).__name__ for e in ex] == ["SlurmPipelineExecutor"] * len(stages)
    assert ex[0].partition == "cpu" and ex[0].tasks == 4 and ex[0].depends is None
    assert all(b.depends is a for a, b in zip(ex, ex[1:], strict=False))
    ray = CurationConfig(executor="ray", tasks=4, workers=2)
    ex = make_executors(ray, stages, tmp_path / "logs")
    assert [type(e).__name__ for e in ex] == ["RayPipelineExecutor"] * len(stages)
    with pytest.raises(ValueError, match="curation.slurm is not set"):
        make_executors(CurationConfig(executor="slurm"), stages, tmp_path / "logs")


def test_workers_default_to_the_machines_cores_locally_and_all_tasks_on_clusters():
    assert stage_workers(CurationConfig(), 100) == min(machine_cores(), 100)
    assert stage_workers(CurationConfig(), 1) == 1
    assert stage_workers(CurationConfig(workers=3), 100) == 3
    assert stage_workers(CurationConfig(executor="ray"), 100) == 100
