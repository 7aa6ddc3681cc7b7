"""A signal is a checkpoint: SIGUSR1/SIGTERM from outside, the ranks save the step and exit 75.

Real torchrun through the local launcher (2 gloo ranks on CPU), the signal sent by this test to
one process of the running job: SIGUSR1 to rank 1 alone (every rank must agree on the same step
through the all-reduce of the flag), SIGUSR1 to torchrun (which forwards it only because the
launch says so: torchrun's defaults do not include it, and its default action kills), SIGTERM
to torchrun (what Kubernetes sends a pod's first process on eviction). The stage checkpoints only at its end, so without the
handler every trained step would be lost; with it, none is: the resumed run continues at the
step the signal stopped and ends with the loss of an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from infra.launchers import LaunchConfig, LaunchFailed, get_launcher
from infra.launchers.base import EXIT_STOPPED
from model.checkpoint import Checkpointer
from pipeline.step import transient
from tests.infra.launch_fixtures import write_spec
from tests.model.conftest import write_two_source_plan

STEPS = 10


def _spec(plan: Path, out: Path, **kw) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return write_spec(
        out / "spec.json",
        plan,
        out,
        steps=STEPS,
        checkpoint_interval=1000,  # only the stage end: a lost step would have to be redone
        schedule={"warmup_steps": 2, "decay_fraction": 0.3, "total_steps": STEPS},
        **kw,
    )


def _metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _trainer_processes(guard_pid: int) -> tuple[psutil.Process, dict[int, psutil.Process]]:
    """torchrun and its ranks by global rank, below the launcher's guard process."""
    torchrun, ranks = None, {}
    for p in psutil.Process(guard_pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "trainers.pretrain" not in cmd:
                continue
            if "torchrun" in cmd or "torch.distributed.run" in cmd:
                torchrun = p
            elif "RANK" in p.environ():
                ranks[int(p.environ()["RANK"])] = p
        except psutil.Error:
            continue
    return torchrun, ranks


# One pytest-xdist worker runs this module, so its module fixture (the uninterrupted 2-rank run) is built once,
# not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("rank-signals-clean")


@pytest.fixture(scope="module")
def shared_plan(tmp_path_factory) -> Path:
    """One plan for the whole module, so the uninterrupted run is trained once."""
    return write_two_source_plan(tmp_path_factory.mktemp("signals") / "shards")


@pytest.fixture(scope="module")
def clean_loss(shared_plan, tmp_path_factory) -> float:
    """The final loss of the stage trained without interruption (2 ranks, local torchrun)."""
    clean = tmp_path_factory.mktemp("clean")
    get_launcher(LaunchConfig(procs_per_node=2)).launch(_spec(shared_plan, clean), clean, lambda _: None)
    return json.loads((clean / "result.json").read_text())["final_loss"]


@pytest.mark.parametrize(
    ("target", "sig", "async_checkpoint"),
    [("rank1", signal.SIGUSR1, False), ("torchrun", signal.SIGUSR1, False), ("torchrun", signal.SIGTERM, True)],
    ids=["sigusr1-to-one-rank", "sigusr1-to-torchrun", "sigterm-to-torchrun-async-checkpoints"],
)
@pytest.mark.slow
def test_a_stop_signal_saves_the_current_step_and_the_resume_loses_none(
    shared_plan, clean_loss, tmp_path, target, sig, async_checkpoint
):
    """With async checkpoints the stop's save is still complete (its marker written) at exit."""
    launcher = get_launcher(LaunchConfig(procs_per_node=2))
    out = tmp_path / "signalled"
    spec = _spec(shared_plan, out, debug_step_sleep_s=0.4, async_checkpoint=async_checkpoint)
    lines: list[str] = []
    started: list[int] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            launcher.launch(spec, out, lines.append, on_start=started.append)
        except BaseException as exc:  # noqa: BLE001  (the test inspects it)
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while len(_metric_steps(out)) < 3 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        torchrun, ranks = _trainer_processes(started[0])
        at_signal = _metric_steps(out)[-1]
        (torchrun if target == "torchrun" else ranks[1]).send_signal(sig)
        signalled = time.monotonic()
        thread.join(timeout=120)
        stopped_in = time.monotonic() - signalled
    finally:
        if thread.is_alive():  # a hung stop: end what the test started before failing
            for p in psutil.Process(started[0]).children(recursive=True):
                p.kill()
            thread.join()
    assert failure and isinstance(failure[0], LaunchFailed), lines[-30:]
    err = failure[0]
    assert err.facts.exitcode == EXIT_STOPPED, err
    assert "stopped on a signal" in err.cause and transient(err)  # the step engine retries it
    saved = Checkpointer(out / "checkpoints").latest()
    step = int(saved.name[5:])
    assert at_signal <= step <= at_signal + 1  # the step being trained when the signal came
    assert _metric_steps(out)[-1] == step  # nothing trained after it: nothing to lose
    assert not (out / "result.json").exists()
    assert f"stopped on {sig.name} after step {step}" in "\n".join(lines)
    assert stopped_in < 60

    launcher.launch(_spec(shared_plan, out), out, lambda _: None)  # the restart
    result = json.loads((out / "result.json").read_text())
    assert result["resumed_from"].endswith(saved.name)
    assert _metric_steps(out) == list(range(1, STEPS + 1))  # every step once: none redone
    assert result["final_loss"] == clean_loss  # as if never interrupted
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(spec) in " ".join(p.info["cmdline"] or [])]


def test_without_torchrun_a_sigterm_still_ends_the_rank_at_once(plan_path, tmp_path):
    """The parent-death signal (SIGTERM, infra/guard.py) of a rank whose torchrun died is not a
    stop request: nobody coordinates a save any more, the rank ends as before."""
    from tests.trainers.test_pretrain import TORCHRUN, _env

    out = tmp_path / "stage"
    spec = _spec(plan_path, out, debug_step_sleep_s=1.0)
    import subprocess

    first = subprocess.Popen(
        [str(TORCHRUN), "--nproc-per-node", "1", "--standalone", "-m", "trainers.pretrain", str(spec)],
        cwd=Path(__file__).resolve().parents[2],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    rank = None
    try:
        deadline = time.monotonic() + 120
        while not _metric_steps(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        rank = json.loads((out / ".lease.json").read_text())["holder"]["pid"]
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        gone = time.monotonic()
        while psutil.pid_exists(rank) and psutil.Process(rank).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - gone < 5, "the rank outlived its torchrun"
            time.sleep(0.05)
    finally:
        first.kill()
        if rank is not None and psutil.pid_exists(rank):
            os.kill(rank, signal.SIGKILL)
    assert Checkpointer(out / "checkpoints").latest() is None  # it did not try to save
