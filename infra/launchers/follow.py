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
  the step engine installs a probe that asks the Prefect API (infra/stop_hooks.py
  `set_cancel_probe`);
- anything else (a failing poll, an error in the launcher itself): no; the job is left running
  and a retry re-attaches.

And since a cancelled flow's steps run in worker threads that never see the exception, a job
being followed registers a stop hook for as long as it is followed (`following`, through
infra/stop_hooks.py `on_stop`): when the flow run is cancelled the step engine calls
`stop("cancel")`, which cancels each job (their launchers then see them end CANCELLED), and when
the process ends otherwise (an unconfirmed SIGTERM, its serve process gone) `stop("detach")`,
which ends each wait with `Detached` and leaves the jobs training, so the process can exit and a
retry re-attach. The step engine knows nothing of launchers: it only calls the hooks. Local
torchrun stages are children of the flow process and die with it as before (infra/proc.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from infra.stop_hooks import StopKind, cancel_requested, on_stop

_CANCELLATIONS = {"CancelledRun", "CancelledError"}  # prefect.exceptions, asyncio


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

    def stop(self, kind: StopKind) -> None:
        """The run stops (infra/stop_hooks.py): cancel the job, or let go of it."""
        if kind == "cancel":
            self.cancel()
        else:
            self.detached.set()


@contextmanager
def following(what: str, cancel: Callable[[], object]) -> Iterator[Follow]:
    """Follow a job (`what` names it) that `cancel()` cancels, for as long as the block runs."""
    handle = Follow(what, cancel)
    with on_stop(what, handle.stop):
        yield handle
