"""`RayStage` (curation/ray_stage.py), the Ray executor's run loop, on a local Ray instance
(`ray.init(num_cpus=2)`): the two-stage chained pipeline of tests/infra/test_scale_executors.py,
and tasks that hang or raise. Not in the Slurm group: Ray instances on their own ports run beside
the Slurm tests (the Ray head test of tests/curation/test_executors.py runs on any worker too)."""

from __future__ import annotations

import time

import pytest
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

from curation.executors import RayExecutorConfig, make_executors, run_executors
from tasks.curate import CurationConfig
from tests.infra.test_scale_executors import read_docs, two_stages, write_docs


@pytest.fixture
def local_ray():
    """A local Ray instance (2 CPUs) for the test; afterwards the process's `RAY_*` environment is
    put back and Ray reads its auth settings again: Ray 2.60's `ray.init` turns token
    authentication on for a cluster it starts and leaves `RAY_AUTH_MODE=token` in `os.environ`."""

    import ray

    from curation.executors import ray_environment

    with ray_environment():
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


@pytest.mark.slow
def test_ray_executor_runs_a_chained_pipeline_on_local_ray(local_ray, tmp_path):
    from datatrove.executor import RayPipelineExecutor

    config = CurationConfig(
        executor="ray",
        tasks=2,
        workers=2,
        ray=RayExecutorConfig(cpus_per_task=1, mem_per_cpu_gb=0.25, time_limit_s=10),
    )
    stages = two_stages(tmp_path)
    executors = make_executors(config, stages, tmp_path / "logs")
    assert all(isinstance(ex, RayPipelineExecutor) for ex in executors)  # datatrove's, with our run loop
    logged: list[str] = []
    run_executors(config, executors, tmp_path / "logs", logged.append)
    # silence: tasks well inside a tight limit are neither killed nor rerun
    assert not [line for line in logged if "time limit" in line or "running it again" in line], logged
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
