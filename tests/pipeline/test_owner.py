"""The serve process as a run's owner (pipeline/owner.py): who counts as the owner, and a console whose
reader died. The whole story (a served run whose serve process is SIGKILLed ends Crashed, saying
so, and resumes on retry) is exercised by tests/flows/test_chaos.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from infra.guard import ProcessRef
from pipeline.owner import OWNER_ENV, run_owner

REPO = Path(__file__).resolve().parents[2]


def test_the_owner_is_the_serve_process_that_started_this_one():
    parent = ProcessRef.of(os.getppid())
    assert run_owner({OWNER_ENV: parent.encode()}) == parent
    assert run_owner({}) is None
    assert run_owner({OWNER_ENV: "garbage"}) is None
    # a live process that is not our parent (the variable inherited further down): not ours
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert run_owner({OWNER_ENV: ProcessRef.of(other.pid).encode()}) is None
    finally:
        other.kill()
        other.wait()
    # an owner that already died (pid and start time no longer match): ours, and dead
    gone = run_owner({OWNER_ENV: f"{other.pid}:{ProcessRef.of(os.getpid()).start}"})
    assert gone is not None and gone.alive() is False


CHILD = textwrap.dedent("""
    import logging, os, sys, time
    from prefect.logging.handlers import PrefectConsoleHandler
    logger = logging.getLogger("prefect.test-owner")
    logger.addHandler(PrefectConsoleHandler(stream=sys.stderr))
    logger.propagate = False
    if sys.argv[1] == "patched":
        from pipeline.owner import survive_broken_console
        survive_broken_console()
    logger.warning("first line, read")
    sys.stdin.readline()  # the reader closes its end of the pipe, then says go on stdin
    try:
        for i in range(3):
            logger.warning("nobody reads this %d", i)
    except SystemExit:
        os.write(int(sys.argv[2]), b"SystemExit")
        raise
    os.write(int(sys.argv[2]), b"survived")
""")


def _log_into_a_closed_pipe(mode: str) -> tuple[str, int]:
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(res_w)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stderr=out_w,
        pass_fds=(res_w,),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    os.close(out_w)
    os.close(res_w)
    try:
        with os.fdopen(out_r, "rb") as reader:
            assert b"first line, read" in reader.readline()
        # the console's reader is gone (as when the serve process dies)
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with os.fdopen(res_r, "rb") as res:
        return res.read().decode(), code


def test_a_console_whose_reader_died_no_longer_raises_systemexit_in_the_logging_thread():
    said, code = _log_into_a_closed_pipe("stock")
    assert said == "SystemExit" and code == 1  # rich's on_broken_pipe: what ended runs mid-step
    said, code = _log_into_a_closed_pipe("patched")
    assert said == "survived" and code == 0


def test_a_step_running_when_its_owner_dies_is_recorded_stopped_and_logging_into_the_dead_pipe_fails_nothing(
    tmp_path, api_url
):
    """The serve stand-in is SIGKILLed while three steps run: `chatty` writes to the console every
    millisecond, so its next write meets the broken pipe well before the watchdog's next look
    (what recorded an evaluation `failed: BrokenPipeError` beside a stopped stage),
    `raw_writer` writes to fd 2 itself, `sleeper` runs in a child process. The console goes quiet
    and `chatty` finishes; `raw_writer` finishes or is recorded stopped; `sleeper` is stopped and
    recorded as stopped by the owner's death; the run ends Crashed naming only the death."""
    import signal
    import time

    import psutil

    from pipeline.lineage import Lineage

    env = {**os.environ, "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO)}
    serve = subprocess.Popen(
        [sys.executable, "-m", "tests.pipeline.owner_run", "serve", str(tmp_path)],
        cwd=REPO,
        env=env,
        start_new_session=True,  # its own process group, for the cleanup below
    )
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"{s}.started").exists() for s in ("chatty", "raw_writer", "sleeper")):
            console = tmp_path / "console.log"
            pid = tmp_path / "flow.pid"
            gone = pid.exists() and not psutil.pid_exists(int(pid.read_text()))
            assert serve.poll() is None and not gone and time.monotonic() < deadline, (
                "the steps did not start: "
                + "\n".join(ln for ln in (console.read_text() if console.exists() else "").splitlines()[-300:])[-3000:]
            )
            time.sleep(0.1)
        flow = psutil.Process(int((tmp_path / "flow.pid").read_text()))
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait()
        time.sleep(1.0)  # chatty keeps writing into the broken pipe meanwhile
        (tmp_path / "release").touch()
        flow.wait(120)
    finally:
        _end_the_run(serve, tmp_path)
    lineage = Lineage(tmp_path / "ws" / "lineage.duckdb")
    run_id = (tmp_path / "run_id").read_text()
    rows = {r["step"]: r for r in lineage.steps_of(run_id)}
    assert rows["chatty"]["state"] == "completed", rows["chatty"]  # logging to a dead parent failed nothing
    # A write past Python's streams may raise before the console is muted: stopped, never failed
    raw = rows["raw_writer"]
    assert raw["state"] == "completed" or (raw["state"] == "failed" and raw["error"].startswith("stopped: ")), raw
    assert rows["sleeper"]["state"] == "failed"
    assert rows["sleeper"]["error"].startswith(f"stopped: the serve process (pid {serve.pid}) that owns this run died")
    assert not any("BrokenPipe" in (r["error"] or "") for r in rows.values()), rows
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
    assert state.is_crashed(), state
    assert "sleeper[x]" in state.message.split("Stopped while running: ")[1] and "failed before" not in state.message


def _end_the_run(serve: subprocess.Popen, state: Path) -> None:
    """Whatever the test's outcome: nothing it started outlives it. `chatty` loops until `release`
    appears and the flow process outlives the serve stand-in by design (it is reparented when the
    stand-in dies), so a test failing before the end would leave the flow and its `sleeper` child
    running: release them, then kill the serve stand-in, the flow process and every descendant."""
    import signal

    import psutil

    (state / "release").touch()
    procs: list[psutil.Process] = []
    pid_file = state / "flow.pid"
    for pid in (serve.pid, int(pid_file.read_text()) if pid_file.exists() else None):
        try:
            proc = psutil.Process(pid) if pid is not None else None
            if proc is not None and "tests.pipeline.owner_run" in " ".join(proc.cmdline()):  # not a reused pid
                procs += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    try:
        os.killpg(serve.pid, signal.SIGKILL)  # anything left in the stand-in's process group
    except (ProcessLookupError, PermissionError):
        pass
    serve.wait()
