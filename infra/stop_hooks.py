"""Stop hooks: how a run's stop reaches work this process follows but does not own.

Some work outlives the process that waits for it: a Slurm job or a PyTorchJob keeps training when
the flow process dies, and a retry re-attaches to it (infra/launchers/follow.py). When a run
stops, such work must be told how:
- `cancel`: the run was cancelled on purpose (Ctrl-C, a cancellation the orchestrator confirms):
  stop the work;
- `detach`: the process ends for another reason (a SIGTERM nobody confirmed as a cancellation, its
  serve process died): leave the work running and stop waiting for it, so the process can exit.

Whoever follows such work registers a hook for as long as it follows it (`on_stop`); whoever runs
the run (pipeline/runner.py) calls `stop(kind)`, and installs the probe that says whether the run
was cancelled (`set_cancel_probe`), which a follower asks when an interruption reaches it
(`cancel_requested`). Neither knows the other. Children of this process are not followed work:
infra/proc.py kills them (`stop_all`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

StopKind = Literal["cancel", "detach"]

_lock = threading.Lock()
_hooks: dict[object, tuple[str, Callable[[StopKind], object]]] = {}
_probe: list[Callable[[], bool]] = []


@contextmanager
def on_stop(what: str, hook: Callable[[StopKind], object]) -> Iterator[None]:
    """While in the block, `stop(kind)` calls `hook(kind)`; `what` names the work in its report."""
    key = object()
    with _lock:
        _hooks[key] = (what, hook)
    try:
        yield
    finally:
        with _lock:
            _hooks.pop(key, None)


def stop(kind: StopKind) -> list[str]:
    """Call every registered hook with `kind`; returns what they name, a failing hook with its
    error (one failing cancel must not keep the others running)."""
    with _lock:
        hooks = list(_hooks.values())
    done = []
    for what, hook in hooks:
        try:
            hook(kind)
            done.append(what)
        except Exception as exc:
            done.append(f"{what} ({kind} failed: {exc})")
    return done


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
