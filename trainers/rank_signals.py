"""A signal is a checkpoint: SIGUSR1/SIGTERM ask every rank to finish its step, save and exit.

Clusters warn before they take nodes away: Slurm sends SIGUSR1 shortly before the time limit
(`--signal`, forwarded to the ranks by the sbatch script) and SIGTERM at preemption (GraceTime
before SIGKILL); Kubernetes sends SIGTERM on pod eviction (`terminationGracePeriodSeconds` before
SIGKILL); torchrun forwards what it receives (`--signals-to-handle`) and waits
`--shutdown-timeout` seconds for the ranks before it kills them. Without a handler a rank dies at
once and a requeue redoes every step since the last periodic checkpoint (up to
`checkpoint_interval` steps: about 15 minutes of the whole cluster for the 3B recipe).

`StopSignals` turns those signals into a flag (the handler does nothing else: no I/O in a signal
handler, no collective). The training loop asks `requested()` after each optimizer step: one
all-reduce of the flag (MAX), so every rank agrees on the same step even when the signal reached
only some of them, or reached them during different steps. Then the loop saves a checkpoint (with
its digests, model/checkpoint.py) at that step and the trainer exits with `EXIT_STOPPED` (75,
EX_TEMPFAIL: "try again"), which the launchers report as "stopped on a signal after saving a
checkpoint" and the step engine counts as transient: the requeue, the pod restart or the retry
resumes at that very step.

SIGTERM from the parent-death signal (torchrun died: `infra.guard.protect_rank`) still ends the
rank at once: with no torchrun there is nobody to coordinate a save with.

A signal that arrives before the handler is installed (while torch is being imported) still
ends the rank with the signal's default action; nothing was trained yet, so nothing is lost.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on a signal with a checkpoint of the step it stopped at
EXIT_TRANSIENT = 6  # failed on S3 or the network (a rank's checkpoint pull): a retry runs again
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequested(Exception):
    """Raised by a trainer once it has saved the checkpoint a signal asked for: exit `EXIT_STOPPED`."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(
            f"stopped on {signal_name} after step {step}: checkpoint {checkpoint} saved with its digests; "
            f"a restart resumes at step {step}"
        )


class TransientFailure(RuntimeError):
    """A rank's work failed on something outside its code and data (S3 throttling, a lost
    connection: pipeline/step.py `transient`): the trainer exits `EXIT_TRANSIENT`, which the
    launcher reports as such (infra/launchers/base.py), so the step's retry runs it again."""


def pull_checkpoint(mirror, local_dir, record, log) -> None:
    """A cluster launch's main rank: `infra.storage.pull_for_resume`, with a failure on S3 or the
    network (infra/transient.py) raised as `TransientFailure`, so the rank exits `EXIT_TRANSIENT`
    and the step's retry pulls again; any other failure (a damaged checkpoint) as it is."""
    from infra.storage import pull_for_resume
    from infra.transient import transient

    try:
        pull_for_resume(mirror, local_dir, record=record, log=log)
    except Exception as exc:
        if transient(exc):
            raise TransientFailure(f"checkpoint pull from {mirror.uri} failed: {type(exc).__name__}: {exc}") from exc
        raise


class StopSignals:
    """Remembers the first stop signal this process received; `requested()` asks every rank.

    Install once per process from the main thread (Python delivers signals there); `restore()`
    puts the previous handlers back (tests, and trainers called in-process).
    """

    def __init__(self, signals: Iterable[signal.Signals] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: str | None = None  # name of the first stop signal, e.g. "SIGUSR1"
        self.received_at: float | None = None  # time.monotonic() when it arrived
        self._previous: dict[int, object] = {}
        self._parent = os.getppid()

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal works in the main thread only; a caller elsewhere keeps the defaults
        self._parent = os.getppid()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and os.getppid() != self._parent:
            # torchrun is gone (infra/guard.py protect_rank: its parent-death signal is SIGTERM):
            # nobody coordinates the ranks any more, so end now, as without this handler.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum).name, time.monotonic()

    def requested(self, device=None) -> bool:
        """Collective under a process group (every rank calls it at the same point): whether any
        rank received a stop signal. A rank that did not adopts the signal another one got."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received is not None
        number = int(signal.Signals[self.received]) if self.received else 0
        flag = torch.tensor([number], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the highest signal number any rank got
        got = int(flag.item())
        if got and self.received is None:
            self.received = signal.Signals(got).name
        return got > 0


def trainer_callback(stop: StopSignals):
    """A transformers TrainerCallback for the TRL trainers (trainers/posttrain): after each
    optimizer step every rank asks `stop.requested()`; on a stop signal it asks the Trainer to
    save a checkpoint of that step (published with its digests by the post-training checkpoint
    callback) and to end training. `stopped_at` is then the step saved: the caller raises
    `StopRequested` instead of finishing the stage. A signal at the last step changes nothing."""
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        stopped_at: int | None = None

        def on_step_end(self, args, state, control, **kwargs):
            nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
            if stop.requested(device) and state.global_step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step
            return control

    return StopOnSignal()
