"""Cluster jobs outlive the process that follows them; only an explicit cancellation ends them.

A Slurm job or a PyTorchJob is not a child of the flow process: when the flow process dies
(SIGKILL, the OOM killer, a login node rebooting, `systemctl restart` of the serve process), the
job keeps training and its record (`launch/slurm-job.json`, `launch/kubernetes-job.json`) stays
in the stage folder. The next launch of the same stage re-attaches to it (the launchers' `reattach`)
instead of cancelling a healthy 24-node job and queueing a new one.

So a launcher that is interrupted while it follows a job must decide whether the interruption
means "stop the job" (`explicit_stop`):
- Ctrl-C (KeyboardInterrupt) and Prefect's own cancellation exceptions: yes;
- SIGTERM of the flow process (Prefect raises `TerminationSignal`): only when the run was
  cancelled in Prefect (a flow-run cancellation sends SIGTERM; so does a host shutting down):
  the step engine installs a probe that asks the Prefect API (`set_cancel_probe`);
- anything else (a failing poll, an error in the launcher itself): no; the job is left running
  and a retry re-attaches.

And since a cancelled flow's steps run in worker threads that never see the exception, the jobs
being followed are registered here (`following`): the step engine calls `cancel_followed()` when
the flow run is cancelled, which cancels each of them (their launchers then see them end
CANCELLED), and `detach_followed()` when the process ends otherwise (an unconfirmed SIGTERM, its
serve process gone), which ends each wait with `Detached` and leaves the jobs training, so the
process can exit and a retry re-attach. Local torchrun stages are children of the flow process and die with it as before
(infra/proc.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

_CANCELLATIONS = {"CancelledRun", "CancelledError"}  # prefect.exceptions, asyncio

_lock = threading.Lock()
_followed: set[Follow] = set()
_probe: list[Callable[[], bool]] = []


def set_cancel_probe(probe: Callable[[], bool] | None) -> None:
    """`probe()` answers whether the run this process executes was cancelled (None: no probe)."""
    with _lock:
        _probe[:] = [probe] if probe is not None else []


def cancel_requested() -> bool:
    """The probe's answer; False without one, or when it fails (no answer is not a cancellation)."""
    with _lock:
        probe = _probe[0] if _probe else None
    if probe is None:
        return False
    try:
        return bool(probe())
    except Exception:
        return False


def explicit_stop(exc: BaseException) -> bool:
    """Whether `exc`, interrupting the wait for a cluster job, means that the job must stop."""
    if isinstance(exc, KeyboardInterrupt) or type(exc).__name__ in _CANCELLATIONS:
        return True
    if isinstance(exc, Exception):
        return False  # the launcher's own trouble (a failing poll): the job is fine, leave it
    return cancel_requested()  # SIGTERM (TerminationSignal), SystemExit: ask who sent it


class Detached(Exception):
    """This process stopped following a cluster job it leaves running (it is shutting down)."""


@dataclass(eq=False)
class Follow:
    """One job being followed: its name, how to cancel it, and whether to stop following it."""

    what: str
    cancel: Callable[[], object]
    detached: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        """Called by the launcher between polls: raise `Detached` once asked to let go."""
        if self.detached.is_set():
            raise Detached(f"stopped following {self.what}, which keeps running (this process is shutting down)")


@contextmanager
def following(what: str, cancel: Callable[[], object]) -> Iterator[Follow]:
    """Register a job being followed (`what` names it) with the function that cancels it."""
    handle = Follow(what, cancel)
    with _lock:
        _followed.add(handle)
    try:
        yield handle
    finally:
        with _lock:
            _followed.discard(handle)


def cancel_followed() -> list[str]:
    """Cancel every job this process follows (the flow run was cancelled); returns their names."""
    with _lock:
        jobs = list(_followed)
    done = []
    for job in jobs:
        try:
            job.cancel()
            done.append(job.what)
        except Exception as exc:  # one failing cancel must not keep the others running
            done.append(f"{job.what} (cancel failed: {exc})")
    return done


def detach_followed() -> list[str]:
    """Stop following every job, leaving them running (the process ends without a cancellation:
    a SIGTERM that was not one, its serve process gone); returns their names. The launchers'
    waits end with `Detached`, so the process can exit; a retry re-attaches to the jobs."""
    with _lock:
        jobs = list(_followed)
    for job in jobs:
        job.detached.set()
    return [job.what for job in jobs]
