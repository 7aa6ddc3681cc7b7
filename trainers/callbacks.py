"""The training loop's callbacks: one concern each, called at fixed points (OLMo-core's
`train/callbacks/`), so the loop in trainers/pretrain.py stays short and each concern can be
built and tested alone.

Hooks (every rank calls every hook at the same point, so a hook may be collective):
- `pre_train(run)`: after the resume, before the first step of this launch;
- `pre_step(step)`: at the start of step `step` (1-based), before its data is read;
- `skip_update(step, loss, grad_norm)`: whether the step's optimizer update is withheld;
- `post_step(step, seconds)`: the step is done (its update applied or withheld);
- `metrics(step, fields, scalars)`: a metrics line (collective): add to the record (`fields`)
  and to what the tracker logs besides it (`scalars`);
- `log_metrics(step, record, scalars)`: rank 0, the finished record;
- `pre_checkpoint()`, `post_checkpoint(step)` around a save, `state_dict()` what a save keeps;
- `nonfinite(step, what, value, checkpoint)`: a non-finite value is about to stop the stage;
- `post_train()`: the launch ends, however (releases what the callback holds).

The callbacks: `WatchdogCallback` (hang watchdog and heartbeat, trainers/watchdog.py),
`SpeedMonitor` (stragglers and throughput drops), `SpikeSkip` (OLMo-core's skip-step rule),
`NonFiniteRollback` (planned data skips, and the record the pretrain step rolls back with),
`TrackerCallback` (TensorBoard, W&B or MLflow). Checkpointing is trainers/pretrain.py
`Checkpointing`. The rules they apply live in trainers/monitor.py.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.files import write_atomic
from model.spec import MonitorConfig, SpikeSkipConfig, TrackerConfig, TrainSpec
from model.token_shards import MixtureLoader
from trainers.monitor import (
    NONFINITE_FILE,
    REFERENCE_FILE,
    DataSkips,
    Events,
    SpeedChecks,
    SpikeRule,
    memory_scalars,
    rank_summary,
    run_delay,
)
from trainers.tracker import Tracker, open_tracker, run_name
from trainers.watchdog import Watchdog


@dataclass
class RunInfo:
    """What the callbacks learn of the launch at `pre_train`."""

    spec: TrainSpec
    rank: int
    world_size: int
    device: torch.device
    stage: str  # the plan's stage name
    seq_len: int
    tokens_per_step: int  # global_batch x seq_len
    loader: MixtureLoader
    start_step: int  # the step this launch starts after (0, or the resumed checkpoint's)
    resume_state: dict[str, Any] | None = None  # the resumed checkpoint's trainer state

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def out(self) -> Path:
        return Path(self.spec.out_dir)


class Callback:
    """A concern of the training loop; every hook does nothing unless overridden. One that sets
    `per_step_values` reads every step's loss and gradient norm (`skip_update`): the step then
    waits for the device (the loop otherwise reads them only at metrics lines and checkpoints)."""

    per_step_values = False

    def pre_train(self, run: RunInfo) -> None:
        pass

    def pre_step(self, step: int) -> None:
        pass

    def skip_update(self, step: int, loss: float, grad_norm: float) -> bool:
        return False

    def post_step(self, step: int, seconds: float) -> None:
        pass

    def metrics(self, step: int, fields: dict[str, Any], scalars: dict[str, Any]) -> None:
        pass

    def log_metrics(self, step: int, record: dict[str, Any], scalars: dict[str, Any]) -> None:
        pass

    def pre_checkpoint(self) -> None:
        pass

    def post_checkpoint(self, step: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def nonfinite(self, step: int, what: str, value: float, checkpoint: Any) -> None:
        pass

    def post_train(self) -> None:
        pass


class Callbacks:
    """The loop's callbacks in order; each hook calls them all, in that order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def pre_train(self, run: RunInfo) -> None:
        for cb in self.callbacks:
            cb.pre_train(run)

    def pre_step(self, step: int) -> None:
        for cb in self.callbacks:
            cb.pre_step(step)

    @property
    def per_step_values(self) -> bool:
        return any(cb.per_step_values for cb in self.callbacks)

    def skip_update(self, step: int, loss: float, grad_norm: float) -> bool:
        return any([cb.skip_update(step, loss, grad_norm) for cb in self.callbacks])  # every one is asked

    def post_step(self, step: int, seconds: float) -> None:
        for cb in self.callbacks:
            cb.post_step(step, seconds)

    def metrics(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: the fields the callbacks add to a metrics line, and their tracker scalars."""
        fields: dict[str, Any] = {}
        scalars: dict[str, Any] = {}
        for cb in self.callbacks:
            cb.metrics(step, fields, scalars)
        return fields, scalars

    def log_metrics(self, step: int, record: dict[str, Any], scalars: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.log_metrics(step, record, scalars)

    def pre_checkpoint(self) -> None:
        for cb in self.callbacks:
            cb.pre_checkpoint()

    def post_checkpoint(self, step: int) -> None:
        for cb in self.callbacks:
            cb.post_checkpoint(step)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for cb in self.callbacks:
            state |= cb.state_dict()
        return state

    def nonfinite(self, step: int, what: str, value: float, checkpoint: Any) -> None:
        for cb in self.callbacks:
            cb.nonfinite(step, what, value, checkpoint)

    def post_train(self) -> None:
        for cb in self.callbacks:
            cb.post_train()


class WatchdogCallback(Callback):
    """The rank's hang watchdog (trainers/watchdog.py; started before the build, so the startup
    bound covers it): every completed step resets it, a checkpoint save has its own bound."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def post_step(self, step: int, seconds: float) -> None:
        self.watchdog.completed(step, seconds)

    def pre_checkpoint(self) -> None:
        self.watchdog.begin_phase("checkpoint")

    def post_checkpoint(self, step: int) -> None:
        self.watchdog.end_phase()


class SpeedMonitor(Callback):
    """Stragglers and throughput drops (trainers/monitor.py `SpeedChecks`): each rank times the
    work it does without waiting for any other (`local()`: data loading on the host clock, the
    optimizer update with CUDA events on a GPU, so the step never waits for the device to time
    it), and the seconds its training thread waited for a CPU (`run_delay`: the machine's load,
    which the throughput rule allows for); every metrics line the ranks all-gather those seconds
    and rank 0 checks them. The line
    records their summary (`rank_local`: min, median, max, slowest rank and host) and the full
    per-rank list (`rank_local_s`) only while a rank is flagged as a straggler."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.checks: SpeedChecks | None = None  # rank 0's
        self.hosts = [socket.gethostname()]
        self._sums = torch.zeros(4, dtype=torch.float64)  # [local s, step s, steps, CPU wait s] since the last line
        self._waited = 0.0  # the training thread's CPU wait (run_delay) at the last line
        self._local = 0.0
        self._events: list[tuple[Any, Any]] = []  # CUDA (start, end) pairs since the last line
        self._line_start = 1

    def pre_train(self, run: RunInfo) -> None:
        self.run = run
        self._line_start = run.start_step + 1
        self._waited = run_delay()
        if run.world_size > 1:
            hosts: list[Any] = [None] * run.world_size
            dist.all_gather_object(hosts, socket.gethostname())
            self.hosts = [str(h) for h in hosts]
        if run.main:
            self.events = Events(run.out, run.stage, True)
            self.checks = SpeedChecks(self.config, self.hosts, run.tokens_per_step, self._reference())

    def _reference(self) -> dict | None:
        try:
            saved = json.loads((self.run.out / REFERENCE_FILE).read_text())
        except (OSError, ValueError):
            return None
        same = (
            saved.get("tokens_per_step") == self.run.tokens_per_step and saved.get("world_size") == self.run.world_size
        )
        return saved if same else None  # another batch or world size: measure anew

    def pre_step(self, step: int) -> None:
        self._local = 0.0

    @contextmanager
    def local(self, device: bool = False) -> Iterator[None]:
        """Work this rank does without waiting for any other (its straggler measure). `device`:
        work queued on the GPU (the optimizer update), timed by CUDA events read at the next
        metrics line instead of a synchronisation now; on CPU the host clock times both."""
        if device and getattr(self, "run", None) is not None and self.run.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
            return
        t0, waited = time.perf_counter(), run_delay()
        try:
            yield
        finally:
            # net of the time the thread waited for a CPU others held: a loaded machine preempts a
            # 2 ms section for 10-20 ms on any rank now and then (a CPU quota's throttling stays in)
            self._local += max(0.0, time.perf_counter() - t0 - (run_delay() - waited))

    def post_step(self, step: int, seconds: float) -> None:
        self._sums += torch.tensor([self._local, seconds, 1.0, 0.0], dtype=torch.float64)

    def _device_seconds(self) -> float:
        """The GPU time of the timed updates since the last line (waits for the last one only)."""
        if not self._events:
            return 0.0
        self._events[-1][1].synchronize()
        seconds = sum(start.elapsed_time(end) for start, end in self._events) / 1e3
        self._events.clear()
        return seconds

    def metrics(self, step: int, fields: dict[str, Any], scalars: dict[str, Any]) -> None:
        world = self.run.world_size
        self._sums[0] += self._device_seconds()
        waited, self._waited = self._waited, run_delay()  # the machine's load as this rank met it
        self._sums[3] = max(0.0, self._waited - waited)
        if world > 1:
            mine = self._sums.to(device=self.run.device, dtype=torch.float32)
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            table = torch.stack(gathered).cpu().double()  # one copy to the host, not one per rank
        else:
            table = self._sums.unsqueeze(0).clone()
        first, self._line_start = self._line_start, step + 1
        self._sums.zero_()
        if self.checks is None:
            return
        had_reference, flagged = self.checks.reference is not None, set(self.checks.slow)
        scalars |= self.checks.add(table, first, step, self.events)
        if not had_reference and self.checks.reference is not None:
            write_atomic(self.run.out / REFERENCE_FILE, json.dumps(self.checks.reference, indent=2))
        if world > 1:
            local = (table[:, 0] / table[:, 2].clamp(min=1)).tolist()
            fields["rank_local"] = rank_summary(local, self.hosts)
            if self.checks.slow or flagged != self.checks.slow:  # named, still named, or cleared now
                fields["rank_local_s"] = local


class SpikeSkip(Callback):
    """OLMo-core's skip-step rule (trainers/monitor.py `SpikeRule`; `config` None: off, no step is
    skipped). Its rolling history travels with checkpoints, so a resumed stage skips exactly what
    an uninterrupted one does; every metrics line counts the steps skipped."""

    def __init__(self, config: SpikeSkipConfig | None) -> None:
        self.rule = SpikeRule(config) if config else None
        self.events: Events | None = None
        self.per_step_values = self.rule is not None  # the rule judges every step's values

    @property
    def skipped(self) -> int:
        return self.rule.skipped if self.rule else 0

    def pre_train(self, run: RunInfo) -> None:
        self.events = Events(run.out, run.stage, run.main)
        if self.rule is not None and run.resume_state:  # a checkpoint's trainer state
            self.rule.load_state_dict(run.resume_state.get("monitor", {}).get("spikes", {}))

    def skip_update(self, step: int, loss: float, grad_norm: float) -> bool:
        """The same on every rank: loss and gradient norm are global."""
        if self.rule is None:
            return False
        why = self.rule.judge(loss, grad_norm)
        if why is not None and self.events is not None:
            self.events.emit("skipped_step", step, f"step {step} not applied: {why}", value=loss, grad_norm=grad_norm)
        return why is not None

    def metrics(self, step: int, fields: dict[str, Any], scalars: dict[str, Any]) -> None:
        fields["skipped_steps"] = self.skipped

    def state_dict(self) -> dict[str, Any]:
        return {"spikes": self.rule.state_dict()} if self.rule else {}


class NonFiniteRollback(Callback):
    """Recovery from a non-finite value, rank side: steps the loader over the data windows the
    pretrain step planned (`monitor/skip.json`), notes where each step's data began since the last
    checkpoint, and on a non-finite value writes `monitor/nonfinite.json`, what the pretrain step
    needs to roll back to that checkpoint and plan the window to skip."""

    def pre_train(self, run: RunInfo) -> None:
        self.run = run
        self.events = Events(run.out, run.stage, run.main)
        self.skips = DataSkips(run.out)
        self._ckpt_step, self._ckpt_sequence = run.start_step, run.loader.sequence
        self._step_sequences: dict[int, int] = {}

    def pre_step(self, step: int) -> None:
        loader = self.run.loader
        for window in self.skips.apply(loader):
            if self.run.main:
                self.events.emit(
                    "data_skipped",
                    step,
                    f"skipped {window['to'] - window['from']} sequences of data (global sequences "
                    f"{window['from']}..{window['to']}) that led to a non-finite {window.get('what') or 'value'} "
                    f"at step {window['failed_step']}",
                    value=float((window["to"] - window["from"]) * self.run.seq_len),
                    window=window,
                )
        self._step_sequences[step] = loader.sequence

    def post_checkpoint(self, step: int) -> None:
        """A non-finite value from now on rolls back to this checkpoint."""
        self._ckpt_step, self._ckpt_sequence = step, self.run.loader.sequence
        self._step_sequences = {}

    def nonfinite(self, step: int, what: str, value: float, checkpoint: Any) -> None:
        if not self.run.main:
            return
        record = {
            "stage": self.run.stage,
            "step": step,
            "what": what,
            "value": str(value),
            "checkpoint": str(checkpoint) if checkpoint is not None else None,
            "checkpoint_step": self._ckpt_step,
            # where the data trained after that checkpoint began (past the windows skipped already)
            "checkpoint_sequence": min(self._step_sequences.values(), default=self._ckpt_sequence),
            "step_sequences": self._step_sequences,
            # the end of the failing step's data (it may be noticed a few steps later, at a
            # metrics line: the loop reads the values only there)
            "sequence_after": self._step_sequences.get(step + 1, self.run.loader.sequence),
            "seq_len": self.run.seq_len,
            "time": time.time(),
        }
        write_atomic(self.run.out / NONFINITE_FILE, json.dumps(record, indent=2))
        self.events.emit(
            "nonfinite", step, f"{what} is {value} at step {step}", level=logging.ERROR, value=None, what=what
        )


class TrackerCallback(Callback):
    """Rank 0's metrics lines to TensorBoard, W&B or MLflow (trainers/tracker.py) as it trains,
    with the other callbacks' scalars and memory."""

    def __init__(self, config: TrackerConfig) -> None:
        self.config = config
        self.tracker: Tracker | None = None

    def pre_train(self, run: RunInfo) -> None:
        self.device = run.device
        if not run.main:
            return
        settings = {"stage": run.stage, "world_size": run.world_size, **run.spec.to_dict()}
        # the run's global step and tokens (TrainSpec.run_first_step / run_first_token)
        self.first_step, self.first_token = run.spec.run_first_step, run.spec.run_first_token
        self.tokens_per_step = run.tokens_per_step
        self.tracker = open_tracker(
            self.config,
            run.spec.tracker_path,
            run_name(run.out, run.stage),
            resume_step=self.first_step + run.start_step if run.start_step else None,
            settings={k: v for k, v in settings.items() if not isinstance(v, dict | list)},
        )

    def log_metrics(self, step: int, record: dict[str, Any], scalars: dict[str, Any]) -> None:
        if self.tracker is not None:
            tokens = self.first_token + step * self.tokens_per_step
            progress = {"progress/tokens_seen": tokens, "progress/stage_step": step}
            self.tracker.log(
                self.first_step + step,
                self._scalars(record) | scalars | memory_scalars(self.device) | progress,
                tokens=tokens,
            )

    @staticmethod
    def _scalars(record: dict[str, Any]) -> dict[str, Any]:
        return {
            "train/loss": record.get("loss"),
            "train/lr": record.get("lr"),
            "train/grad_norm": record.get("grad_norm"),
            "train/skipped_steps": record.get("skipped_steps"),
            "perf/tokens_per_s": record.get("tokens_per_s"),
            "perf/mfu": record.get("mfu"),
        }

    def post_train(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
