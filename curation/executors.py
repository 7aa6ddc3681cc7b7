"""Where datatrove pipelines run: one executor per stage (local processes, Slurm array jobs or
Ray), each depending on the previous one, and the settings of the cluster executors.

Shared by the source, curate and tokenize steps: `config` is any recipe section (or the source
step's spec, which copies curation's) with `executor`, `workers`, `slurm` and `ray`. The worker count is operational (the output is the same whatever
it is); the number of datatrove tasks is not (it sets the output shards) and is chosen by the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SlurmExecutorConfig(BaseModel):
    """Where curation runs on a Slurm cluster (datatrove SlurmPipelineExecutor parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partition: str  # Slurm partition to submit to
    time: str = "24:00:00"  # wall-clock limit of each array job
    cpus_per_task: int = Field(default=1, gt=0)  # CPUs per datatrove task
    mem_per_cpu_gb: int = Field(default=2, gt=0)  # memory per CPU
    qos: str = "normal"  # Slurm quality of service
    venv_path: str | None = None  # activate this virtualenv in the jobs (else the submitting env)
    sbatch_args: dict[str, str] = {}  # extra `#SBATCH` options, e.g. {"account": "lm"}
    poll_seconds: float = Field(default=60.0, ge=0.01)  # how often to check for finished tasks (a floor)


class RayExecutorConfig(BaseModel):
    """Where curation runs on a Ray cluster (datatrove RayPipelineExecutor parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus_per_task: int = Field(default=1, gt=0)  # CPUs reserved per datatrove task
    mem_per_cpu_gb: float = Field(default=2.0, gt=0)  # memory reserved per CPU


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and Slurm set)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stage_workers(config, tasks: int) -> int:
    """Tasks of a stage run at once: `workers`, or (unset) this machine's cores for the local
    executor and every task for the cluster ones; never more than the stage's tasks."""
    if config.workers is not None:
        return min(config.workers, tasks)
    return min(machine_cores(), tasks) if config.executor == "local" else tasks


def make_executors(config: Any, stages: list[tuple[str, list, int]], logs: Path) -> list:
    """One datatrove executor per stage, each depending on the previous one. `config` is any
    section with `executor`, `workers`, `slurm` and `ray` (curation, tokenization)."""
    executors: list = []
    previous = None
    for name, pipeline, tasks in stages:
        workers = stage_workers(config, tasks)
        logging_dir = str(logs / name)
        if config.executor == "local":
            from datatrove.executor import LocalPipelineExecutor

            ex = LocalPipelineExecutor(
                pipeline, tasks=tasks, workers=workers, logging_dir=logging_dir, depends=previous
            )
        elif config.executor == "slurm":
            from datatrove.executor import SlurmPipelineExecutor

            if config.slurm is None:
                section = {"CurationConfig": "curation", "SourceSpec": "curation", "TokenizeConfig": "tokenize"}.get(
                    type(config).__name__, type(config).__name__
                )
                raise ValueError(
                    f"{section}.executor is slurm but {section}.slurm is not set; add a slurm section with at least partition"
                )
            s = config.slurm
            ex = SlurmPipelineExecutor(
                pipeline,
                tasks=tasks,
                workers=workers,
                time=s.time,
                partition=s.partition,
                cpus_per_task=s.cpus_per_task,
                mem_per_cpu_gb=s.mem_per_cpu_gb,
                qos=s.qos,
                venv_path=s.venv_path,
                sbatch_args=dict(s.sbatch_args),
                job_name=f"curate-{name}",
                logging_dir=logging_dir,
                depends=previous,
            )
        else:
            from datatrove.executor import RayPipelineExecutor

            ex = RayPipelineExecutor(
                pipeline,
                tasks=tasks,
                workers=workers,
                logging_dir=logging_dir,
                depends=previous,
                cpus_per_task=config.ray.cpus_per_task,
                mem_per_cpu_gb=config.ray.mem_per_cpu_gb,
            )
        executors.append(ex)
        previous = ex
    return executors


def run_executors(config: Any, executors: list, logs: Path) -> None:
    """Run the chain; the local executor runs in-process stage by stage, clusters are awaited."""
    if config.executor == "local":
        for ex in executors:
            ex.run()
        return
    executors[-1].run()  # launches its dependencies first (slurm: sbatch with afterok)
    if config.executor == "slurm":
        from infra.launchers.slurm import wait_for_datatrove

        # polls the array jobs too: a failed stage raises (and cancels the chain) instead of
        # leaving its afterok dependents pending forever
        wait_for_datatrove(executors, config.slurm.poll_seconds if config.slurm else 60.0)
