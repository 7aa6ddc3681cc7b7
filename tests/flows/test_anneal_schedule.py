"""The nightly anneal deployment: registered by the serve process with its cron and a concurrency
limit of 1, and still scheduled (active, not paused) after serve stops and after a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.deployments import ANNEAL_CRON

REPO = Path(__file__).resolve().parents[2]


def _deployment(name: str):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            return None


def _serve(tmp_path: Path, env: dict, attempt: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.deployments"],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=open(tmp_path / f"serve{attempt}.log", "wb"),
        stderr=subprocess.STDOUT,
    )


def _wait_registered(proc: subprocess.Popen, after: float, log: Path):
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        dep = _deployment("anneal/nightly")
        if (
            dep is not None
            and dep.updated.timestamp() >= after
            and "Your deployments are being served" in log.read_text(errors="replace")
        ):
            return dep
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(1)
    raise AssertionError(f"anneal/nightly not served after 180s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a process manager restarts the serve process: the graceful shutdown path where
    serve pauses every deployment unless `pause_on_shutdown=False` (checked: with True, this test
    fails on `paused`; Ctrl-C does not reach that path at all)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _check_scheduled(dep) -> None:
    assert dep.paused is False
    assert len(dep.schedules) == 1
    (sched,) = dep.schedules
    assert sched.active is True and sched.schedule.cron == ANNEAL_CRON


@pytest.mark.slow
def test_nightly_schedule_survives_serve_stop_and_restart(tmp_path, private_api_url):
    api_url = private_api_url
    env = {**os.environ, "PREFECT_API_URL": api_url}
    start = time.time() - 1
    proc = _serve(tmp_path, env, 1)
    try:
        dep = _wait_registered(proc, start, tmp_path / "serve1.log")
        _check_scheduled(dep)
        assert dep.concurrency_limit == 1 or dep.global_concurrency_limit.limit == 1
        assert dep.parameters["base"] == ""  # resolved at run start, not at registration
    finally:
        _stop(proc)
    _check_scheduled(_deployment("anneal/nightly"))  # serve stopped: still scheduled

    restart = time.time() - 1
    proc = _serve(tmp_path, env, 2)
    try:
        _check_scheduled(_wait_registered(proc, restart, tmp_path / "serve2.log"))
    finally:
        _stop(proc)
    _check_scheduled(_deployment("anneal/nightly"))
