"""Cluster jobs that survive, on the real one-node Slurm cluster (`local_slurm`, with preemption).

- preemption: a job in the `urgent` partition takes the node; the training job's ranks get
  SIGTERM, save the step they were training and exit; Slurm requeues the job, which resumes at
  that step: no step is trained twice, and the final loss is the one of an uninterrupted run;
- the time-limit warning (`--signal=B:USR1@N`): the batch script forwards it to the ranks, which
  save and exit, then requeues the job; the same holds;
- the process following the job dies (SIGKILL from outside, as an OOM kill of the flow process
  would): the job keeps training, and the next launch of the stage re-attaches to the same job
  (no second submission) and collects its result.

Steps trained are counted from the job's own log (rank 0 logs every step once per execution).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from infra.launchers import LaunchConfig, SlurmLaunchConfig, get_launcher
from infra.launchers.base import JobRecord
from tests.conftest import wait_for_deployment
from tests.infra.launch_fixtures import write_plan, write_spec
from tests.infra.slurm_cluster import URGENT

# One private Slurm cluster per test process: under pytest-xdist these tests share one worker.
pytestmark = pytest.mark.xdist_group("slurm")

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEP_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)*\S+ step (\d+)/(\d+) \| loss")


def config(**slurm) -> LaunchConfig:
    slurm = {"time": "00:10:00", "cpus_per_task": 2, "poll_seconds": 0.5, "job_name": "smollm3-resil"} | slurm
    # no master_port: each job's own, from its id (infra/launchers/slurm.py `job_port`), below the
    # ephemeral range where the other tests' servers and clients take theirs
    return LaunchConfig(
        kind="slurm",
        nodes=1,
        procs_per_node=2,
        torchrun=TORCHRUN,
        slurm=SlurmLaunchConfig(**slurm),
    )


def stage_spec(plan: Path, out: Path, steps: int, **kw) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return write_spec(
        out / "spec.json",
        plan,
        out,
        steps=steps,
        checkpoint_interval=1000,  # only the stage end: every step a stop did not save is redone
        schedule={"warmup_steps": 2, "decay_fraction": 0.3, "total_steps": steps},
        **kw,
    )


def trained_steps(text: str) -> list[int]:
    """The steps rank 0 logged, in order, over every execution of the job."""
    return [int(m.group(1)) for line in text.splitlines() if (m := STEP_LINE.match(line))]


def metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


CLEAN_STEPS = 16  # the preemption and time-limit stages: both compared with one clean run


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, float]:
    """The plan of the interrupted stages and the final loss of the same stage trained without
    interruption (local torchrun, 2 ranks): trained once for the tests that compare with it."""
    root = tmp_path_factory.mktemp("clean")
    plan = write_plan(root / "shards")
    out = root / "clean"
    get_launcher(LaunchConfig(procs_per_node=2)).launch(stage_spec(plan, out, CLEAN_STEPS), out, lambda _: None)
    return plan, json.loads((out / "result.json").read_text())["final_loss"]


def jobs_writing(out: Path) -> list[str]:
    """Every job slurmctld knows (MinJobAge keeps ended ones) whose log goes to `out`."""
    proc = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, timeout=60)
    return [
        re.search(r"JobId=(\d+)", line).group(1) for line in proc.stdout.splitlines() if f"StdOut={out}/slurm-" in line
    ]


def cluster_state() -> str:
    """What Slurm says of every job and node now: the message of a wait that timed out."""
    queue = subprocess.run(["squeue", "-a", "-o", "%i %j %T %r %N %S"], capture_output=True, text=True, timeout=60)
    nodes = subprocess.run(["sinfo", "-N", "-o", "%N %P %T %E"], capture_output=True, text=True, timeout=60)
    return f"squeue:\n{queue.stdout}{queue.stderr}sinfo:\n{nodes.stdout}{nodes.stderr}"


def wait_for(predicate, timeout: float, what: str, *, fail: bool = True, why=None) -> None:
    """Poll `predicate` until it holds; past `timeout` fail naming `what` and showing the
    cluster's jobs and nodes, or `why()` (`explain`) where given (or return, with `fail=False`,
    for a caller that asserts the exact outcome itself)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            assert not fail, f"timed out waiting for {what}\n{why() if why else cluster_state()}"
            return
        time.sleep(0.2)


def launch_in_thread(launcher, spec: Path, out: Path):
    lines: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            launcher.launch(spec, out, lines.append)
        except BaseException as exc:  # noqa: BLE001  (the test reports it)
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, lines, errors


@contextmanager
def requeue_without_delay(out: Path):
    """Slurm holds a requeued batch job for about two minutes (PENDING, Reason=BeginTime) before it
    may start again: the clock, not the behaviour under test. While the block runs, every job
    writing to `out` that waits only for that begin time is made eligible, from outside, as an
    operator would with `scontrol update JobId=... StartTime=now`.

    Not in the second the job was requeued: the hold is how long slurmd remembers that it revoked
    the killed start's credential (`AuthInfo=cred_expire`, 120 s), and a new start whose credential
    is dated the second of the revocation is refused ("Killing non-startable batch JobId=1: Job
    credential revoked" in slurmctld's log, "Job 1 already killed, do not launch batch job" in
    slurmd's): the job then ends FAILED and never runs (seen here on a quiet machine; CI's failure on
    stop 46 looked the same). Released 3 s after it is first seen held, the new credential is dated
    at least two seconds after the revocation."""
    stop = threading.Event()
    held_since: dict[str, float] = {}

    def release() -> None:
        while not stop.wait(0.5):
            for job in jobs_writing(out):
                info = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
                if "JobState=PENDING" not in info or "Reason=BeginTime" not in info:
                    held_since.pop(job, None)
                elif time.monotonic() - held_since.setdefault(job, time.monotonic()) >= 3.0:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def explain(errors: list[BaseException], lines: list[str], out: Path, local_slurm: Path) -> str:
    """What a failed wait shows: the follower's error and last lines, what Slurm says of the job
    now, the controller's and node daemon's log lines about it, the tail of the job's own log
    and the job's processes still alive (pytest
    would cut a repr of these to a few hundred characters; the cluster's logs are deleted at the
    end of the session)."""
    jobs = jobs_writing(out)
    shown = [
        subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60).stdout
        for job in jobs
    ]
    daemon_lines = []
    named = re.compile(rf"(?:JobId=|[Jj]ob |JOB |\[)(?:{'|'.join(jobs) or '-'})\b")  # not job 10 for job 1
    for name in ("slurmctld.log", "slurmd.log"):
        path = local_slurm.parent / "log" / name
        text = path.read_text(errors="replace") if path.exists() else ""
        about = [ln for ln in text.splitlines() if named.search(ln)]
        daemon_lines.append(f"--- {name} about jobs {jobs} (last 60 lines):\n" + "\n".join(about[-60:]))
    logs = []
    for path in sorted(out.glob("slurm-*.log")):
        logs.append(f"--- {path.name} (the batch script's and its ranks' output; last 40 lines):")
        logs += path.read_text(errors="replace").splitlines()[-40:]
    procs = [
        f"{p.info['pid']} {p.info['status']} {' '.join(p.info['cmdline'] or [])[:200]}"
        for p in psutil.process_iter(["pid", "status", "cmdline"])
        if str(out) in " ".join(p.info["cmdline"] or []) or "slurmstepd" in " ".join(p.info["cmdline"] or [])
    ]
    return "\n".join(
        ["errors: " + "; ".join(f"{type(e).__name__}: {e}" for e in errors), "--- follower's last 40 lines:"]
        + lines[-40:]
        + ["--- scontrol show job:", *shown, *daemon_lines, *logs, "--- the job's processes now:", *procs]
        + [cluster_state()]
    )


def wait_for_steps(steps: int, out: Path, thread, errors, lines, local_slurm: Path) -> None:
    """Until the stage in `out` has trained `steps` steps (or its follower ended); past 180 s fail
    with `explain`: where the job sat."""
    wait_for(
        lambda: len(metric_steps(out)) >= steps or not thread.is_alive(),
        180,
        f"{steps} trained steps",
        why=lambda: explain(errors, lines, out, local_slurm),
    )


def assert_lost_no_step(out: Path, steps: int, stops: list[int], loss: float) -> None:
    text = "\n".join(p.read_text() for p in sorted(out.glob("slurm-*.log")))
    assert trained_steps(text) == list(range(1, steps + 1)), "a step was trained twice (or never)"
    for step in stops:
        assert f"resumed from {out}/checkpoints/step_{step:08d} at step {step}" in text
    assert metric_steps(out) == list(range(1, steps + 1))
    result = json.loads((out / "result.json").read_text())
    assert result["final_step"] == steps and result["final_loss"] == loss


@pytest.mark.slow
def test_preemption_saves_the_step_being_trained_and_the_requeue_loses_none(local_slurm, clean, tmp_path):
    steps = CLEAN_STEPS
    plan, loss = clean
    out = tmp_path / "stage"
    spec = stage_spec(plan, out, steps, debug_step_sleep_s=0.5)
    thread, lines, errors = launch_in_thread(get_launcher(config()), spec, out)
    wait_for_steps(3, out, thread, errors, lines, local_slurm)
    assert thread.is_alive(), (errors, lines[-60:])
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", URGENT, "--exclusive", "-o", str(tmp_path / "urgent.log"), "--wrap", "sleep 1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with requeue_without_delay(out):
        thread.join(timeout=400)
    assert not thread.is_alive() and not errors, explain(errors, lines, out, local_slurm)
    text = "\n".join(lines)
    stops = [int(s) for s in re.findall(r"stopped on SIGTERM after step (\d+)", text)]
    assert len(stops) == 1, lines[-60:]  # the preemption: one stop, one requeue
    assert "(restart 1)" in text  # Slurm requeued the same job
    assert len(jobs_writing(out)) == 1
    assert_lost_no_step(out, steps, stops, loss)
    # silence: a preemption's requeue is no node failure, no node is excluded
    from infra.launchers.exclude import excluded_nodes

    assert excluded_nodes(out) == [] and "it now excludes" not in text, lines[-40:]
    state = subprocess.run(["scontrol", "show", "job", "-o", urgent], capture_output=True, text=True).stdout
    assert "JobState=COMPLETED" in state  # the preemptor ran in between


@pytest.mark.slow
def test_the_time_limit_warning_saves_the_step_and_the_requeue_loses_none(local_slurm, clean, tmp_path):
    """The time-limit warning delivered as Slurm delivers it: `--signal=B:USR1@N` makes slurmctld
    send SIGUSR1 to the batch shell alone, N seconds before the limit, which is what
    `scancel --signal=USR1 --batch` does now (Slurm checks limits every 30 s and its limits are in
    minutes: a real limit costs this test minutes of waiting and proves nothing more). The script
    carries the real directive; its trap forwards the warning to the ranks, which save the step they
    are on and exit; the script requeues the job, which resumes there."""
    steps = CLEAN_STEPS
    plan, loss = clean
    out = tmp_path / "stage"
    spec = stage_spec(plan, out, steps, debug_step_sleep_s=0.5)
    thread, lines, errors = launch_in_thread(get_launcher(config(signal_s=60)), spec, out)
    wait_for_steps(3, out, thread, errors, lines, local_slurm)
    assert thread.is_alive(), (errors, lines[-60:])
    (job,) = jobs_writing(out)
    script = subprocess.run(["scontrol", "write", "batch_script", job, "-"], capture_output=True, text=True)
    assert "#SBATCH --signal=B:USR1@60" in script.stdout and "#SBATCH --requeue" in script.stdout
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, capture_output=True)
    with requeue_without_delay(out):
        thread.join(timeout=400)
    assert not thread.is_alive() and not errors, explain(errors, lines, out, local_slurm)
    text = "\n".join(lines)
    stops = [int(s) for s in re.findall(r"stopped on SIGUSR1 after step (\d+)", text)]
    assert len(stops) == 1, lines[-60:]  # one warning, one save, one requeue
    assert text.count("time limit near: requeueing") == 1
    assert "(restart 1)" in text and jobs_writing(out) == [job]
    assert_lost_no_step(out, steps, stops, loss)


FOLLOWER = textwrap.dedent(
    """
    # The flow side of a Slurm stage: follows the job until killed.
    import sys
    sys.path.insert(0, {repo!r})
    from infra.launchers import LaunchConfig
    from infra.launchers import get_launcher
    config = LaunchConfig.model_validate_json({config!r})
    get_launcher(config).launch({spec!r}, {out!r}, lambda line: print(line, flush=True))
    """
)


@pytest.mark.slow
def test_a_killed_follower_leaves_the_job_running_and_the_retry_reattaches(local_slurm, tmp_path):
    steps = 14
    plan = write_plan(tmp_path / "shards")
    out = tmp_path / "stage"
    spec = stage_spec(plan, out, steps, debug_step_sleep_s=0.5)
    cfg = config()
    script = tmp_path / "follower.py"
    script.write_text(FOLLOWER.format(repo=str(REPO), config=cfg.model_dump_json(), spec=str(spec), out=str(out)))
    follower = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(metric_steps(out)) >= 3 or follower.poll() is not None, 180, "3 trained steps")
        assert follower.poll() is None, follower.stdout.read()
        follower.kill()  # SIGKILL: no handler, no cleanup
        follower.wait()
    finally:
        follower.kill()
    (job,) = jobs_writing(out)
    state = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    assert "JobState=RUNNING" in state  # the job did not die with its follower
    killed_at = metric_steps(out)[-1]

    lines: list[str] = []
    get_launcher(cfg).launch(spec, out, lines.append)  # the retry
    text = "\n".join(lines)
    assert f"re-attaching to Slurm job {job}, which is still RUNNING" in text
    assert "submitted Slurm job" not in text and jobs_writing(out) == [job]  # nothing new submitted
    assert lines[-1] == f"[launch] Slurm job {job} completed"
    followed = trained_steps(text)  # the log followed from where it was, not replayed
    assert followed and followed[0] > killed_at - 2 and followed[-1] == steps
    result = json.loads((out / "result.json").read_text())
    assert result["final_step"] == steps and result["resumed_from"] is None  # one run, never restarted
    assert not JobRecord(out, "slurm-job.json").path.exists()  # cleared once the job ended


SERVED = textwrap.dedent(
    """
    # A served flow whose one step follows a Slurm training job, inside the step engine's RunContext.
    import os, sys
    sys.path.insert(0, {repo!r})
    from prefect import flow, task
    from infra.launchers import LaunchConfig, get_launcher
    from pipeline.runner import RunContext, RunSetup
    from pipeline.slots import ResourcesConfig
    from pipeline.workspace import Workspace

    @task
    def train(spec: str, out: str, config: str, pidfile: str):
        open(pidfile, "w").write(str(os.getpid()))
        launch = LaunchConfig.model_validate_json(open(config).read())
        get_launcher(launch).launch(spec, out, print)

    @flow(name="slurm-stage")
    def stage(spec: str, out: str, config: str, pidfile: str, ws: str):
        with RunContext("slurm-stage", RunSetup(Workspace(root=ws), ResourcesConfig(), "test", {{}})):
            train.submit(spec, out, config, pidfile).result()

    if __name__ == "__main__":
        stage.serve(name="slurm-cancel", pause_on_shutdown=False)
    """
)


LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED")  # states a job passes through


def _job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "?"


@pytest.mark.slow
def test_only_a_prefect_cancellation_cancels_the_job_a_sigterm_leaves_it(local_slurm, tmp_path, api_url):
    """Two runs of a served flow whose step follows a Slurm job: `prefect flow-run cancel` cancels
    the job (the run's steps follow it from worker threads that never see the cancellation); a
    SIGTERM to the flow-run process from anything else (a host shutting down) leaves it running."""
    import os
    import signal as sig

    from prefect.deployments import run_deployment

    plan = write_plan(tmp_path / "shards")
    script = tmp_path / "served.py"
    script.write_text(SERVED.format(repo=str(REPO)))
    # serve's runner asks for scheduled and cancelled runs every second (tests/conftest.py)
    env = os.environ | {"PREFECT_API_URL": api_url}
    serve = subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    prefect = str(Path(sys.executable).parent / "prefect")
    jobs: list[str] = []
    try:
        outcomes = {}
        for how in ("prefect-cancel", "sigterm"):
            out = tmp_path / how
            spec = stage_spec(plan, out, 200, debug_step_sleep_s=0.5)
            pidfile = tmp_path / f"{how}.pid"
            launch = tmp_path / "launch.json"
            launch.write_text(config().model_dump_json())
            params = {"spec": str(spec), "out": str(out), "config": str(launch), "pidfile": str(pidfile)}
            params["ws"] = str(tmp_path / "ws")
            wait_for_deployment("slurm-stage/slurm-cancel", serve=serve)  # registered once serve has started
            # what `prefect deployment run` does, from this process (no CLI interpreter)
            run = str(run_deployment("slurm-stage/slurm-cancel", parameters=params, timeout=0).id)
            wait_for(lambda out=out: len(jobs_writing(out)) == 1 and len(metric_steps(out)) >= 2, 240, "training")
            (job,) = jobs_writing(out)
            jobs.append(job)
            pid = int(pidfile.read_text())
            if how == "prefect-cancel":
                subprocess.run([prefect, "flow-run", "cancel", run], env=env, check=True, capture_output=True)
                # waits on the outcome itself; the assertion below names what was reached instead
                wait_for(lambda job=job: _job_state(job) not in LIVE, 60, "the job to end", fail=False)
            else:
                os.kill(pid, sig.SIGTERM)
            wait_for(lambda pid=pid: not psutil.pid_exists(pid), 60, "the flow-run process to exit", fail=False)
            if how == "sigterm":
                time.sleep(5)  # its follower gone: nothing may cancel the job after that
            outcomes[how] = (_job_state(job), psutil.pid_exists(pid))
        assert outcomes["prefect-cancel"] == ("CANCELLED", False)
        # left training, its follower gone (it did not wait for the job): a retry re-attaches
        assert outcomes["sigterm"] == ("RUNNING", False)
        assert json.loads(JobRecord(tmp_path / "sigterm", "slurm-job.json").path.read_text())["job"] == jobs[1]
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], capture_output=True)
        os.killpg(serve.pid, 9)
        serve.wait()


def the_node() -> str:
    """The one node of the tests' cluster."""
    return subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()[
        0
    ]


def set_node_down(node: str) -> None:
    """A node failure as Slurm sees one: the node DOWN under a running job."""
    subprocess.run(
        ["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=smollm3-node-failure-test"],
        check=True,
        capture_output=True,
    )


def bring_node_back(node: str, spec: Path) -> None:
    """The node in service again, with what the downed node's job left running killed first, as
    a lost node's reboot would: the job's processes and its steps' slurmstepd. A step left behind
    (the batch script still waiting on torchrun) made slurmd refuse the requeued job's restart
    with "Duplicate jobid": the node drained, the job held ("launch failed requeued held")."""
    steps = tuple(f"slurmstepd: [{job}." for job in jobs_writing(Path(spec).parent))
    doomed = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(spec) in cmd or (steps and cmd.startswith(steps)):
            try:
                doomed += [p, *p.children(recursive=True)]
            except psutil.Error:
                continue
    for p in doomed:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(doomed, timeout=30)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
    wait_for(
        lambda: "idle" in subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout,
        120,
        "the node back in service",
    )


@pytest.mark.slow
def test_a_node_failure_names_the_lost_node_and_the_next_attempt_excludes_it(local_slurm, clean, tmp_path):
    """The node taken down from outside mid-stage (`scontrol update State=DOWN`, as slurmctld does
    when a node stops responding): the job ends NODE_FAIL (`--no-requeue` here), the failure names
    the node it lost, counts as transient (the step retries it), and the stage's next script
    excludes that node. (This cluster's node returns to service at once, its slurmd being alive:
    the job's only node is the one it lost.)"""
    from infra.launchers.base import LaunchFailed
    from infra.launchers.exclude import excluded_nodes
    from pipeline.step import transient

    plan, _ = clean
    out = tmp_path / "stage"
    spec = stage_spec(plan, out, CLEAN_STEPS, debug_step_sleep_s=0.5)
    launcher = get_launcher(config(requeue=False))
    node = the_node()
    thread, lines, errors = launch_in_thread(launcher, spec, out)
    try:
        wait_for_steps(2, out, thread, errors, lines, local_slurm)
        assert thread.is_alive(), (errors, lines[-60:])
        set_node_down(node)
        thread.join(timeout=300)
    finally:
        bring_node_back(node, spec)
    assert not thread.is_alive() and errors and isinstance(errors[0], LaunchFailed), (errors, lines[-40:])
    err = errors[0]
    assert err.facts.state == "NODE_FAIL" and err.facts.node == node, err.facts
    assert f"node {node} failed" in err.cause and err.cause.endswith(f"the next attempt excludes node {node}")
    assert transient(err) and excluded_nodes(out) == [node]
    assert f"#SBATCH --exclude={node}\n" in launcher.render(spec, out)


@pytest.mark.slow
def test_a_job_slurm_requeues_after_a_node_failure_is_kept_off_the_lost_node(local_slurm, clean, tmp_path):
    """With `--requeue` (the default) Slurm requeues the job whose node went down at once (the
    follower sees it PENDING again); the launcher keeps following the same job and excludes the node
    srun's log line names (`Node failure on vm`) from it (`ExcNodeList`).
    On this one-node cluster nothing else can run it then: the test cancels it there."""
    plan, _ = clean
    out = tmp_path / "stage"
    spec = stage_spec(plan, out, CLEAN_STEPS, debug_step_sleep_s=0.5)
    node = the_node()
    thread, lines, errors = launch_in_thread(get_launcher(config()), spec, out)
    try:
        wait_for_steps(2, out, thread, errors, lines, local_slurm)
        assert thread.is_alive(), (errors, lines[-60:])
        set_node_down(node)
        wait_for(lambda: any("in place; it now excludes" in line for line in lines), 120, "the in-place exclusion")
        (job,) = jobs_writing(out)
        info = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        assert f"ExcNodeList={node}" in info and "JobState=PENDING" in info and "Restarts=1" in info, info
        assert f"[launch] Slurm requeued job {job} in place; it now excludes {node}" in lines
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
        for job in jobs_writing(out):
            subprocess.run(["scancel", job], capture_output=True)
        thread.join(timeout=120)
        bring_node_back(node, spec)
    assert not thread.is_alive()


@pytest.mark.slow
def test_slurms_own_requeue_past_the_budget_is_refused_by_the_batch_script(local_slurm, clean, tmp_path):
    """`launch.slurm.max_node_requeues: 0`: the node taken down from outside mid-stage, Slurm
    requeues the job by itself (`--requeue`); at its next start (`SLURM_RESTART_COUNT` 1, no
    planned stop before it) the batch script refuses to train again, the job ends FAILED with the
    script's `error:` line, and the step would not retry it. (No node is excluded here,
    `max_excluded_nodes: 0`: this cluster's only node must run the requeued job.)"""
    from infra.launchers.base import LaunchFailed
    from pipeline.step import transient

    plan, _ = clean
    out = tmp_path / "stage"
    spec = stage_spec(plan, out, CLEAN_STEPS, debug_step_sleep_s=0.5)
    launcher = get_launcher(config(max_node_requeues=0).model_copy(update={"max_excluded_nodes": 0}))
    node = the_node()
    thread, lines, errors = launch_in_thread(launcher, spec, out)

    def pending() -> bool:
        return any(
            "JobState=PENDING"
            in subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
            for job in jobs_writing(out)
        )

    try:
        wait_for_steps(2, out, thread, errors, lines, local_slurm)
        assert thread.is_alive(), (errors, lines[-60:])
        set_node_down(node)
        wait_for(pending, 120, "Slurm's requeue of the job")
        bring_node_back(node, spec)  # the only node back in service, for the requeued start
        with requeue_without_delay(out):
            wait_for(lambda: not thread.is_alive(), 240, "the refused restart")
    finally:
        bring_node_back(node, spec)
        for job in jobs_writing(out):
            subprocess.run(["scancel", job], capture_output=True)
        thread.join(timeout=120)
    assert errors and isinstance(errors[0], LaunchFailed), (errors, lines[-40:])
    err = errors[0]
    assert err.facts.state == "FAILED", (err.facts, lines[-40:])
    assert "requeued job" in (err.facts.error or "") and "max_node_requeues is 0" in err.facts.error, lines[-40:]
    assert not transient(err)
    text = "\n".join(p.read_text() for p in out.glob("slurm-*.log"))
    restart = text.index("(restart 1: a node failure), 1 time(s) since checkpoint")
    assert "error: Slurm requeued job" in text[restart:]  # the second start refused, before srun
