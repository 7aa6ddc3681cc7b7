"""Processes that die with their owner, and a lease so one trainer at a time owns a stage folder.

Standard library only: the trainer imports it at startup (`trainers/pretrain.py`), before torch.

Why both a parent-death signal and a watchdog:
- `prctl(PR_SET_PDEATHSIG)` is delivered when the *thread* that forked us exits, not the process,
  and it is not delivered at all when the parent died before the call (checked right after arming)
  or when we were reparented some other way. The flow runs steps in worker threads; a thread that
  forks a child and then returns would kill it.
- the watchdog polls the owner's pid *and* kernel start time (pids are recycled), so a child notices
  its owner's death within about a second whatever happened to the thread that started it.

Three layers keep a training stage from outliving the flow process that launched it
(`infra/proc.py:run_streaming` starts every long child through the guard):

    flow process --(guard: pdeathsig + watchdog on the flow process, child subreaper)--> torchrun
        torchrun --(each rank: pdeathsig + watchdog on torchrun, see `protect_rank`)--> rank i

(a one-rank local launch has no torchrun: the guard's child is the rank, which watches the guard;
infra/launchers/local.py)

`python -I infra/guard.py guard --owner PID:START -- CMD...` runs CMD and kills CMD's whole tree
(also the ranks torchrun puts in sessions of their own, which become the guard's children when
torchrun dies because the guard is a child subreaper) when the owner dies or the guard is signalled.
The ranks protect themselves too, for the case where torchrun dies without the guard (SIGKILL of
the whole process group by an OOM killer or `systemctl stop`).

`StageLease` is a lease file in a stage folder (`.lease.json`: host, boot id, pid, process start
time, renewal time) that rank 0 holds while it trains and renews in a background thread. A second
trainer refuses to start in the folder while the holder is alive (same host: its pid and start time
match; another host: renewed within the TTL) and takes over a lease whose holder is dead or stale.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
WATCH_INTERVAL_S = 0.5  # how often a watchdog looks at its owner
KILL_GRACE_S = 5.0  # SIGTERM, then this long, then SIGKILL
# The guard's line when its command died of a signal on its own (not stopped by the guard): the
# guard then dies of the same signal, so its owner could not otherwise tell the command's death
# from the guard's (infra/launchers/local.py names the rank of a one-process launch from it).
COMMAND_KILLED = "command killed by"


# --- process identity ---------------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    """The kernel start time of `pid` (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):  # exited, waiting to be reaped: dead for our purposes
        return None
    return int(fields[19])


def boot_id() -> str:
    """Changes at every boot: a pid and start time from before a reboot name nothing now."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class ProcessRef:
    """A process named so that a recycled pid does not pass for it: host, boot, pid, start time."""

    pid: int
    start: int | None
    host: str
    boot: str

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, start_time(pid), socket.gethostname(), boot_id())

    @classmethod
    def current(cls) -> ProcessRef:
        return cls.of(os.getpid())

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname() and self.boot == boot_id()

    def alive(self) -> bool | None:
        """True or False on this host (pid and start time match); None when it runs elsewhere."""
        if not self.on_this_host():
            return None
        return self.start is not None and start_time(self.pid) == self.start

    def encode(self) -> str:
        return f"{self.pid}:{self.start}"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


# --- parent-death signal and watchdog -----------------------------------------------------------


def _libc_prctl():
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _prctl(option: int, arg: int) -> bool:
    prctl = _libc_prctl()
    return prctl is not None and prctl(option, arg, 0, 0, 0) == 0


def arm_parent_death(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when the thread that forked it exits.

    False where unsupported (not Linux). Callers must still check that the parent is the expected
    one right after arming: a parent that died earlier triggers nothing.
    """
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Orphaned descendants are reparented to this process instead of init, so it can kill them."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def watch(
    owner: ProcessRef, on_gone: Callable[[], object], interval: float = WATCH_INTERVAL_S, name: str = "owner-watchdog"
) -> threading.Thread:
    """Call `on_gone()` once, from a daemon thread, when `owner` (on this host) has died."""

    def loop() -> None:
        while owner.alive() is not False:
            time.sleep(interval)
        on_gone()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def _say(message: str) -> None:
    """A note on stderr; never raises: when the owner died, stderr is often a pipe nobody reads."""
    try:
        print(f"[lifeline] {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _die_with_grace(reason: str, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM ourselves (the default action ends the process), SIGKILL if that was caught."""
    _say(f"{reason}; exiting")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os.kill(os.getpid(), signal.SIGKILL)


def protect_rank() -> bool:
    """Under torchrun (or a one-rank local launch, which has torchrun's environment and the guard
    for a parent): end this rank when its parent dies. Returns True when armed.

    torchrun starts each rank in a session of its own, so nothing that kills torchrun's process
    group reaches the ranks; without this a SIGKILLed torchrun leaves its ranks training with
    parent pid 1. Outside torchrun (a plain `python -m trainers.pretrain`) nothing is armed.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return False
    parent = ProcessRef.of(os.getppid())
    arm_parent_death(signal.SIGTERM)
    # the parent: torchrun, or the guard of a one-rank local launch (infra/launchers/local.py)
    if os.getppid() != parent.pid or parent.start is None:  # it died before we armed
        _die_with_grace(f"parent {parent.pid} (torchrun or the launch's guard) is gone at startup")
    watch(
        parent,
        lambda: _die_with_grace(f"parent {parent.pid} (torchrun or the launch's guard) died"),
        name="torchrun-watchdog",
    )
    return True


# --- process trees (from /proc, no psutil: the guard must start fast) ---------------------------


def descendants(pid: int) -> list[int]:
    """Pids of every live process below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap() -> None:
    """Collect exited children (as a subreaper we inherit orphans and must wait for them)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants(grace: float = KILL_GRACE_S) -> None:
    """SIGTERM every descendant of this process, SIGKILL the ones still there after `grace`."""
    known = set(descendants(os.getpid()))
    _signal_all(sorted(known), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap()
        known |= set(descendants(os.getpid()))
        if not any(start_time(p) is not None for p in known):
            return
        time.sleep(0.05)
    _signal_all(sorted(known | set(descendants(os.getpid()))), signal.SIGKILL)
    time.sleep(0.05)
    _reap()


# --- the guard ----------------------------------------------------------------------------------


def guard_command(owner: ProcessRef, cmd: Sequence[str]) -> list[str]:
    """The argv that runs `cmd` under a guard watching `owner`.

    The guard runs this file as a script in isolated mode (`-I`: no PYTHONPATH, no user site, not
    its folder on sys.path): it needs the standard library only, so it works from any working
    directory and whatever checkout `cmd` imports its code from.
    """
    return [sys.executable, "-I", str(Path(__file__).resolve()), "guard", "--owner", owner.encode(), "--", *cmd]


def guard(owner_pid: int, owner_start: int | None, cmd: Sequence[str]) -> int:
    """Run `cmd` until it exits, or kill its whole tree when the owner dies or we are signalled.

    Returns the exit status to exit with; a command killed by a signal is reported by re-raising
    that signal on the guard, so the owner sees the same status it would without the guard.
    """
    owner = ProcessRef(owner_pid, owner_start, socket.gethostname(), boot_id())
    arm_parent_death(signal.SIGTERM)
    become_subreaper()
    if owner.alive() is False or os.getppid() != owner_pid:
        _say(f"owner {owner_pid} is gone before {cmd[0]} started")
        return 125
    # `why` non-empty is the stop request. A signal handler takes no lock: a `threading.Event`
    # set from the handler deadlocked the guard when a second signal (the group's SIGTERM while it
    # was stopping) arrived inside the first handler's `Event.set`, and the frozen build it was
    # ending stayed stopped (tests/flows/test_orchestrator_death.py, a full run at load ~5).
    why: list[str] = []

    def on_signal(signum: int, _frame) -> None:
        why.append(f"received {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # The command gets a parent-death signal too, for when the guard itself is SIGKILLed (the OOM
    # killer picks it, or a kill of the whole group). Set between fork and exec; safe because no
    # other thread runs yet in the guard. A guard killed after the fork but before the child armed
    # it sends nothing: the child, whose parent is then another process, exits instead of running
    # the command as an orphan (a fresh clone's full run of efefca7: `sleep` outlived its guard).
    prctl = _libc_prctl()
    guard_pid = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != guard_pid:
            os._exit(128 + signal.SIGTERM)

    child = subprocess.Popen(  # same stdout/stderr (the owner's pipe), same process group
        list(cmd), preexec_fn=arm if prctl else None
    )
    watch(owner, lambda: why.append(f"owner {owner_pid} died"))
    while child.poll() is None and not why:
        time.sleep(0.1)
    if child.poll() is None:
        _say(f"{why[0] if why else 'stopping'}: stopping {cmd[0]} and everything it started")
        kill_descendants()
        child.wait()
        return 128 + signal.SIGTERM
    # The command ended; ranks it left behind were reparented to us (subreaper): end them too.
    if descendants(os.getpid()):
        kill_descendants(grace=2.0)
    code = child.returncode
    if code < 0:  # died of a signal: say so (the owner sees only our status), then die of the same one
        _say(f"{COMMAND_KILLED} {signal.Signals(-code).name} (pid {child.pid})")
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code


# --- the stage lease ----------------------------------------------------------------------------


LEASE_FILE = ".lease.json"
LEASE_TTL_S = 120.0  # a holder on another host that has not renewed for this long is stale
LEASE_RENEW_S = 15.0


class LeaseHeld(RuntimeError):
    """Another live trainer holds the stage folder; the message names it and what to do."""


@dataclass(frozen=True)
class Lease:
    """The content of a stage folder's lease file."""

    holder: ProcessRef
    acquired: float
    renewed: float
    ttl_s: float

    def to_json(self) -> str:
        return json.dumps(
            {"holder": asdict(self.holder), "acquired": self.acquired, "renewed": self.renewed, "ttl_s": self.ttl_s},
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Lease:
        raw = json.loads(text)
        return cls(ProcessRef(**raw["holder"]), float(raw["acquired"]), float(raw["renewed"]), float(raw["ttl_s"]))

    def live(self, now: float | None = None) -> bool:
        """Same host: the holder process still runs. Elsewhere: renewed within the TTL."""
        alive = self.holder.alive()
        if alive is not None:
            return alive
        return (now or time.time()) - self.renewed < self.ttl_s


class StageLease:
    """Exclusive ownership of a stage folder by one trainer process (rank 0 holds it).

        lease = StageLease(out_dir).acquire()     # raises LeaseHeld while another trainer lives
        ...train...                               # renewed every renew_s in a daemon thread
        lease.release()

    Acquisition is serialised by an flock on `.lease.lock` (local and most shared filesystems);
    the lease file itself is written atomically (temp file + rename).
    """

    def __init__(
        self,
        folder: str | Path,
        ttl_s: float = LEASE_TTL_S,
        renew_s: float = LEASE_RENEW_S,
        on_lost: Callable[[str], object] | None = None,
    ):
        self.folder = Path(folder)
        self.path = self.folder / LEASE_FILE
        self.ttl_s, self.renew_s = ttl_s, renew_s
        self.me = ProcessRef.current()
        self.on_lost = on_lost or (lambda why: _die_with_grace(why))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: Lease | None = None  # the dead or stale lease replaced, if any

    def read(self) -> Lease | None:
        try:
            return Lease.from_json(self.path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, or cut short by a crash mid-write: nobody holds it

    def _write(self, lease: Lease) -> None:
        from infra.files import write_atomic  # here, not at the top: `python -I infra/guard.py` has no `infra`

        write_atomic(self.path, lease.to_json())

    def acquire(self) -> StageLease:
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lease.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            current = self.read()
            if current is not None and current.holder != self.me and current.live():
                age = time.time() - current.renewed
                raise LeaseHeld(
                    f"stage folder {self.folder} is in use by another trainer "
                    f"({current.holder.describe()}, lease renewed {age:.0f}s ago, TTL "
                    f"{current.ttl_s:.0f}s): two trainers in one folder corrupt its checkpoints and "
                    "metrics. Wait for it to finish, or stop it (kill that process, or cancel its "
                    f"job); a lease whose holder is dead is taken over automatically"
                )
            if current is not None and current.holder != self.me:
                self.took_over = current
                log.warning(
                    "taking over the lease of %s from %s (%s)",
                    self.folder,
                    current.holder.describe(),
                    "process gone"
                    if current.holder.alive() is False
                    else f"not renewed for {time.time() - current.renewed:.0f}s",
                )
            now = time.time()
            self._write(Lease(self.me, now, now, self.ttl_s))
        self._thread = threading.Thread(target=self._renew, name="stage-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        import fcntl

        while not self._stop.wait(self.renew_s):
            # Read and rewrite under the lock acquirers hold: a takeover between the two would
            # otherwise be overwritten by this renewal, and neither trainer would know.
            with open(self.folder / ".lease.lock", "a+") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                current = self.read()
                ours = current is not None and current.holder == self.me
                if ours:
                    self._write(Lease(self.me, current.acquired, time.time(), self.ttl_s))
            if not ours:
                who = current.holder.describe() if current else "nobody (lease file removed)"
                self.on_lost(
                    f"lost the lease of {self.folder} to {who}; stopping so that only one trainer writes there"
                )
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        current = self.read()
        if current is not None and current.holder == self.me:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> StageLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 4 and argv[0] == "guard" and argv[1] == "--owner" and "--" in argv:
        pid, _, start = argv[2].partition(":")
        cmd = argv[argv.index("--") + 1 :]
        if cmd:
            return guard(int(pid), None if start in ("", "None") else int(start), cmd)
    print("usage: python -I infra/guard.py guard --owner PID:START -- CMD [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
