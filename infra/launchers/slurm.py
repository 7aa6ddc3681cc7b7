"""Slurm launcher: an sbatch script running `srun torchrun` (c10d rendezvous on the first node).

The rendered script asks for `nodes` whole nodes, one task per node (each runs one torchrun that
forks `procs_per_node` ranks) with the memory, CPUs and open-file limit (`ulimit -n`) the stage
plan needs where the recipe sets none (`LaunchConfig.sized`, model/host_memory.py), and rendezvouses every torchrun at the allocation's first host,
with the recipe's fabric, NCCL and rendezvous settings and rank-labelled output
(infra/launchers/fabric.py). The log is opened in append mode, so all attempts share one file.
With `accelerate_config`, each node's task runs `accelerate launch --config_file FILE
--machine_rank $SLURM_PROCID` with the same c10d rendezvous instead of torchrun (the rank is
expanded by the task's own shell).

A signal is a checkpoint (trainers/rank_signals.py): preemption and `scancel` signal the job's
processes (SIGTERM), and `--signal=B:USR1@signal_s` warns the batch shell before the time limit;
its trap forwards SIGUSR1 to the job's steps (`scancel --signal=USR1`), torchrun forwards what it
gets to the ranks, and every rank finishes its step, saves it and exits. The script waits for
srun, then requeues the job (`scontrol requeue`) after the time-limit warning or once preemption
has begun (a preempted job that ends by itself within GraceTime would otherwise count as ended),
unless the stage finished in this run. Every start runs the same spec and resumes from the newest
complete checkpoint, which is now the step the signal came at. Slurm's own requeues after node
failures, which Slurm does not bound, are counted by the script since the newest checkpoint and
refused past `slurm.max_node_requeues` (`_requeue_budget`).

`launch` submits with `sbatch --parsable --comment=TAG`, the script on stdin (the bytes rendered
in memory, not a file someone could swap before sbatch reads it; `launch/train.sbatch` is written
beside for people to read), then polls `scontrol show job` (no accounting database
needed) while streaming new log lines to the caller. The job is not a child of the flow process:
`launch/slurm-job.json` records it (and what it runs) until it ends. When the flow process dies
(SIGKILL, OOM, a login node rebooting), the job keeps training, and the next launch of the same
stage re-attaches to it: it follows the log from where it is and collects the result, submitting
nothing (a job that runs another script or spec is cancelled and replaced; one that ended while
nobody followed it is collected or, if it failed, resubmitted). Only an explicit stop (Ctrl-C, a
cancelled Prefect run: infra/launchers/follow.py) `scancel`s a job being followed; a controller
that does not answer for a while (`controller_grace_s`) is waited out.

The record is a file of the workspace, so it is checked before it acts: its job id must be a
Slurm job id (a positive integer, never `--me` or `4242; x`) of the cluster it records (job ids
are per cluster: a workspace on a file system shared by two clusters' login nodes would otherwise
make job 4242 of one cluster act as job 4242 of the other; `ClusterName` from `scontrol show
config`, recorded at submission), and a job is re-attached to or cancelled only when its comment
carries the stage's tag (`job_tag`: a digest of the stage folder and of what the record says the
job runs), which every submission sets. A record naming another cluster or a job that lacks the
tag (someone else's job, a job of another stage) is refused, naming the job and the record, and
nothing is done to that job. A record without a cluster (written before clusters were recorded,
or when `scontrol show config` did not answer at submission) is held to the tag alone.
"""

from __future__ import annotations

import collections
import hashlib
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from infra import manifest
from infra.launchers.base import (
    LAUNCHERS,
    FailureFacts,
    FirstError,
    JobRecord,
    LaunchConfig,
    Launcher,
    LaunchFailed,
    LogFn,
    OnStart,
    TorchrunSummary,
    accelerate_args,
    check_spec,
    failure_facts,
    launch_digest,
    stage_dir,
    stage_progress,
)
from infra.launchers.exclude import exclude_node, excluded_nodes
from infra.launchers.fabric import launch_env, torchrun_flags
from infra.launchers.follow import explicit_stop, following
from infra.launchers.peers import LostPeer
from infra.terminal import printable

Runner = Callable[..., subprocess.CompletedProcess]  # runner(cmd) or runner(cmd, input=text)
# Without `launch.master_port`, a job's rendezvous port is derived from its job id: the same on
# every node of the job (each computes it), another for a job sharing a node (without
# --exclusive: two jobs asking for torchrun's 29500 there collide), and below Linux's ephemeral
# range (32768-60999), so no client socket on the node holds it by chance: a store that cannot
# bind its port makes torchrun connect to whatever listens there instead, and wait.
JOB_PORT_BASE, JOB_PORT_SPAN = 20000, 10000


def job_port() -> str:
    """The batch script's shell arithmetic for its job's own rendezvous port."""
    return f"$(({JOB_PORT_BASE} + SLURM_JOB_ID % {JOB_PORT_SPAN}))"


RECORD = "slurm-job.json"  # launch/slurm-job.json: the job of this stage (base.py JobRecord)

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
# End states a requeueable job (--requeue) passes through on its way back to PENDING.
REQUEUED_FROM = {"PREEMPTED", "NODE_FAIL", "BOOT_FAIL"}
# Job states that mean a node of the allocation failed (the nodes are found with `failed_nodes`).
NODE_LOST = {"NODE_FAIL", "BOOT_FAIL"}
# `sinfo %t` states of a node Slurm took out of service (a trailing `*`: not responding).
NODE_DOWN = {"down", "drain", "drng", "fail", "failg"}


class JobGone(LaunchFailed):
    """Slurm no longer knows the job: it ended long ago (purged) or never existed."""


def _run(cmd: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=120)


_JOB_ID = re.compile(r"[1-9][0-9]{0,9}")  # Slurm job ids are 32-bit unsigned integers
_COMMENT = re.compile(r"(?:^|\s)Comment=(\S*)")
_NODE_LIST = re.compile(r"(?:^|\s)NodeList=(\S+)")
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")  # srun's line when a node of the job fails
# the batch script's refusal past launch.slurm.max_node_requeues (`_requeue_budget`)
_REFUSED = re.compile(r"^error: (Slurm requeued job \d+ \d+ times after node failures .*)$")
_CLUSTER_NAME = re.compile(r"^ClusterName\s*=\s*(\S+)\s*$", re.MULTILINE)  # `scontrol show config`
_CLUSTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # what slurm.conf's ClusterName may be


class BadJobRecord(LaunchFailed):
    """A job record that must not act: its job id is not one, or its job is not this stage's."""


def job_id(value: object, record: Path) -> str:
    """The job id a record names, checked: a positive integer (`4242`), never an option
    (`--me`) or a shell line; raises BadJobRecord naming the record."""
    if isinstance(value, int | str) and not isinstance(value, bool) and _JOB_ID.fullmatch(str(value)):
        return str(value)
    raise BadJobRecord(
        f"{record}: job {printable(value)!r} is not a Slurm job id (a positive integer); no launch "
        "writes that: nothing was run for it. Delete the record after checking `squeue --me`"
    )


def cluster_of(config_text: str) -> str | None:
    """The `ClusterName` of `scontrol show config` output, None when it names none."""
    m = _CLUSTER_NAME.search(config_text)
    return m.group(1) if m and _CLUSTER.fullmatch(m.group(1)) else None


def job_tag(workdir: Path, digest: str | None) -> str:
    """The comment a job of this stage folder carries (`--comment`), for what it runs (`digest`)."""
    h = hashlib.sha256(f"{Path(workdir).resolve()}\0{digest or ''}".encode()).hexdigest()
    return f"smollm3-{h[:24]}"


def comment_of(scontrol_line: str) -> str | None:
    """The `Comment=` of one `scontrol show job -o` line (None when it has none)."""
    m = _COMMENT.search(scontrol_line)
    return m.group(1) if m and m.group(1) != "(null)" else None


def sbatch_resources(c: LaunchConfig, job_name: str, nodes: int, time_limit: str) -> list[tuple[str, str | None]]:
    """The `#SBATCH` options every job of a launch shares (name, nodes with one task each, GPUs,
    CPUs, memory, partition, account, QoS, time limit, exclusivity), in script order: the trainer's
    job, a helper pool's and the preflight job's (infra/preflight/cluster.py) add their own."""
    s = c.slurm
    sb: list[tuple[str, str | None]] = [("job-name", job_name), ("nodes", str(nodes)), ("ntasks-per-node", "1")]
    if c.gpus_per_node:
        sb.append(("gpus-per-node", str(c.gpus_per_node)))
    if s.cpus_per_task:
        sb.append(("cpus-per-task", str(s.cpus_per_task)))
    for key, value in (("mem", s.mem), ("partition", s.partition), ("account", s.account), ("qos", s.qos)):
        if value is not None:
            sb.append((key, value))
    sb.append(("time", time_limit))
    if s.exclusive:
        sb.append(("exclusive", None))
    return sb


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
        sb = sbatch_resources(c, s.job_name, c.nodes, s.time)  # one torchrun per node; it forks the ranks
        if excluded := excluded_nodes(workdir):  # nodes earlier attempts failed on (infra/launchers/exclude.py)
            sb.append(("exclude", ",".join(excluded)))
        if s.requeue:
            sb += [("requeue", None), ("signal", f"B:USR1@{s.signal_s}")]
        else:  # whatever the cluster's JobRequeue default: a failed node then fails the job
            sb.append(("no-requeue", None))
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
        if s.open_files:
            # every rank's data shards, libraries, sockets and checkpoint files (model/host_memory.py);
            # srun passes the batch shell's limits to the tasks (PropagateResourceLimits, default ALL)
            n = s.open_files
            lines += [
                f'if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt {n} ]; then',
                f'  ulimit -n {n} || {{ echo "error: cannot raise the open-file limit to {n} (hard limit '
                f"$(ulimit -Hn)): raise it on the nodes or lower launch.slurm.open_files / "
                f'training.loader.open_shards" >&2; exit 1; }}',
                "fi",
            ]
        labels = not c.accelerate_config  # accelerate's own launcher prints its progress marks unlabelled
        env = {"OMP_NUM_THREADS": "1"} | launch_env(c.fabric, c.rendezvous, labels=labels)
        env |= dict(c.env)
        lines += [f'export PYTHONPATH={shlex.quote(str(code))}"${{PYTHONPATH:+:$PYTHONPATH}}"']
        lines += ["# fabric, NCCL error handling and timeouts, stop signals (infra/launchers/fabric.py)"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
        port = c.master_port or job_port()
        torchrun = [
            shlex.quote(c.torchrun),  # every recipe string here is quoted, besides its check (launchers/text.py)
            '--nnodes="$SLURM_JOB_NUM_NODES"',
            f"--nproc-per-node={c.procs_per_node}",
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
            '--rdzv-id="$SLURM_JOB_ID"',
            *torchrun_flags(c.rendezvous, shlex.quote(str(workdir / "logs" / "ranks")) if labels else None),
            "--max-restarts=0",  # a rank failure fails the job; Slurm's requeue restarts it whole
            f"-m {shlex.quote(c.module)} {shlex.quote(str(spec))}",
        ]
        lines += [
            # srun does not inherit --cpus-per-task from sbatch since Slurm 22.05
            'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"started={shlex.quote(str(workdir / 'launch'))}/.started-$SLURM_JOB_ID",
            'touch "$started"  # result.json newer than this: the stage finished in this run',
            f"MASTER_PORT={port}",
            'echo "[launch] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on '
            '$SLURM_JOB_NUM_NODES node(s) $SLURM_JOB_NODELIST; rendezvous $MASTER_ADDR:$MASTER_PORT"',
        ]
        if s.requeue:
            lines += self._requeue_budget(workdir, _out_dir(spec, workdir) / "checkpoints")
        lines += [
            # Stop signals (trainers/rank_signals.py): every rank finishes its step, saves it and exits
            # 75; this script waits for srun to end. Preemption and scancel signal the job's
            # processes themselves (SIGTERM); the time-limit warning (--signal=B:USR1) reaches
            # only this shell, which forwards it to the job's steps and requeues once they saved.
            'stop=""',
            "forward() {",
            '  stop=$1; echo "[launch] $1: the ranks finish their step and save it '
            f'(torchrun waits {c.rendezvous.stop_grace_s}s for them)"',
            *(
                [
                    "  # the time limit's warning or a preemption: the requeue that follows loses no step,",
                    "  # it is not one of Slurm's own requeues after a node failure (the budget above)",
                    '  if [ "$1" = USR1 ] || scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -q "PreemptTime=[0-9]"; '
                    'then echo "planned $restart" >> "$requeues"; fi',
                ]
                if s.requeue
                else []
            ),
            '  scancel --signal=USR1 "$SLURM_JOB_ID" 2>/dev/null || true  # every step of the job, not this shell',
            "}",
            "trap 'forward USR1' USR1",
            "trap 'forward TERM' TERM",
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
            "srun_pid=$!  # in the background, so the traps run while training",
            "rc=0",
            "# a trap interrupts `wait`: wait again until srun itself has ended",
            'while :; do wait "$srun_pid"; rc=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
            'echo "[launch] srun exited with code $rc"',
        ]
        result = _out_dir(spec, workdir) / "result.json"
        lines += [
            f"result={shlex.quote(str(result))}",
            # The stage finished in this run (result.json is written after its last checkpoint,
            # by every rank's agreement): a signal that came while torchrun was exiting is late.
            'if [ "$result" -nt "$started" ] && [ "$rc" -ne 0 ]; then',
            '  echo "[launch] the stage had finished (result.json) when srun ended with $rc: exit 0"; rc=0',
            "fi",
        ]
        if s.requeue:
            # A preempted job that ends by itself within GraceTime counts as ended, not
            # requeued: requeue it here too (PreemptTime is set once preemption began).
            lines += [
                'if [ "$result" -nt "$started" ]; then why=""  # finished: a late signal changes nothing',
                'elif [ "$stop" = USR1 ]; then why="time limit near"',
                'elif scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -q "PreemptTime=[0-9]"; then why="preempted"',
                'else why=""; fi',
                'if [ -n "$why" ]; then',
                '  echo "[launch] $why: requeueing $SLURM_JOB_ID; the next start resumes at the saved step"',
                # slurmctld may not answer in its MessageTimeout on a loaded controller: ask again,
                # saying why (the follower also asks once if the job stays FAILED: `follow`)
                "  for try in 1 2 3 4 5; do",
                '    out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1) && break',
                '    echo "[launch] scontrol requeue $SLURM_JOB_ID failed (try $try of 5): $out"; sleep 5',
                "  done",
                "fi",
            ]
        lines += ["exit $rc", ""]
        return "\n".join(lines)

    def _requeue_budget(self, workdir: Path, checkpoints: Path) -> list[str]:
        """Script lines bounding Slurm's own requeues of the job after node failures.

        Slurm requeues a `--requeue` job whose node failed at once and without bound (its
        `MaxBatchRequeue` counts batch launch failures, not these; docs/scale.md), and no step
        retry sees it. Each start reads `SLURM_RESTART_COUNT`: a restart that did not follow a
        planned stop (the time limit's warning, a preemption: `forward` writes `planned N` when
        restart N gets one) was Slurm's own, after a node failure, and is counted, the count
        starting over whenever the stage saved a newer checkpoint in between (a month with a
        few node failures spread over it never reaches the budget; a storm of them without
        progress does). Past `slurm.max_node_requeues` the script refuses to train again: the job
        fails with an `error:` line, which the step does not retry (not transient)."""
        n = self.config.slurm.max_node_requeues
        launch_dir = shlex.quote(str(workdir / "launch"))
        return [
            f"requeues={launch_dir}/requeues-$SLURM_JOB_ID  # this job's planned stops and node-failure count",
            "restart=${SLURM_RESTART_COUNT:-0}",
            # the newest complete checkpoint (its marker is written last: infra/manifest.py)
            f"newest=$(ls -1 {shlex.quote(str(checkpoints))}/step_*/{manifest.MARKER} 2>/dev/null | sort | tail -n 1)",
            f'newest="${{newest%/{manifest.MARKER}}}"',
            'if [ "$restart" -gt 0 ] && ! grep -qx "planned $((restart - 1))" "$requeues" 2>/dev/null; then',
            '  count=0; since=""',
            '  if [ -f "$requeues.count" ]; then read -r count since < "$requeues.count" || true; fi',
            '  if [ "$newest" != "$since" ]; then count=0; fi  # a newer checkpoint since: the count starts over',
            "  count=$((count + 1))",
            '  echo "$count $newest" > "$requeues.count"',
            '  echo "[launch] Slurm requeued job $SLURM_JOB_ID by itself (restart $restart: a node failure), '
            f'$count time(s) since checkpoint ${{newest:-none}}; at most {n} (launch.slurm.max_node_requeues)"',
            f'  if [ "$count" -gt {n} ]; then',
            '    echo "error: Slurm requeued job $SLURM_JOB_ID $count times after node failures without a new '
            f"checkpoint (launch.slurm.max_node_requeues is {n}): not training again; check the nodes "
            '(sinfo -R) and the log, then rerun the stage" >&2',
            "    exit 1",
            "  fi",
            "fi",
        ]

    # -- a helper pool beside the trainer's job (infra/launchers/pool.py) --

    def render_pool(self, pool, workdir: Path) -> str:
        """A separate job of `pool.nodes` nodes, one task per node, each running the pool's
        command with its node index (`$SLURM_PROCID`, expanded by the task's own shell). Same
        partition, account, time, setup and environment as the trainer's job; never requeued by
        Slurm (the step's launch resubmits it while the trainer runs: PoolRunner)."""
        c, s = self.config, self.config.slurm
        workdir = Path(workdir).resolve()
        code = c.code_path
        # one pool node process per node; it starts the workers
        sb = sbatch_resources(c, f"{s.job_name}-{pool.name}", pool.nodes, s.time)
        sb += [
            ("no-requeue", None),
            ("open-mode", "append"),
            ("output", str(workdir / f"{pool.name}-%j.log")),
            ("chdir", str(code)),
        ]
        sb += sorted(s.sbatch_args.items())
        lines = [
            "#!/bin/bash",
            f"# The {pool.name} pool of a smollm3 step, rendered by infra/launchers/slurm.py: re-render, do not edit.",
            f"# Beside the trainer's job in {workdir}; they meet in its folder on the shared file system.",
        ]
        lines += [f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in sb]
        lines += ["", *s.setup, "set -uo pipefail"]
        lines += [f'export PYTHONPATH={shlex.quote(str(code))}"${{PYTHONPATH:+:$PYTHONPATH}}"']
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(({"OMP_NUM_THREADS": "1"} | dict(c.env)).items())]
        inner = shlex.join(pool.argv(c.python, "__NODE__")).replace("__NODE__", '"$SLURM_PROCID"')
        lines += [
            'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
            f'echo "[pool] job $SLURM_JOB_ID: {pool.name} pool on $SLURM_JOB_NUM_NODES node(s) $SLURM_JOB_NODELIST"',
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\",
            "  bash -c " + shlex.quote("exec " + inner),
            "rc=$?",
            'echo "[pool] srun exited with code $rc"',
            "exit $rc",
            "",
        ]
        return "\n".join(lines)

    def submit_pool(self, pool, workdir: Path, log: LogFn = print) -> str:
        """sbatch the pool's script (`launch/{name}.sbatch`); a pool job of this step that an
        earlier launch left running with the same script is followed instead, one with another
        script cancelled first (the trainer's rules: `reattach`)."""
        workdir = Path(workdir).resolve()
        text = self.render_pool(pool, workdir)
        digest = hashlib.sha256(text.encode()).hexdigest()
        record = f"slurm-{pool.name}.json"
        job = self.reattach(workdir, digest, log, record_name=record)
        if job is None:
            script = workdir / "launch" / f"{pool.name}.sbatch"
            job = self.submit(script, workdir, text, tag=job_tag(workdir, digest), script=script)
            JobRecord(workdir, record).write(job, digest, cluster=self.cluster())
        return job

    def pool_state(self, pool, handle: str) -> str | None:
        try:
            state, code = self.state(handle)
        except JobGone:
            return "is gone from Slurm"
        if state in DONE:
            return "completed"
        return f"ended {state} (exit {code})" if state in FAILED else None

    def cancel_pool(self, pool, handle: str, workdir: Path) -> None:
        self.runner(["scancel", handle])  # one that ended already: nothing to do
        JobRecord(Path(workdir).resolve(), f"slurm-{pool.name}.json").clear()

    def describe_pool(self, pool, handle: str) -> str:
        nodes = "1 node" if pool.nodes == 1 else f"{pool.nodes} nodes"
        return f"{pool.name} pool Slurm job {handle} ({nodes})"

    # -- submission and monitoring --

    def _call(self, cmd: Sequence[str], what: str, input: str | None = None) -> str:
        try:
            proc = self.runner(cmd) if input is None else self.runner(cmd, input=input)
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

    def submit(
        self,
        spec_path: Path,
        workdir: Path,
        script_text: str | None = None,
        tag: str | None = None,
        script: Path | None = None,
    ) -> str:
        """sbatch the script (on stdin: what is submitted is these bytes, whatever happens to
        the copy written into `workdir/launch/` for people to read: `script`, by default
        `train.sbatch`), with comment `tag`; returns the job id."""
        text = script_text if script_text is not None else self.render(spec_path, workdir)
        script = script or self.script_path(workdir)
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        cmd = ["sbatch", "--parsable", *([f"--comment={tag}"] if tag else [])]
        out = self._call(cmd, f"submitting {script} (from memory)", input=text)
        job = out.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"
        if not _JOB_ID.fullmatch(job):
            raise LaunchFailed(f"sbatch printed {out.strip()!r} instead of a job id for {script}")
        return job

    def cluster(self) -> str | None:
        """This machine's Slurm cluster (`ClusterName` of `scontrol show config`), None when
        the controller does not say."""
        try:
            proc = self.runner(["scontrol", "show", "config"])
        except (OSError, subprocess.SubprocessError):
            return None
        return cluster_of(proc.stdout or "") if proc.returncode == 0 else None

    def _check_cluster(self, job: str, recorded: object, record: Path) -> None:
        """Raise BadJobRecord unless the record's cluster is this machine's (a record without
        one is left to the tag check)."""
        if recorded is None:
            return
        if not isinstance(recorded, str) or not _CLUSTER.fullmatch(recorded):
            raise BadJobRecord(
                f"{record}: cluster {printable(recorded)!r} is not a Slurm cluster name; no launch writes "
                f"that: nothing was run for job {job}. Delete the record after checking `squeue --me`"
            )
        here = self.cluster()
        if here is None:
            raise LaunchFailed(
                f"{record} names Slurm job {job} of cluster {recorded}, and `scontrol show config` names "
                "no cluster here (the controller did not answer?): nothing was done to the job; retry"
            )
        if here != recorded:
            raise BadJobRecord(
                f"{record} names Slurm job {job} of cluster {recorded}, but this machine's cluster is "
                f"{here}: job ids are per cluster, so job {job} here is another job, neither followed "
                f"nor cancelled. Launch from a login node of {recorded}, or delete the record after "
                f"checking `squeue -M {recorded} -j {job}`"
            )

    def state(self, job: str) -> tuple[str, str]:
        """(state, exit code) of a job, from scontrol (no accounting database needed).

        Raises `JobGone` when neither scontrol nor sacct knows the job, `LaunchFailed` when the
        controller did not answer (the job may well be running)."""
        proc = self.runner(["scontrol", "show", "job", "-o", job])
        if proc.returncode == 0 and "JobState=" in proc.stdout:
            state = re.search(r"JobState=(\S+)", proc.stdout).group(1)
            code = re.search(r"ExitCode=(\S+)", proc.stdout)
            return state, code.group(1) if code else "?"
        unknown = "Invalid job id" in (proc.stderr or "") + (proc.stdout or "")
        # Purged from slurmctld's memory (MinJobAge): ask accounting, if the site has it.
        acct = self.runner(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job])
        if acct.returncode == 0 and acct.stdout.strip():
            state, _, code = acct.stdout.strip().splitlines()[0].partition("|")
            return state.split()[0], code
        if unknown:
            raise JobGone(f"Slurm no longer knows job {job} (scontrol: invalid job id; no accounting record)")
        raise LaunchFailed(
            f"cannot find Slurm job {job} in scontrol or sacct ({(proc.stderr or proc.stdout).strip()[:200]}); "
            "check `squeue --me` and the job log"
        )

    def reattach(
        self, workdir: Path, digest: str, log: LogFn = print, timeout_s: float = 600.0, record_name: str = RECORD
    ) -> str | None:
        """The job an earlier launch of this stage left running, now followed by this one; None
        when there is none to follow (a new job must be submitted).

        The recorded job is re-attached to when it still runs the same script and spec
        (`digest`) and has not ended; one that completed while nobody followed it is followed to
        collect its result. One that runs something else (the spec or launch changed) is
        cancelled first and waited for: two jobs in one stage folder would write the same
        checkpoints and metrics. Refuses while the recorded owner is still alive on this host.
        """
        record = JobRecord(workdir, record_name)
        found = record.read()
        if found is None:
            return None
        raw = record.raw()
        job, owner = job_id(raw["job"], record.path), found[1]
        if record.live_owner() is not None:
            raise LaunchFailed(
                f"stage folder {workdir} already has Slurm job {job}, launched by "
                f"{owner.describe()} which is still running; wait for it, or `scancel {job}`"
            )
        try:
            state, _ = self.state(job)
        except JobGone:
            record.clear()  # it ended long ago
            return None
        if state in FAILED:
            log(
                f"[launch] Slurm job {job} of an earlier launch of {workdir} ended {state} while no launch "
                "followed it; submitting a new one (it resumes from the newest checkpoint)"
            )
            record.clear()
            return None
        self._check_cluster(job, raw.get("cluster"), record.path)  # this cluster's job id...
        self._check_tag(job, job_tag(workdir, record.digest), record.path)  # ...and ours, before acting on it
        if record.digest == digest:
            record.attach()
            what = "completed while no launch followed it" if state in DONE else f"is still {state}"
            log(
                f"[launch] re-attaching to Slurm job {job}, which {what} (submitted by "
                f"{owner.describe()}, gone); following its log from where it is, submitting nothing"
            )
            return job
        log(
            f"[launch] Slurm job {job} of an earlier launch of {workdir} is still {state} but runs another "
            "script or spec than this launch: cancelling it first"
        )
        self._call(["scancel", job], f"cancelling leftover job {job}")
        deadline = time.monotonic() + timeout_s
        while state not in DONE and state not in FAILED:
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"leftover Slurm job {job} in {workdir} did not end within "
                    f"{timeout_s:.0f}s of scancel; check `squeue -j {job}`"
                )
            self.sleep(self.config.slurm.poll_seconds)
            try:
                state, _ = self.state(job)
            except JobGone:
                break
        record.clear()
        return None

    def launch(self, spec_path: Path, workdir: Path, log: LogFn = print, *, on_start: OnStart = None) -> None:
        spec_path = check_spec(spec_path)
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        script = self.render(spec_path, workdir)
        digest = launch_digest(script, spec_path)
        job = self.reattach(workdir, digest, log)
        logfile = workdir / f"slurm-{job}.log"
        offset = logfile.stat().st_size if job is not None and logfile.exists() else 0  # from where it is
        if job is None:
            job = self.submit(spec_path, workdir, script, tag=job_tag(workdir, digest))
            JobRecord(workdir, RECORD).write(job, digest, cluster=self.cluster())
            logfile = workdir / f"slurm-{job}.log"
            log(f"[launch] submitted Slurm job {job}; log {logfile}")
        if on_start is not None:
            on_start(int(job))
        self.follow(job, spec_path, workdir, log, offset)

    def follow(self, job: str, spec_path: Path, workdir: Path, log: LogFn, offset: int = 0) -> None:
        """Stream the job's log from `offset` until the job ends; raise LaunchFailed unless it
        completed. Interrupted by an explicit cancellation (Ctrl-C, a cancelled Prefect run) the
        job is cancelled; by anything else it is left running for a retry to re-attach to."""
        record = JobRecord(workdir, RECORD)
        logfile = workdir / f"slurm-{job}.log"
        tail: collections.deque[str] = collections.deque(maxlen=40)
        first, summary, lost = FirstError(), TorchrunSummary(), LostPeer()
        partial, unanswered, settling = "", None, 0
        lost_nodes: list[str] = []  # nodes the job's log says failed (`srun: error: Node failure on X`)
        refused: str | None = None  # the script's refusal past the node-failure requeue budget
        requeueing = False  # the script said it requeues the job (time limit, preemption)
        failed_since: float | None = None  # when a requeueing job was first seen FAILED
        asked_requeue = False  # the follower asked `scontrol requeue` itself (the job stayed FAILED)
        requeued_as: str | None = None  # Slurm's restart count when it had requeued a job shown FAILED
        restart: int | None = None  # the restart count of the start the log shows last ("[launch] job J (restart N)")
        excluded_from = 0  # lost_nodes[:excluded_from] are excluded from the job already
        with following(f"Slurm job {job}", lambda: self.runner(["scancel", job])) as handle:
            try:
                while True:
                    try:
                        state, code = self.state(job)
                        unanswered = None
                    except JobGone:
                        record.clear()
                        raise
                    except LaunchFailed:  # the controller is busy or restarting: the job is not gone
                        unanswered = unanswered or time.monotonic()
                        if time.monotonic() - unanswered > self.config.slurm.controller_grace_s:
                            raise
                        state, code = "UNKNOWN", "?"
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
                            lost.feed(line)
                            if (failed := _NODE_FAILURE.search(line)) and failed.group(1) not in lost_nodes:
                                lost_nodes.append(failed.group(1))
                            if m := _REFUSED.match(line.strip()):
                                refused = m.group(1)
                            if f": requeueing {job};" in line:
                                requeueing = True
                            elif line.startswith(f"[launch] job {job} "):  # the next start
                                requeueing = False
                                if m := re.match(rf"\[launch\] job {job} \(restart (\d+)\)", line):
                                    restart = int(m.group(1))
                            log(line)
                    if state in REQUEUED_FROM and settling < 3 and self._requeues(job):
                        if state in NODE_LOST and settling == 0:  # seen before it is pending again:
                            # the nodes Slurm holds down, when srun's log names none (or not all)
                            lost_nodes += [n for n, _ in self.failed_nodes(job) if n not in lost_nodes]
                        settling += 1  # Slurm puts it back in the queue right after: keep following
                    elif (
                        state in FAILED
                        and requeueing
                        and (waited := self._failed_for(failed_since))
                        < (window := max(120.0, 20 * self.config.slurm.poll_seconds))
                    ):
                        # the script asked `scontrol requeue` and exited: Slurm may show the job
                        # FAILED for a while before it is pending again (seconds at load ~5, longer
                        # than 10 polls of 0.5 s once). Still FAILED after half the window: the
                        # script's requeue did not take (a controller too busy to answer it, seen
                        # once at load ~6); a finished batch job may be requeued, so ask once here.
                        failed_since = failed_since or time.monotonic()
                        if waited >= window / 2 and not asked_requeue:
                            asked_requeue = True
                            requeued_as = self._requeue_after_script(job, log, restart)
                    elif state in DONE or state in FAILED:
                        break
                    else:
                        settling, failed_since = 0, None
                        if state != "UNKNOWN" and state not in FAILED:
                            asked_requeue, requeued_as = False, None  # a later stop may need it again
                        if state == "PENDING" and len(lost_nodes) > excluded_from:
                            # requeued in place after a node failure (often seen only as PENDING
                            # again): keep the job off the nodes its log says failed
                            self._exclude_in_place(job, lost_nodes[excluded_from:], workdir, log)
                            excluded_from = len(lost_nodes)
                    self.sleep(self.config.slurm.poll_seconds)
                    handle.check()
            except BaseException as exc:
                self._interrupted(job, exc, log)
                raise
        record.clear()  # the job ended by itself
        if partial:
            tail.append(partial)
            log(partial)
        if state not in DONE and refused is not None:
            # The script refused to train again: this, not what the killed starts before it
            # printed (a stop signal, a lost peer), is how the job ended; not retried.
            last_step, checkpoint_step = stage_progress(spec_path, workdir)
            facts = FailureFacts(
                who=f"Slurm job {job}",
                exitcode=1,
                error=refused,
                state=state,
                last_step=last_step,
                checkpoint_step=checkpoint_step,
            )
            raise LaunchFailed(f"Slurm job {job} ended {state} (exit {code}); log {logfile}", tail, refused, facts)
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
                lost=lost,
            )
            if state in NODE_LOST and facts.node is None:  # the job's log and Slurm's node states name them
                facts = self._lost_nodes(job, facts, lost_nodes)
            facts = exclude_node(workdir, facts, self.config.max_excluded_nodes, log)
            why = f"Slurm job {job} ended {state} (exit {code}); log {logfile}"
            if requeueing and requeued_as is not None:
                why += (
                    f"; Slurm had requeued it (Restarts={requeued_as}) after its script saved the step, but the "
                    "next start never ran: slurmctld's log for the job says why (a requeued job released "
                    "before its hold ends is refused as `Job credential revoked`)"
                )
            raise LaunchFailed(why, tail, first.line, facts)
        log(f"[launch] Slurm job {job} completed")

    def _check_tag(self, job: str, tag: str, record: Path) -> None:
        """Raise BadJobRecord unless Slurm says job `job` carries comment `tag`."""
        proc = self.runner(["scontrol", "show", "job", "-o", job])
        found = comment_of(proc.stdout or "") if proc.returncode == 0 else None
        if found is None and proc.returncode != 0:  # purged from slurmctld: accounting keeps comments
            acct = self.runner(["sacct", "-n", "-X", "-P", "-o", "Comment", "-j", job])
            lines = (acct.stdout or "").strip().splitlines() if acct.returncode == 0 else []
            found = lines[0].strip() if lines else None
        if found != tag:
            raise BadJobRecord(
                f"{record} names Slurm job {job}, whose comment is not this stage's tag {tag}: it was not "
                "submitted by a launch of this stage, so it is neither followed nor cancelled. Check "
                f"`squeue -j {job}`, then delete the record"
            )

    def failed_nodes(self, job: str) -> list[tuple[str, str | None]]:
        """The nodes a job ended NODE_FAIL (or BOOT_FAIL) on, each with what Slurm says of it:
        every node of its allocation (`scontrol show job` NodeList, else accounting's `sacct -o
        NodeList`) that Slurm now holds down, drained, failing or not responding (`sinfo -N -o
        "%N %t %E"`: `("node-2", "Slurm: down*, Not responding")`); the healthy nodes of the
        allocation are not among them. When none is (a node that rebooted and registered is back
        in service), a one-node job's node with no word (it can only have lost that one); [] when
        Slurm names none (several nodes all back, or a purged job on a site without accounting)."""
        proc = self.runner(["scontrol", "show", "job", "-o", job])
        found = _NODE_LIST.search(proc.stdout or "") if proc.returncode == 0 else None
        nodes = found.group(1) if found else None
        if nodes in (None, "(null)"):
            acct = self.runner(["sacct", "-n", "-X", "-P", "-o", "NodeList", "-j", job])
            lines = (acct.stdout or "").split() if acct.returncode == 0 else []
            nodes = lines[0] if lines else None
        if not nodes or nodes in ("(null)", "None"):
            return []
        info = self.runner(["sinfo", "-h", "-N", "-n", nodes, "-o", "%N %t %E"])
        down: dict[str, str] = {}  # sinfo -N lists a node once per partition: once here
        for line in (info.stdout or "").splitlines() if info.returncode == 0 else []:
            name, state, reason = (line.strip().split(None, 2) + ["", ""])[:3]
            flags = state.lower()
            if name and name not in down and (flags.endswith("*") or flags.rstrip("~#!%$@^-") in NODE_DOWN):
                said = f"Slurm: {flags}" + (
                    f", {' '.join(reason.split())[:120]}" if reason and reason != "none" else ""
                )
                down[name] = said
        if down:
            return list(down.items())
        # Back in service already (a node that rebooted and registered): a one-node job can only
        # have lost its one node; of several, Slurm no longer says which.
        return [(nodes, None)] if re.fullmatch(r"[^\[\],]+", nodes) else []

    def _lost_nodes(self, job: str, facts: FailureFacts, logged: list[str]) -> FailureFacts:
        """`facts` of a job that ended NODE_FAIL with every node it lost: those srun's log named
        (`Node failure on X`, the last one blamed first) and those Slurm holds down; each with
        Slurm's word on it when it has one."""
        said = dict(self.failed_nodes(job))
        for node in reversed(logged):
            said.setdefault(node, "srun: Node failure")
        if not said:
            return facts
        order = [*reversed(logged), *(n for n in said if n not in logged)]
        words = [f"{n} ({said[n]})" if said[n] else n for n in order]
        if len(order) == 1:
            clause = f"node {order[0]} failed ({said[order[0]]})" if said[order[0]] else None  # None: "node X failed"
        else:
            clause = f"nodes {', '.join(words)} failed"
        return replace(facts, node=order[0], more_nodes=tuple(order[1:]), node_lost=clause)

    def _exclude_in_place(self, job: str, failed: list[str], workdir: Path, log: LogFn) -> None:
        """Add the nodes a job Slurm requeued lost to the stage's excluded nodes, and keep the
        pending job off all of them (ExcNodeList can change only while it is pending)."""
        nodes: tuple[str, ...] = ()
        for node in failed:
            facts = FailureFacts(who=f"Slurm job {job}", state="NODE_FAIL", node=node)
            nodes = exclude_node(workdir, facts, self.config.max_excluded_nodes, log).excluded
        if not nodes:
            return
        proc = self.runner(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}"])
        if proc.returncode == 0:
            log(f"[launch] Slurm requeued job {job} in place; it now excludes {', '.join(nodes)}")
        else:
            log(
                f"[launch] WARNING: could not exclude {', '.join(nodes)} from requeued Slurm job {job} "
                f"({(proc.stderr or proc.stdout).strip()[:200]}); Slurm keeps down nodes out by itself"
            )

    @staticmethod
    def _failed_for(since: float | None) -> float:
        """Seconds since a requeueing job was first seen FAILED (0 when it is seen so now)."""
        return 0.0 if since is None else time.monotonic() - since

    def _requeue_after_script(self, job: str, log: LogFn, restart: int | None) -> str | None:
        """Requeue a job that stayed FAILED after its batch script said it requeues it (the time
        limit's warning or preemption, after the step was saved): the next start resumes there.
        Not when Slurm counts more restarts than `restart`, the start that said it (None: not in
        the part of the log this launch followed): the script's requeue took and the job only
        shows FAILED until it is pending again. A second requeue then made restart N+2, which the
        next start's budget check read as Slurm's own requeue after a node failure (seen once in
        a serial `make test`: that start had been released by the test before its hold ended and
        slurmd refused it, `Job credential revoked`, so the job stayed FAILED). Returns Slurm's
        restart count in that case (the launch's error then says the next start never ran),
        else None."""
        shown = self.runner(["scontrol", "show", "job", "-o", job])
        m = re.search(r"\bRestarts=(\d+)", shown.stdout or "")
        if m and restart is not None and int(m.group(1)) > restart:
            log(f"[launch] job {job} shows FAILED but Slurm has requeued it (Restarts={m.group(1)}): not asked again")
            return m.group(1)
        proc = self.runner(["scontrol", "requeue", job])
        said = ((proc.stderr or "") + (proc.stdout or "")).strip()[:200]
        if proc.returncode == 0:
            log(f"[launch] job {job} stayed FAILED after its script asked for a requeue: requeued it from here")
        else:
            log(
                f"[launch] job {job} stayed FAILED after its script asked for a requeue; `scontrol requeue` here failed: {said}"
            )
        return None

    def _requeues(self, job: str) -> bool:
        """Whether Slurm requeues this job by itself after preemption or a node failure."""
        proc = self.runner(["scontrol", "show", "job", "-o", job])
        return proc.returncode == 0 and "Requeue=1" in proc.stdout

    def _interrupted(self, job: str, exc: BaseException, log: LogFn) -> None:
        """Cancel the job on an explicit stop; otherwise leave it (and its record) for a retry."""
        if isinstance(exc, JobGone):
            return
        if explicit_stop(exc):
            self.runner(["scancel", job])
            note = f"[launch] cancelled Slurm job {job} ({type(exc).__name__})"
        else:
            note = (
                f"[launch] stopped following Slurm job {job} ({type(exc).__name__}: {exc}); it keeps running: "
                f"a retry of this step re-attaches to it, `scancel {job}` stops it"
            )
        try:
            log(note)
        except Exception:
            pass  # the logger may be what failed


def _out_dir(spec: Path, workdir: Path) -> Path:
    """Where the trainer writes result.json: the spec's out_dir, else the stage folder."""
    return stage_dir(spec, workdir)


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
