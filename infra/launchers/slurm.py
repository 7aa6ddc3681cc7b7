"""Slurm launcher: an sbatch script running `srun torchrun` (c10d rendezvous on the first node).

The rendered script asks for `nodes` whole nodes, one task per node (each runs one torchrun that
forks `procs_per_node` ranks), and rendezvouses every torchrun at the allocation's first host. It
is requeue-safe by construction: `--requeue` lets Slurm restart the job after a node failure or
preemption, `--signal=B:USR1@300` plus a trap requeues it shortly before the time limit, and every
start runs the same spec, so the trainer resumes from the newest complete checkpoint in its out
dir. The log is opened in append mode, so all attempts share one file. With `accelerate_config`,
each node's task runs `accelerate launch --config_file FILE --machine_rank $SLURM_PROCID` with
the same c10d rendezvous instead of torchrun (the rank is expanded by the task's own shell).

`launch` submits with `sbatch --parsable`, then polls `scontrol show job` (no accounting database
needed) while streaming new log lines to the caller; if the caller is interrupted or cancelled the
job is `scancel`led, so a cancelled Prefect run does not leave 48 nodes training. A flow process
that dies without that cleanup (SIGKILL, OOM) leaves the job id in `launch/slurm-job.json`; the
next launch in the same stage folder cancels that job and waits for it to end before it submits
(refusing while the recorded owner is still alive on this host).
"""

from __future__ import annotations

import collections
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from infra.launchers.base import (
    LAUNCHERS,
    FirstError,
    JobRecord,
    Launcher,
    LaunchFailed,
    LogFn,
    OnStart,
    TorchrunSummary,
    accelerate_args,
    check_spec,
    failure_facts,
)

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]
DEFAULT_PORT = 29500
TIME_LIMIT_SIGNAL_S = 300  # USR1 this long before the limit: time to requeue cleanly

# Job states after which the job will not run again by itself.
DONE = {"COMPLETED"}
FAILED = {
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "SPECIAL_EXIT",
    "REVOKED",
}


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)


@LAUNCHERS.register("slurm")
class SlurmLauncher(Launcher):
    """sbatch + srun torchrun; `runner` runs sbatch/scontrol/scancel (a fake in unit tests)."""

    def __init__(self, config, runner: Runner = _run, sleep: Callable[[float], None] = time.sleep):
        super().__init__(config)
        self.runner, self.sleep = runner, sleep

    def script_path(self, workdir: Path) -> Path:
        return Path(workdir) / "launch" / "train.sbatch"

    def render(self, spec_path: Path, workdir: Path) -> str:
        c, s = self.config, self.config.slurm
        workdir = Path(workdir).resolve()
        spec = Path(spec_path).resolve()
        code = c.code_path
        sb: list[tuple[str, str | None]] = [
            ("job-name", s.job_name),
            ("nodes", str(c.nodes)),
            ("ntasks-per-node", "1"),  # one torchrun per node; it forks the ranks
        ]
        if c.gpus_per_node:
            sb.append(("gpus-per-node", str(c.gpus_per_node)))
        if s.cpus_per_task:
            sb.append(("cpus-per-task", str(s.cpus_per_task)))
        for key, value in (("mem", s.mem), ("partition", s.partition), ("account", s.account), ("qos", s.qos)):
            if value is not None:
                sb.append((key, value))
        sb.append(("time", s.time))
        if s.exclusive:
            sb.append(("exclusive", None))
        if s.requeue:
            sb += [("requeue", None), ("signal", f"B:USR1@{TIME_LIMIT_SIGNAL_S}")]
        sb += [
            ("open-mode", "append"),  # requeued attempts append to the same log
            ("output", str(workdir / "slurm-%j.log")),
            ("chdir", str(code)),
        ]
        sb += sorted(s.sbatch_args.items())
        lines = [
            "#!/bin/bash",
            "# A smollm3 training stage rendered by infra/launchers/slurm.py: re-render, do not edit.",
            f"# spec: {spec}",
            "# Requeue-safe: every (re)start resumes from the newest complete checkpoint of the spec.",
        ]
        lines += [f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in sb]
        lines += ["", *s.setup]  # before `set -u`: activate scripts read unset variables
        lines += ["set -uo pipefail"]
        env = {"OMP_NUM_THREADS": "1"} | dict(c.env)
        lines += [f'export PYTHONPATH={shlex.quote(str(code))}"${{PYTHONPATH:+:$PYTHONPATH}}"']
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
        port = c.master_port or DEFAULT_PORT
        torchrun = [
            c.torchrun,
            '--nnodes="$SLURM_JOB_NUM_NODES"',
            f"--nproc-per-node={c.procs_per_node}",
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
            '--rdzv-id="$SLURM_JOB_ID"',
            "--max-restarts=0",  # a rank failure fails the job; Slurm's requeue restarts it whole
            f"-m {c.module} {shlex.quote(str(spec))}",
        ]
        lines += [
            # srun does not inherit --cpus-per-task from sbatch since Slurm 22.05
            'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"MASTER_PORT={port}",
            'echo "[launch] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on '
            '$SLURM_JOB_NUM_NODES node(s) $SLURM_JOB_NODELIST; rendezvous $MASTER_ADDR:$MASTER_PORT"',
        ]
        if s.requeue:
            lines += [
                "# USR1 arrives shortly before the time limit (--signal): requeue; the next start resumes",
                """trap 'echo "[launch] time limit near: requeueing $SLURM_JOB_ID"; """
                """scontrol requeue "$SLURM_JOB_ID"' USR1""",
            ]
        if c.accelerate_config:
            # One task per node; each expands its own $SLURM_PROCID (the machine rank), so the
            # command runs in `bash -c` and the rendezvous address is exported to the tasks.
            inner = (
                shlex.join([c.accelerate, *accelerate_args(c), "--rdzv_backend", "c10d", "--same_network"])
                + ' --machine_rank "$SLURM_PROCID" --main_process_ip "$MASTER_ADDR"'
                ' --main_process_port "$MASTER_PORT" ' + shlex.join(["-m", c.module, str(spec)])
            )
            lines += ["export MASTER_ADDR MASTER_PORT"]
            torchrun = ["bash -c " + shlex.quote("exec " + inner)]
        lines += [
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\",
            "  " + " \\\n  ".join(torchrun) + " &",
            "wait $!  # in the background so the USR1 trap can run while training",
            "rc=$?",
            'echo "[launch] srun exited with code $rc"',
            "exit $rc",
            "",
        ]
        return "\n".join(lines)

    # -- submission and monitoring --

    def _call(self, cmd: Sequence[str], what: str) -> str:
        try:
            proc = self.runner(cmd)
        except FileNotFoundError:
            raise LaunchFailed(
                f"{cmd[0]} not found: launch.kind is slurm but this machine has no Slurm client; "
                "run the flow on a login node (or a Prefect worker there), or use kind local"
            ) from None
        if proc.returncode != 0:
            raise LaunchFailed(
                f"{what} failed ({shlex.join(cmd)} exited {proc.returncode}): {(proc.stderr or proc.stdout).strip()}"
            )
        return proc.stdout

    def submit(self, spec_path: Path, workdir: Path) -> str:
        """Write the script into `workdir/launch/` and sbatch it; returns the job id."""
        script = self.script_path(workdir)
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(self.render(spec_path, workdir))
        out = self._call(["sbatch", "--parsable", str(script)], f"submitting {script}")
        job = out.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"
        if not job.isdigit():
            raise LaunchFailed(f"sbatch printed {out.strip()!r} instead of a job id for {script}")
        return job

    def state(self, job: str) -> tuple[str, str]:
        """(state, exit code) of a job, from scontrol (no accounting database needed)."""
        proc = self.runner(["scontrol", "show", "job", "-o", job])
        if proc.returncode == 0 and "JobState=" in proc.stdout:
            state = re.search(r"JobState=(\S+)", proc.stdout).group(1)
            code = re.search(r"ExitCode=(\S+)", proc.stdout)
            return state, code.group(1) if code else "?"
        # Purged from slurmctld's memory (MinJobAge): ask accounting, if the site has it.
        proc = self.runner(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job])
        if proc.returncode == 0 and proc.stdout.strip():
            state, _, code = proc.stdout.strip().splitlines()[0].partition("|")
            return state.split()[0], code
        raise LaunchFailed(f"cannot find Slurm job {job} in scontrol or sacct; check `squeue --me` and the job log")

    def sweep(self, workdir: Path, log: LogFn = print, timeout_s: float = 600.0) -> None:
        """Cancel the job a dead earlier launch left running in this stage folder, and wait for it.

        Two jobs in one stage folder would write the same checkpoints and metrics; the trainer's
        lease would refuse the second one, but only after it has queued and taken its nodes.
        """
        record = JobRecord(workdir, "slurm-job.json")
        found = record.read()
        if found is None:
            return
        job, owner = found
        if record.live_owner() is not None:
            raise LaunchFailed(
                f"stage folder {workdir} already has Slurm job {job}, launched by "
                f"{owner.describe()} which is still running; wait for it, or `scancel {job}`"
            )
        deadline = time.monotonic() + timeout_s
        cancelled = False
        while True:
            try:
                state, _ = self.state(job)
            except LaunchFailed:
                break  # Slurm no longer knows the job: it ended long ago
            if state in DONE or state in FAILED:
                break
            if not cancelled:
                log(
                    f"[launch] Slurm job {job} of an earlier launch of {workdir} is still {state} "
                    f"(its owner {owner.describe()} is gone): cancelling it first"
                )
                self._call(["scancel", job], f"cancelling leftover job {job}")
                cancelled = True
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"leftover Slurm job {job} in {workdir} did not end within "
                    f"{timeout_s:.0f}s of scancel; check `squeue -j {job}`"
                )
            self.sleep(self.config.slurm.poll_seconds)
        record.clear()

    def launch(self, spec_path: Path, workdir: Path, log: LogFn = print, *, on_start: OnStart = None) -> None:
        spec_path = check_spec(spec_path)
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        self.sweep(workdir, log)
        record = JobRecord(workdir, "slurm-job.json")
        job = self.submit(spec_path, workdir)
        record.write(job)
        logfile = workdir / f"slurm-{job}.log"
        log(f"[launch] submitted Slurm job {job}; log {logfile}")
        if on_start is not None:
            on_start(int(job))
        tail: collections.deque[str] = collections.deque(maxlen=40)
        first, summary = FirstError(), TorchrunSummary()
        offset, partial = 0, ""
        try:
            while True:
                state, code = self.state(job)
                if logfile.exists():  # stream what the job wrote since the last poll
                    with open(logfile, encoding="utf-8", errors="replace") as fh:
                        fh.seek(offset)
                        chunk = fh.read()
                        offset = fh.tell()
                    *lines, partial = (partial + chunk).split("\n")
                    for line in lines:
                        tail.append(line)
                        first.feed(line)
                        summary.feed(line)
                        log(line)
                if state in DONE or state in FAILED:
                    break
                self.sleep(self.config.slurm.poll_seconds)
        except BaseException:
            # Interrupted or cancelled: take the job down with us. The record stays: the next
            # launch checks that the job really ended.
            self.runner(["scancel", job])
            raise
        record.clear()  # the job ended by itself
        if partial:
            tail.append(partial)
            log(partial)
        if state not in DONE:
            rc, _, sig = code.partition(":")  # Slurm's ExitCode is "code:signal"
            facts = failure_facts(
                spec_path,
                workdir,
                summary,
                first,
                returncode=int(rc) if rc.lstrip("-").isdigit() else None,
                who=f"Slurm job {job}",
                state=state,
                signal_name=_signal_name(sig),
            )
            raise LaunchFailed(f"Slurm job {job} ended {state} (exit {code}); log {logfile}", tail, first.line, facts)
        log(f"[launch] Slurm job {job} completed")


def _signal_name(number: str) -> str | None:
    import signal

    try:
        return signal.Signals(int(number)).name if number and int(number) else None
    except ValueError:
        return None


# --- datatrove Slurm chains -----------------------------------------------------------------------

_FIELD = {name: re.compile(rf"\b{name}=(\S+)") for name in ("JobState", "Reason", "ArrayTaskId")}


def job_states(job: str, runner: Runner = _run) -> list[tuple[str, str]]:
    """(state, reason) of each record of a job (one per array task); [] once Slurm forgot it."""
    proc = runner(["scontrol", "show", "job", "-o", str(job)])
    if proc.returncode != 0:
        return []
    out = []
    for line in proc.stdout.splitlines():
        state, reason = _FIELD["JobState"].search(line), _FIELD["Reason"].search(line)
        if state:
            out.append((state.group(1), reason.group(1) if reason else "None"))
    return out


def wait_for_datatrove(
    executors: Sequence,
    poll_seconds: float = 60.0,
    *,
    runner: Runner = _run,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait for a chain of datatrove `SlurmPipelineExecutor`s launched by `executors[-1].run()`.

    Polling `get_incomplete_ranks()` alone waits forever when a stage fails: the next stage's
    `afterok` dependency can never be satisfied and Slurm keeps it pending. Here each stage's
    array job is checked too; a failed task (or a dependency that can never be satisfied) raises
    `LaunchFailed` naming the stage and its log folder, after cancelling the rest of the chain.
    Cancelling or interrupting the wait cancels the chain as well.
    """
    jobs = [(ex.job_name, str(ex.job_id), ex.logging_dir.path) for ex in executors if ex.job_id not in (None, -1, "-1")]
    try:
        while executors[-1].get_incomplete_ranks():
            for name, job, logs in jobs:
                for state, reason in job_states(job, runner):
                    if state in FAILED or reason == "DependencyNeverSatisfied":
                        why = "its dependency failed" if reason == "DependencyNeverSatisfied" else state
                        raise LaunchFailed(
                            f"datatrove stage {name!r} (Slurm job {job}) stopped: {why}; see "
                            f"{logs}/slurm_logs and {logs}/logs, fix the cause and rerun (finished "
                            "tasks are skipped)"
                        )
            sleep(poll_seconds)
    except BaseException:
        for _, job, _ in jobs:
            runner(["scancel", job])
        raise
