"""infra/guard.py: process identity, the stage lease (live, dead, stale holders), and renewal.

The guard and `protect_rank` are exercised with real processes in tests/infra/test_proc.py
(SIGKILLed owners) and tests/trainers/test_pretrain.py (a SIGKILLed torchrun).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from infra.guard import (
    LEASE_FILE,
    Lease,
    LeaseHeld,
    ProcessRef,
    StageLease,
    descendants,
    start_time,
)


def _write_lease(folder, holder: ProcessRef, renewed_ago: float, ttl: float = 120.0) -> None:
    now = time.time()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LEASE_FILE).write_text(Lease(holder, now - 3600, now - renewed_ago, ttl).to_json())


def test_a_process_ref_tells_a_recycled_pid_from_its_process():
    me = ProcessRef.current()
    assert me.alive() is True and start_time(me.pid) == me.start
    assert ProcessRef(me.pid, me.start + 1, me.host, me.boot).alive() is False  # pid reused
    assert ProcessRef(me.pid, me.start, "elsewhere", me.boot).alive() is None  # cannot tell


def test_descendants_lists_children_and_grandchildren():
    proc = subprocess.Popen(["bash", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(descendants(proc.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        mine = descendants(ProcessRef.current().pid)
        assert proc.pid in mine and set(descendants(proc.pid)) <= set(mine)
        assert len(descendants(proc.pid)) == 1
    finally:
        for pid in descendants(proc.pid):
            subprocess.run(["kill", "-9", str(pid)])
        proc.kill()
        proc.wait()


def test_a_live_holder_on_this_host_refuses_a_second_trainer(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lease(tmp_path, ProcessRef.of(holder.pid), renewed_ago=3600)  # old but alive
        with pytest.raises(LeaseHeld, match=rf"pid {holder.pid} on .*Wait for it to finish"):
            StageLease(tmp_path).acquire()
        assert Lease.from_json((tmp_path / LEASE_FILE).read_text()).holder.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    lease = StageLease(tmp_path).acquire()  # the holder died: taken over
    try:
        assert lease.took_over is not None and lease.took_over.holder.pid == holder.pid
        assert lease.read().holder == ProcessRef.current()
    finally:
        lease.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_a_holder_on_another_host_is_live_until_its_ttl_passes(tmp_path):
    other = ProcessRef(4242, 1, "node-17", "another-boot")
    _write_lease(tmp_path, other, renewed_ago=5, ttl=120)
    with pytest.raises(LeaseHeld, match="pid 4242 on node-17"):
        StageLease(tmp_path).acquire()
    _write_lease(tmp_path, other, renewed_ago=121, ttl=120)  # stale: not renewed within the TTL
    with StageLease(tmp_path) as lease:
        assert lease.took_over.holder == other


def test_a_lease_cut_short_by_a_crash_holds_nothing(tmp_path):
    (tmp_path / LEASE_FILE).write_text('{"holder": {"pid": 1')
    with StageLease(tmp_path) as lease:
        assert lease.took_over is None


def test_the_holder_renews_and_notices_a_takeover(tmp_path):
    lost = threading.Event()
    reasons: list[str] = []
    lease = StageLease(tmp_path, renew_s=0.05, on_lost=lambda why: (reasons.append(why), lost.set())).acquire()
    try:
        first = lease.read().renewed
        deadline = time.monotonic() + 30  # a renewal every 0.05 s; a loaded machine may delay a few
        while lease.read().renewed <= first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.read().renewed > first
        thief = ProcessRef(4242, 1, "node-17", "another-boot")
        # written whole (a new file renamed over it) under the lock, as an acquirer writes: a
        # half-written file would read as no lease at all, and without the lock a renewal that
        # read the file just before would write over the takeover
        planted = tmp_path / "planted.tmp"
        planted.write_text(json.dumps(json.loads(Lease(thief, 0, time.time(), 120).to_json())))
        with open(tmp_path / ".lease.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            os.replace(planted, tmp_path / LEASE_FILE)
        assert lost.wait(30) and "node-17" in reasons[0]  # noticed at its next renewal (0.05 s)
    finally:
        lease.release()
    assert (tmp_path / LEASE_FILE).exists()  # not ours any more: left for its holder


def test_a_storm_of_signals_still_ends_the_guard_and_its_command():
    """SIGTERM after SIGTERM to the guard of a frozen command from outside, as a process group's
    kill delivers them while it is stopping: the guard ends its command and exits. A handler that took a lock
    (`threading.Event.set`) deadlocked when a signal arrived inside the handler of the one before,
    leaving the command it was ending stopped (seen in a full run at load ~5)."""
    import psutil

    from infra.guard import guard_command

    cmd = guard_command(ProcessRef.current(), [sys.executable, "-c", "import time; time.sleep(120)"])
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 20
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = psutil.Process(proc.pid).children()
    os.kill(child.pid, 19)  # a frozen command (SIGSTOP), as in a frozen build: ending it takes longer
    for _ in range(5):  # bursts, each a few hundred signals as fast as the kernel takes them
        for _ in range(300):
            try:
                os.kill(proc.pid, 15)
            except ProcessLookupError:
                break
        time.sleep(0.02)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:  # deadlocked: clean up before failing
            proc.kill()
            child.kill()
    assert proc.returncode is not None
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
