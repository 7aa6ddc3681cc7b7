"""Helper pools beside a training job: processes on their own nodes that the trainer talks to
through the shared file system only (SAO's rollout pool: trainers/posttrain/rollout.py).

A `PoolSpec` says what each of the pool's `nodes` nodes runs (`python -m MODULE ARGS`, with
`NODE` in ARGS replaced by the node's index, 0 ... nodes - 1); the recipe's launcher renders and
submits it beside the trainer's job (`Launcher.render_pool`, `submit_pool`): a separate Slurm job
(`launch/rollout.sbatch`, one task per node), a Kubernetes Indexed Job (one pod per node, the
index from the Job's completion-index annotation), or processes on this machine (local).

`PoolRunner` runs a pool for as long as the trainer's launch: it submits the pool when the launch
starts, polls it every `poll_s` seconds, resubmits it when it ended while the trainer still runs
(a node failure, a killed job: the rule of a rollout worker that dies, one level up; at most
`max_restarts` times per launch), and cancels it when the launch ends, whatever the reason. It
keeps `launch/{name}-pool.json` up to date (which job, its log, how many restarts), which the
trainer reads to name the pool in its errors ("no sample from the rollout pool, Slurm job 12, for
900 s").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.files import read_json, write_json_atomic

NODE = "{node}"  # in PoolSpec.args: the node's index, filled in on each node


@dataclass(frozen=True)
class PoolSpec:
    """What a helper pool runs: `python -m module *args` once per node."""

    name: str  # "rollout": the job's name suffix, `launch/{name}.sbatch`, `launch/{name}-pool.json`
    nodes: int
    module: str
    args: tuple[str, ...] = field(default_factory=tuple)  # NODE stands for the node's index
    # the option through which a node on this machine (local launcher) is told the pid to end
    # with; None: such nodes outlive the process that started them
    parent_arg: str | None = None

    def argv(self, python: str, node: str) -> list[str]:
        """The command of one node, `node` put where NODE stands (a number, or a shell or
        Kubernetes expansion that gives it on the node)."""
        return [python, "-m", self.module, *(node if a == NODE else a for a in self.args)]


def pool_record(workdir: Path, name: str) -> Path:
    return Path(workdir) / "launch" / f"{name}-pool.json"


def read_pool_record(workdir: Path, name: str) -> dict | None:
    """What the step's launch says about its pool: `describe` ("Slurm job 12, 2 nodes"), `job`,
    `log`, `restarts`; None when no launch started one."""
    raw = read_json(pool_record(workdir, name))
    return raw if isinstance(raw, dict) else None


class PoolRunner:
    """Submit a pool, keep it running while the block runs, cancel it at the end:

    with PoolRunner(launcher, pool, workdir, log):
        launcher_of_the_trainer.launch(...)
    """

    def __init__(
        self,
        launcher,
        pool: PoolSpec,
        workdir: Path,
        log: Callable[[str], None] = print,
        poll_s: float = 30.0,
        max_restarts: int = 3,
    ):
        self.launcher, self.pool, self.workdir, self.log = launcher, pool, Path(workdir), log
        self.poll_s, self.max_restarts = poll_s, max_restarts
        self.handle: str | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _submit(self) -> None:
        handle = self.launcher.submit_pool(self.pool, self.workdir, self.log)
        with self._lock:
            self.handle = handle
        what = self.launcher.describe_pool(self.pool, handle)
        write_json_atomic(
            pool_record(self.workdir, self.pool.name),
            {"describe": what, "job": handle, "nodes": self.pool.nodes, "restarts": self.restarts, "time": time.time()},
        )
        self.log(f"[pool] {self.pool.name} pool: {what}")

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                ended = self.launcher.pool_state(self.pool, self.handle)
            except Exception as exc:  # the scheduler did not answer: look again next time
                self.log(f"[pool] could not read the {self.pool.name} pool's state ({type(exc).__name__}: {exc})")
                continue
            if ended is None or self._stop.is_set():
                continue
            if ended.startswith("completed"):  # every node exited 0: the trainer said it is done
                self.log(f"[pool] {self.launcher.describe_pool(self.pool, self.handle)} completed")
                return
            if self.restarts >= self.max_restarts:
                self.log(
                    f"[pool] {self.launcher.describe_pool(self.pool, self.handle)} {ended}; it was resubmitted "
                    f"{self.restarts} time(s) already: not again (the trainer stops when no sample comes)"
                )
                return
            self.restarts += 1
            self.log(
                f"[pool] {self.launcher.describe_pool(self.pool, self.handle)} {ended} while the trainer runs; "
                f"resubmitting it ({self.restarts}/{self.max_restarts}); its workers resume at the first missing sample"
            )
            try:
                self.launcher.cancel_pool(self.pool, self.handle, self.workdir)
                self._submit()
            except Exception as exc:
                self.log(f"[pool] resubmitting the {self.pool.name} pool failed ({type(exc).__name__}: {exc})")

    def __enter__(self) -> PoolRunner:
        self._submit()
        self._thread = threading.Thread(target=self._watch, name=f"{self.pool.name}-pool", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 130)  # a scheduler call in flight times out at 120 s
        with self._lock:
            handle = self.handle
        if handle is not None:
            try:
                self.launcher.cancel_pool(self.pool, handle, self.workdir)
                self.log(f"[pool] {self.launcher.describe_pool(self.pool, handle)} stopped with the trainer's launch")
            except Exception as exc:
                self.log(f"[pool] could not stop the {self.pool.name} pool ({type(exc).__name__}: {exc})")
        pool_record(self.workdir, self.pool.name).unlink(missing_ok=True)
