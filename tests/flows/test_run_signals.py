"""Stopping works at once: SIGTERM or SIGINT, sent from another process to `smollm3 run` while
its data steps' children run, kills those children and their trees, exits within 10 s and
records the run `cancelled` (its running steps `failed` as stopped, the rest skipped); a step
busy inside the flow process cannot hold the exit past the deadline either; a cluster job a step
follows is cancelled by Ctrl-C and left running by any other SIGTERM. A native crash (SIGSEGV)
leaves every thread's stack in the run's log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pipeline.lineage import Lineage
from pipeline.sentinel import TASK_RUN_WAIT_S

REPO = Path(__file__).resolve().parents[2]


def _env(api_url: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": api_url}


def _smollm3_run(ws: Path, api_url: str, log_path: Path):
    """`smollm3 run tiny` on workspace `ws`, its output in `log_path`: the process and the log."""
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "tiny", f"workspace={ws}"],
        cwd=REPO, env=_env(api_url), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, log


def _wait_for(proc: subprocess.Popen, want, what: str, timeout: float = 240.0) -> list[psutil.Process]:
    """Descendants of `proc` once `want(cmdline)` holds for one of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what} started"
        tree = psutil.Process(proc.pid).children(recursive=True)
        if any(want(" ".join(_cmdline(p))) for p in tree):
            return tree
        time.sleep(0.2)
    raise AssertionError(f"{what} never started")


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.cmdline())[:120])
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_smollm3_run_within_10_s_and_records_it_cancelled(tmp_path, api_url, sig):
    ws = tmp_path / "ws"
    proc, log = _smollm3_run(ws, api_url, tmp_path / "run.log")
    try:
        _wait_for(proc, lambda cmd: "pipeline.child" in cmd, "a data step's child")
        time.sleep(1.0)  # the child is working (its guard and interpreter started)
        tree = psutil.Process(proc.pid).children(recursive=True)
        sent = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert took < 10.0, f"exited {took:.1f} s after {sig.name}"
    assert rc in (128 + sig, -sig), rc
    time.sleep(0.5)
    assert _alive(tree) == [], "children outlived the run"
    lineage = Lineage(ws / "lineage.duckdb", read_only=True)
    (run,) = lineage.runs(1)
    assert run["state"] == "cancelled"
    steps = lineage.steps_of(run["run_id"])
    stopped = [s for s in steps if s["state"] == "failed"]
    # What lineage held and how the run ended, if not (failed once in ~30 runs at load 4: no step
    # was recorded as stopped, while a later read of the same lineage showed one; cause unknown).
    said = [(s["step"], s["label"], s["state"], (s["error"] or "")[:80]) for s in steps]
    assert stopped and all(s["error"].startswith(f"stopped: the run was cancelled by {sig.name}") for s in stopped), (
        f"steps in lineage: {said}\nrun log tail:\n{(tmp_path / 'run.log').read_text()[-4000:]}"
    )


@pytest.mark.slow
def test_a_native_crash_of_smollm3_run_leaves_every_thread_s_stack_and_a_crashed_run(tmp_path, api_url):
    """SIGSEGV, as a crash in torch's or a library's C code raises it in the flow process: the
    log shows where each thread was (Python's faulthandler), the data step's child dies with the
    run, and the run's sentinel records it crashed."""
    ws = tmp_path / "ws"
    proc, log = _smollm3_run(ws, api_url, tmp_path / "run.log")
    try:
        tree = _wait_for(proc, lambda cmd: "pipeline.child" in cmd, "a data step's child")
        proc.send_signal(signal.SIGSEGV)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "run.log").read_text(errors="replace")
    assert rc == -signal.SIGSEGV, (rc, text[-3000:])
    assert "Fatal Python error: Segmentation fault" in text, text[-3000:]
    assert "most recent call first" in text and "flows/cli.py" in text, text[-3000:]
    _, alive = psutil.wait_procs(tree, timeout=TASK_RUN_WAIT_S + 30)  # the sentinel ends last
    assert _alive(alive) == [], "processes outlived the run"
    (run,) = Lineage(ws / "lineage.duckdb", read_only=True).runs(1)
    assert run["state"] == "crashed", run


BUSY_FLOW = """
import sys, time
from pathlib import Path
from prefect import flow
from pydantic import BaseModel, ConfigDict
from flows.recipe import load_recipe, run_setup
from pipeline.graph import Graph
from pipeline.runner import run_flow
from pipeline.step import step

class Busy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    flag: str

@step("busy", version=1, kind="report")
def busy(config: Busy, *, out: Path, log=print) -> dict:
    Path(config.flag).write_text("started")
    end = time.monotonic() + 120
    while time.monotonic() < end:  # pure Python in the flow process: nothing can interrupt it
        sum(range(10000))
    return {}

@flow(name="busy-test")
def run() -> dict:
    g = Graph("busy-test")
    g.add(busy, Busy(flag=sys.argv[2]), label="x")
    return run_flow("busy-test", g, run_setup(load_recipe("tiny", [f"workspace={sys.argv[1]}"]), "tiny"))

run()
"""


@pytest.mark.slow
def test_a_step_busy_in_the_flow_process_cannot_hold_the_exit(tmp_path, api_url):
    ws, flag = tmp_path / "ws", tmp_path / "started"
    script = tmp_path / "busy.py"
    script.write_text(textwrap.dedent(BUSY_FLOW))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ws), str(flag)], cwd=REPO, env=_env(api_url),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not flag.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the busy step never started"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 10.0 and rc == 128 + signal.SIGTERM, (took, rc)
    (run,) = Lineage(ws / "lineage.duckdb", read_only=True).runs(1)
    assert run["state"] == "cancelled"


FOLLOW_FLOW = """
import sys, time
from pathlib import Path
from prefect import flow
from pydantic import BaseModel, ConfigDict
from flows.recipe import load_recipe, run_setup
from infra.launchers.follow import Detached, following
from pipeline.graph import Graph
from pipeline.runner import run_flow
from pipeline.step import step

class State(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    folder: str

@step("follows", version=1, kind="report")
def follows(config: State, *, out: Path, log=print) -> dict:
    # What a cluster launcher does in a worker thread: follow a job it does not own.
    state = Path(config.folder)
    with following("Slurm job 42", lambda: (state / "cancelled").write_text("scancel 42")) as job:
        (state / "following").write_text("yes")
        try:
            while not (state / "cancelled").exists():  # a cancelled job ends CANCELLED
                job.check()
                time.sleep(0.05)
        except Detached as exc:
            (state / "detached").write_text(str(exc))
            raise
    raise RuntimeError("Slurm job 42 ended CANCELLED")

@flow(name="follow-test")
def run() -> dict:
    g = Graph("follow-test")
    g.add(follows, State(folder=sys.argv[2]), label="x")
    return run_flow("follow-test", g, run_setup(load_recipe("tiny", [f"workspace={sys.argv[1]}"]), "tiny"))

run()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_cancels_a_followed_cluster_job_and_another_sigterm_leaves_it_running(tmp_path, api_url, sig):
    """The runner reaches the job through the launchers' stop hooks: Ctrl-C cancels it; a SIGTERM
    that Prefect's API does not confirm as a cancellation (a host shutting down) only ends the
    wait, leaving the job for a retry to re-attach."""
    ws, state = tmp_path / "ws", tmp_path / "state"
    state.mkdir()
    script = tmp_path / "follow.py"
    script.write_text(textwrap.dedent(FOLLOW_FLOW))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ws), str(state)], cwd=REPO, env=_env(api_url),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (state / "following").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the step never followed its job"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 10.0, f"exited {took:.1f} s after {sig.name}"
    if sig == signal.SIGINT:
        assert (state / "cancelled").read_text() == "scancel 42"
        assert not (state / "detached").exists()
    else:
        assert not (state / "cancelled").exists()
        assert "stopped following Slurm job 42, which keeps running" in (state / "detached").read_text()
    (run,) = Lineage(ws / "lineage.duckdb", read_only=True).runs(1)
    assert run["state"] == "cancelled"
