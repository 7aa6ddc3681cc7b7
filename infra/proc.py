"""Long-running children (torchrun, datatrove on a cluster) that never outlive their task.

`run_streaming` starts the command in its own session (a new process group, so the child and what
it forks can be signalled together; torchrun puts each rank in a session of its own, so the ranks
are also tracked and killed by pid), streams its merged output line by line to a logger callback (the
Prefect run logger in tasks), and kills the whole group when the caller fails, is interrupted, or is
cancelled. Prefect cancels a flow run by sending SIGTERM to the flow-run process, which Prefect turns
into a `TerminationSignal` exception: it unwinds through the wait loop here and the group is killed.
If the flow process instead exits while a child runs in another thread, an `atexit` hook kills every
group still registered. A child's own failure raises `ChildFailed` with the tail of its output.

None of that runs when the owner dies abruptly (SIGKILL, the OOM killer, `systemctl stop` killing
the serve process and the flow process together): the child is therefore started under a guard
(`infra/guard.py`) that kills its whole tree, ranks in their own sessions included, within a
second of the owner's death (parent-death signal plus a watchdog on the owner's pid and start
time).
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from infra.guard import ProcessRef, guard_command

_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()


class ChildFailed(RuntimeError):
    """A child process exited non-zero; the message carries its last output lines."""

    def __init__(self, cmd: Sequence[str], returncode: int, tail: Sequence[str]):
        self.cmd, self.returncode, self.tail = list(cmd), returncode, list(tail)
        shown = "\n".join(tail)
        super().__init__(f"command {' '.join(cmd)!r} exited with code {returncode}; last output:\n{shown}")


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL whatever is left after `grace` seconds.

    torchrun starts every rank in a session of its own, so the child's group does not hold the
    ranks: every descendant alive at the start is remembered and killed by pid at the end.
    """
    descendants = _descendants(proc.pid)
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid) and not _any_alive(descendants):
                return
            time.sleep(0.05)
    kill_tree(proc.pid, descendants)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def kill_tree(pid: int, known: list | None = None) -> None:
    """SIGKILL a process's group and every descendant (also those in sessions of their own)."""
    procs = _descendants(pid) + list(known or [])
    _signal_group(pid, signal.SIGKILL)
    for p in procs:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _any_alive(procs: list) -> bool:
    return any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs if _exists(p))


def _exists(p) -> bool:
    try:
        return p.is_running()
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def stop_all(grace: float = 2.0) -> list[str]:
    """Kill every child `run_streaming` is running in this process (from any thread), each with
    its whole tree; returns their commands. Their callers see them fail (`ChildFailed`). Runs at
    exit too, for children started from threads that never got to clean up."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        kill_group(proc, grace=grace)
    return [_shown(proc.args) for proc in procs]


def _shown(argv) -> str:
    """A child's command as started, without the guard in front of it."""
    argv = [str(a) for a in argv]
    if "guard" in argv and "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    return " ".join(argv)[:300]


def _feed(proc: subprocess.Popen, text: str) -> None:
    """Write a child's stdin and close it (a child that exits before reading it all is its own failure)."""
    try:
        assert proc.stdin is not None
        proc.stdin.write(text)
        proc.stdin.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


def run_streaming(
    cmd: Sequence[str],
    log: Callable[[str], None] = print,
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    tail_lines: int = 40,
    grace: float = 10.0,
    on_start: Callable[[int], object] | None = None,
    guarded: bool = True,
    stdin_text: str | None = None,
) -> int:
    """Run `cmd` to completion, streaming its output to `log`; returns 0 or raises.

    `stdin_text`, when given, is the child's whole stdin (written from a thread, then closed): a
    channel only this process writes, for what the child must read exactly as it was sent.

    `env` entries are added to the current environment. On any exception in the caller's thread
    (including Prefect's cancellation and KeyboardInterrupt), the child's group is killed first.
    `on_start(pid)` receives the child's pid, which is also its process-group id. With `guarded`
    (the default) the child is the guard of `infra/guard.py`, which runs `cmd` and takes its
    tree down if this process dies without cleaning up.
    """
    full_env = {**os.environ, **(env or {})}
    argv = guard_command(ProcessRef.current(), cmd) if guarded else list(cmd)
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=full_env,
        stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
    )
    with _live_lock:
        _live.add(proc)
    if stdin_text is not None:
        threading.Thread(target=_feed, args=(proc, stdin_text), daemon=True).start()
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    try:
        if on_start is not None:
            on_start(proc.pid)
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log(line)
        returncode = proc.wait()
    except BaseException:
        kill_group(proc, grace)
        raise
    finally:
        with _live_lock:
            _live.discard(proc)
    # Ranks that outlived a finished leader are cleaned up too.
    if _group_alive(proc.pid):
        kill_tree(proc.pid)
    if returncode != 0:
        raise ChildFailed(cmd, returncode, tail)
    return returncode
