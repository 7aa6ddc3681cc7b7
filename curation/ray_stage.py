"""A datatrove stage on Ray with our own submit-and-wait loop (`RayStage`); imported only by a
step whose executor is `ray` (curation/executors.py `make_executors`)."""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from datatrove.executor import RayPipelineExecutor
from datatrove.utils.stats import PipelineStats


def _run_rank(executor: Any, rank: int, marker: str) -> None:
    """One datatrove task in a Ray worker (the remote function of `RayStage`). It first leaves
    `marker`, `started/{rank}.{run}.{attempt}`, in the stage's logging folder (`run` is new for
    each `RayStage.run`, so a rerun of the step never finds an old one): the driver starts the
    task's clock when it sees it, so a worker slow to start on a loaded node does not eat the
    time limit."""
    import socket

    with executor.logging_dir.open(marker, "w") as f:
        f.write(socket.gethostname())
    executor._run_for_rank(rank)


class RayStage(RayPipelineExecutor):
    """A datatrove stage on Ray, run by our own submit-and-wait loop instead of datatrove's.

    datatrove's `RayPipelineExecutor.run` (0.10) creates an actor and a placement group per
    task from a thread pool and forks a process pool inside the actor. Its code shows three
    ways to wait forever or crash on a cluster: a failed submission (an actor that dies while it
    starts) is never reported to the wait loop, which then polls forever; a task past its `time`
    is killed and the loop then fails with a `KeyError`; and a fork of a multithreaded process
    (the Ray worker) can deadlock in the child. A stage on a Ray head waited 20 minutes in that
    loop in CI's run of the suite (which of these it was is not known: the head's logs were gone).

    Here each incomplete rank is one Ray task (`num_cpus`, `memory` as datatrove asks; Ray
    reuses the job's worker processes across tasks, as datatrove's local executor reuses its
    pool's), at most `workers` at once. A task running longer
    than `time` seconds (counted from when its worker began it, within the loop's 5 s poll) is
    cancelled (its worker killed) and run again, as is one lost with its worker (node loss), up to
    `retries` times; an exception in the pipeline is not retried (the same input fails the same
    way). The stage raises naming every rank that did not finish and why, and where its task logs
    are (a killed task leaves none: datatrove copies a Ray task's log when it ends); progress is
    logged once a minute."""

    progress_every_s: float = 60.0

    def __init__(self, *args, retries: int = 3, **kwargs):
        super().__init__(*args, **kwargs)
        self.retries = retries

    def run(self, log=print) -> None:  # noqa: C901  (one loop: submit, wait, time out, retry)
        import ray
        from ray.exceptions import RayError, RayTaskError

        name = Path(self.logging_dir.path).name
        if self.depends is not None and self.depends.get_incomplete_ranks():
            raise RuntimeError(f"datatrove stage {name!r} on Ray: the stage it depends on has not finished")
        todo = self.get_incomplete_ranks(range(self.world_size))
        if not todo:
            log(f"ray: stage {name}: all {self.world_size} tasks finished before, nothing to run")
            return
        self.save_executor_as_json()
        executor = ray.put(self)
        memory = int(self.mem_per_cpu_gb * self.cpus_per_task * 1024**3)
        remote = ray.remote(num_cpus=self.cpus_per_task, num_gpus=self.gpus_per_task, memory=memory, max_retries=0)(
            _run_rank
        )
        log(f"ray: stage {name}: {len(todo)} of {self.world_size} tasks to run, {self.workers} at once")
        waiting = deque(todo)
        running: dict = {}  # ref -> (rank, when its worker began it, or None before that)
        attempts = dict.fromkeys(todo, 0)
        run_id = uuid.uuid4().hex[:8]

        def marker(rank: int) -> str:
            return f"started/{rank:05d}.{run_id}.{attempts[rank]}"

        killed: set = set()  # refs cancelled for their time limit
        failed: dict[int, str] = {}
        done = 0
        last_report = time.monotonic()
        try:
            while waiting or running:
                while waiting and len(running) < self.workers:
                    rank = waiting.popleft()
                    attempts[rank] += 1
                    running[remote.remote(executor, rank, marker(rank))] = (rank, None)
                finished, _ = ray.wait(list(running), num_returns=1, timeout=5.0)
                for ref in finished:
                    rank, _ = running.pop(ref)
                    try:
                        ray.get(ref)
                        done += 1
                        continue
                    except RayTaskError as exc:  # the pipeline raised: the same input fails the same way
                        failed[rank] = str(exc).strip().splitlines()[-1][:300]
                        continue
                    except RayError as exc:  # cancelled for its limit, or lost with its worker or node
                        why = (
                            f"ran past its time limit of {self.time:g} s"
                            if ref in killed
                            else f"was lost with its worker ({type(exc).__name__})"
                        )
                    killed.discard(ref)
                    if attempts[rank] <= self.retries:
                        log(
                            f"ray: stage {name}: task {rank} {why}: running it again "
                            f"(attempt {attempts[rank] + 1} of {self.retries + 1})"
                        )
                        waiting.append(rank)
                    else:
                        failed[rank] = f"{why} ({attempts[rank]} attempt{'s' if attempts[rank] > 1 else ''})"
                now = time.monotonic()
                for ref, (rank, started) in running.items():
                    if started is None:
                        if self.logging_dir.exists(marker(rank)):
                            running[ref] = (rank, now)
                    elif self.time and now - started > self.time and ref not in killed:
                        killed.add(ref)
                        ray.cancel(ref, force=True)  # kills its worker process
                if now - last_report >= self.progress_every_s:
                    last_report = now
                    log(f"ray: stage {name}: {done} of {len(todo)} tasks done, {len(running)} running")
        finally:
            for ref in running:  # an interrupted step leaves nothing of its own running on the cluster
                ray.cancel(ref, force=True)
        if failed:
            reasons = "; ".join(f"task {rank} {why}" for rank, why in sorted(failed.items())[:10])
            raise RuntimeError(
                f"datatrove stage {name!r} on Ray: {len(failed)} of {self.world_size} tasks did not finish "
                f"({reasons}); see {self.logging_dir.path}/logs, fix the cause and rerun (finished tasks are skipped)"
            )
        total = PipelineStats()
        for rank in range(self.world_size):
            with self.logging_dir.open(f"stats/{rank:05d}.json", "r") as f:
                total += PipelineStats.from_json(json.load(f))
        with self.logging_dir.open("stats.json", "wt") as f:
            total.save_to_disk(f)
        log(f"ray: stage {name}: {done} tasks done")
