"""How a run's stop reaches a cluster job being followed, through the interface the runner and
the launchers share (infra/stop_hooks.py) and the launchers' own side (infra/launchers/follow.py):
a cancellation cancels every job followed, anything else detaches the waits and leaves the jobs
running, a failing cancel keeps the others going, and a job no longer followed is told nothing."""

from __future__ import annotations

import threading

import pytest

from infra.launchers.follow import Detached, explicit_stop, following
from infra.stop_hooks import cancel_requested, set_cancel_probe, stop


def test_a_cancellation_cancels_every_job_followed_and_only_those():
    cancelled: list[str] = []
    with following("Slurm job 7", lambda: cancelled.append("7")):
        with following("PyTorchJob ns/a", lambda: cancelled.append("a")) as handle:
            assert sorted(stop("cancel")) == ["PyTorchJob ns/a", "Slurm job 7"]
            handle.check()  # cancelled, not detached: the launcher waits to see the job end
        assert stop("cancel") == ["Slurm job 7"]  # the PyTorchJob is no longer followed
    assert stop("cancel") == []
    assert sorted(cancelled) == ["7", "7", "a"]


def test_a_detach_ends_the_wait_and_cancels_nothing():
    cancelled: list[str] = []
    ended: list[BaseException] = []
    following_now = threading.Event()

    def launcher() -> None:  # what a launcher's poll loop does between polls
        with following("Slurm job 8", lambda: cancelled.append("8")) as handle:
            following_now.set()
            try:
                while True:
                    handle.check()
                    threading.Event().wait(0.01)
            except Detached as exc:
                ended.append(exc)

    t = threading.Thread(target=launcher)
    t.start()
    assert following_now.wait(10)
    assert stop("detach") == ["Slurm job 8"]
    t.join(10)
    assert not t.is_alive() and cancelled == []
    assert "stopped following Slurm job 8, which keeps running" in str(ended[0])


def test_one_failing_cancel_keeps_the_others_going():
    cancelled: list[str] = []

    def broken() -> None:
        raise OSError("scancel: controller down")

    with following("Slurm job 1", broken), following("Slurm job 2", lambda: cancelled.append("2")):
        done = stop("cancel")
    assert sorted(done) == ["Slurm job 1 (cancel failed: scancel: controller down)", "Slurm job 2"]
    assert cancelled == ["2"]


class TerminationSignal(BaseException):
    """Stands for Prefect's exception of the same name (a SIGTERM), which is a BaseException."""


def test_only_an_explicit_stop_or_a_confirmed_cancellation_stops_a_job():
    assert explicit_stop(KeyboardInterrupt())
    assert not explicit_stop(OSError("squeue timed out"))  # the launcher's trouble: leave the job
    try:
        assert not explicit_stop(TerminationSignal())  # no probe: a SIGTERM is not a cancellation
        set_cancel_probe(lambda: True)
        assert cancel_requested() and explicit_stop(TerminationSignal())
        set_cancel_probe(lambda: 1 / 0)  # the API does not answer: not a cancellation
        assert not cancel_requested() and not explicit_stop(TerminationSignal())
    finally:
        set_cancel_probe(None)
    assert not cancel_requested()


@pytest.mark.parametrize("kind", ["cancel", "detach"])
def test_nothing_followed_nothing_stopped(kind):
    assert stop(kind) == []
