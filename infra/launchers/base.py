"""Launchers: how one training stage (`python -m trainers.pretrain SPEC.json`) becomes processes.

A launcher takes a resolved stage spec and a work folder and runs the trainer to completion on
some substrate: this machine (torchrun), a Slurm allocation (sbatch + srun torchrun), or
Kubernetes (a Kubeflow PyTorchJob). The trainer is any module taking one spec path (`module`):
pretraining stages run `trainers.pretrain`, post-training steps `trainers.posttrain`. With
`accelerate_config` the ranks start through `accelerate launch --config_file FILE` instead of
plain torchrun (same rendezvous and process counts; the file picks FSDP, DeepSpeed ZeRO or mixed
precision for Hugging Face trainers). The interface is the same for all of them:

    launcher = get_launcher(config)                  # config: LaunchConfig (the recipe's `launch`)
    launcher.render(spec_path, workdir)  -> str      # what would be submitted (script, manifest)
    launcher.launch(spec_path, workdir, log)         # blocks until done; raises LaunchFailed

Resumption is the trainer's job, not the launcher's: every launch of the same spec continues from
the newest complete checkpoint in the spec's out_dir, so a Slurm requeue, a pod restart or a rerun
from the Prefect UI all resume without the launcher knowing where training stopped. A stop signal
(time limit, preemption, eviction) makes that checkpoint the step the signal came at
(trainers/rank_signals.py, exit code 75). Cluster jobs outlive the process that launched them: the job
record (`JobRecord`) lets the next launch re-attach instead of submitting again
(infra/launchers/follow.py). Failures are described by `FailureFacts`, which also names the peer
or rendezvous store a surviving rank lost (infra/launchers/peers.py).

New substrates register a `Launcher` subclass under a unique name (`@LAUNCHERS.register("name")`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import signal
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra import manifest
from infra.files import path_from_file, write_json_atomic
from infra.guard import ProcessRef
from infra.launchers.fabric import FabricConfig, RendezvousConfig
from infra.launchers.peers import LostPeer
from infra.launchers.text import EnvName, ModuleName, OneLine, ShellWord
from infra.registry import Registry

# The checkout holding `model/` (the trainer runs as `-m trainers.pretrain` from here by default).
CODE_DIR = Path(__file__).resolve().parents[2]

# Environment names that look like credentials: refused in configs, which end up in lineage.
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|PRIVATE|AUTH", re.IGNORECASE)

LogFn = Callable[[str], None]
OnStart = Callable[[int], object] | None


_SIGNALS = {int(sig): sig.name for sig in signal.Signals}
EXIT_STOPPED = 75  # trainers/rank_signals.py: stopped on a signal, the step it stopped at saved
EXIT_TRANSIENT = 6  # trainers/rank_signals.py: failed on S3 or the network (its checkpoint pull)
EXIT_CODES = {
    3: "stopped on a non-finite loss, gradient or weights",
    4: "refused to start: another trainer holds the stage folder",
    5: "ended by its hang watchdog",
    EXIT_TRANSIENT: "failed on S3 or the network, not on its code or data",
    EXIT_STOPPED: "stopped on a signal (time limit, preemption, eviction) after saving a checkpoint",
}  # trainers/pretrain.py, trainers/watchdog.py, trainers/rank_signals.py

# `{out_dir}/monitor/hang/*.json`: one report per rank whose watchdog found no completed step
# within its bound (trainers/watchdog.py), or the pretrain step's own when the ranks could not
# report (tasks/pretrain.py). Cleared before each launch, so reports describe the launch that ended.
HANG_DIR = Path("monitor") / "hang"
# the node a rank runs on, when its hostname is not it (a Kubernetes pod's): heartbeats and hang
# reports name it, so that a failed node can be excluded from the next attempt (exclude.py)
NODE_ENV = "SMOLLM3_NODE"


def hang_reports(out_dir: Path) -> list[dict]:
    """The hang reports of a stage folder, earliest first (unreadable ones left out)."""
    reports = []
    for path in sorted((Path(out_dir) / HANG_DIR).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            reports.append(record)
    return sorted(reports, key=lambda r: r.get("time", 0.0))


def describe_hang(report: dict) -> str:
    """One clause: `rank 1 on node-3 completed no step for 31.2 s (bound 30.0 s: 10 x median
    0.42 s, floor 30 s) after step 5`; when ranks froze whole (their heartbeat stopped), they come
    first: `rank 1 on node-3 frozen (heartbeat silent 31.0 s); rank 0 on node-2 waiting on it ...`."""
    who = f"rank {report['rank']}" if report.get("rank") is not None else "the stage"
    host = f" on {report['host']}" if report.get("host") else ""
    phase = report.get("phase") or "train"
    doing = {"startup": " before its first step", "checkpoint": " while saving a checkpoint"}.get(phase, "")
    # the frozen ranks first (their heartbeat stopped): the reporting rank only waited on them
    frozen = "".join(
        f"rank {f.get('rank')}{' on ' + f['host'] if f.get('host') else ''} frozen (heartbeat silent "
        f"{float(f.get('silent_s', float('nan'))):.1f} s); "
        for f in report.get("frozen") or ()
        if isinstance(f, dict)
    )
    waiting = " waiting on it" if frozen else ""
    return (
        f"{frozen}{who}{host}{waiting} completed no step for {report.get('idle_s', float('nan')):.1f} s{doing} "
        f"(bound {report.get('bound_s', float('nan')):.1f} s{', ' + report['why'] if report.get('why') else ''})"
    )


@dataclass(frozen=True)
class FailureFacts:
    """What is known about how a training launch ended, from torchrun's failure summary, the
    output and the stage folder. Every field may be unknown (None)."""

    rank: int | None = None  # the rank torchrun names as the root cause
    host: str | None = None
    exitcode: int | None = None  # the rank's exit code (negative: killed by that signal)
    signal: str | None = None  # e.g. "SIGKILL"
    error: str | None = None  # the first error line the ranks printed ("ValueError: ...")
    last_step: int | None = None  # last step in metrics.jsonl
    checkpoint_step: int | None = None  # step of the newest complete checkpoint
    who: str = "the trainer"  # when no rank is named: "torchrun", "Slurm job 12", ...
    state: str | None = None  # the scheduler's final state when it says more (NODE_FAIL, TIMEOUT)
    lost: str | None = None  # the peer or rendezvous store a survivor lost (infra/launchers/peers.py)
    hung: str | None = None  # the first hang report (`describe_hang`): the launch was ended as hung
    node: str | None = None  # the node to blame (`suspect_node`): a frozen or hung rank's, a lost peer's
    # further nodes the scheduler says the job lost (a Slurm NODE_FAIL of several nodes, pods lost
    # with their nodes): excluded with `node`
    more_nodes: tuple[str, ...] = ()
    # what the scheduler said of the lost node(s), one clause: "node node-2 failed (Slurm: down*, Not
    # responding)", "pod job-worker-1 lost with its node ip-10-1-2-3 (DisruptionTarget: DeletionByTaintManager)"
    node_lost: str | None = None
    excluded: tuple[str, ...] = ()  # the nodes the stage's next attempt keeps away from (infra/launchers/exclude.py)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node this failure blames, `node` first."""
        return tuple(dict.fromkeys(n for n in (self.node, *self.more_nodes) if n))

    @property
    def external(self) -> bool:
        """The job ended for a reason outside the trainer's code and data: a stop signal it
        checkpointed on, S3 or the network failing under a rank (EXIT_TRANSIENT), a lost peer (a
        dead node, a failed network), or a node the scheduler says the job lost. A retry resumes."""
        return self.exitcode in (EXIT_STOPPED, EXIT_TRANSIENT) or self.lost is not None or self.node_lost is not None

    def cause(self) -> str:
        """One sentence: who died how, where, and what a retry does."""
        if self.hung:
            return f"hung: {self.hung}; stacks are in the log; the launch was ended{self._then()}{self._avoid()}"
        who = f"rank {self.rank}" if self.rank is not None else self.who
        if self.signal:
            how = f"killed by {self.signal}"
        elif self.exitcode in EXIT_CODES:
            how = EXIT_CODES[self.exitcode]
        elif self.exitcode not in (None, 0):
            how = f"exited with code {self.exitcode}"
        elif self.state:
            how = f"ended {self.state}"
        else:
            how = "failed"
        if self.error and not self.signal:
            how += f" ({self.error})"
        elif self.state and self.state.upper() != "FAILED" and not how.startswith("ended"):
            how += f" (job state {self.state})"  # NODE_FAIL, TIMEOUT, PREEMPTED say more
        if self.node_lost:
            how += f", {self.node_lost}"  # the scheduler's own word on the node(s) it lost
        elif self.node and self.state and self.state.upper() in ("NODE_FAIL", "BOOT_FAIL"):
            how += f", node {self.node} failed"  # the node the scheduler took out of service
        if self.lost:
            how += f", having lost {self.lost}: that node died or its network failed (its own log says which)"
        return f"{who} {how}{self._then()}{self._avoid()}"

    def _avoid(self) -> str:
        """The nodes the next attempt excludes, when a failure named one."""
        if not self.excluded:
            return ""
        return f"; the next attempt excludes node{'s' if len(self.excluded) > 1 else ''} {', '.join(self.excluded)}"

    def _then(self) -> str:
        """Where the launch stopped and what a retry does."""
        where = f" after step {self.last_step}" if self.last_step is not None else " before its first step"
        if self.checkpoint_step is not None:
            then = f" (last checkpoint: step {self.checkpoint_step}); a retry resumes from step {self.checkpoint_step}"
        else:
            then = " (no checkpoint yet); a retry starts the stage over"
        return where + then


class LaunchFailed(RuntimeError):
    """The training job ended unsuccessfully.

    `facts` (FailureFacts) holds what is known: which rank, the signal or exit code, the last
    step in metrics.jsonl and the last complete checkpoint; `cause` is the sentence to show
    ("rank 0 killed by SIGKILL after step 9 (last checkpoint: step 8); a retry resumes from step
    8"). The message starts with the job and that sentence, then the output's tail.
    """

    def __init__(
        self, what: str, tail: Sequence[str] = (), first_error: str | None = None, facts: FailureFacts | None = None
    ):
        self.tail, self.first_error, self.facts = list(tail), first_error, facts
        if facts is not None:
            what = f"{what}: {facts.cause()}"
        elif first_error:
            what = f"{what}; first error: {first_error}"
        shown = "\n".join(self.tail)
        super().__init__(f"{what}; last output:\n{shown}" if shown else what)

    @property
    def cause(self) -> str | None:
        """The one-sentence cause, when facts were gathered (None for submission errors)."""
        return self.facts.cause() if self.facts is not None else None


# torch prefixes a rank's traceback with `[rankN]:`, torchrun's rank labels add another (fabric.py)
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")
_TRAINER_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)*error: (.+)$")  # trainers/pretrain.py's exits 3, 4, 75
_WRAPPERS = ("ChildFailedError", "torch.distributed.elastic")  # torchrun's, names no cause


class FirstError:
    """Remembers the first line of a stream that looks like a Python exception (`XError: ...`)
    or the trainer's own `error: ...`, skipping torchrun's ChildFailedError wrapper."""

    def __init__(self) -> None:
        self.line: str | None = None

    def feed(self, line: str) -> None:
        if self.line is not None:
            return
        text = line.strip()
        m = _TRAINER_ERROR.match(text) or _ERROR_LINE.match(text)
        if m and not any(w in m.group(1) for w in _WRAPPERS):
            self.line = m.group(1)[:500]


_ROOT_CAUSE = "Root Cause (first observed failure)"
_SUMMARY_FIELD = re.compile(r"^(rank|exitcode|host)\s*:\s*(.*)$")


class TorchrunSummary:
    """Reads the 'Root Cause' block of torchrun's failure summary out of a stream:

    Root Cause (first observed failure):
    [0]:
      host      : node-3
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 28665)  (SIGKILL)
    """

    def __init__(self) -> None:
        self.inside = False
        self.fields: dict[str, str] = {}

    def feed(self, line: str) -> None:
        text = line.strip()
        if _ROOT_CAUSE in text:
            self.inside, self.fields = True, {}
        elif self.inside and text.startswith("==="):
            self.inside = False
        elif self.inside and (m := _SUMMARY_FIELD.match(text)):
            self.fields[m.group(1)] = m.group(2)

    def rank(self) -> int | None:
        m = re.match(r"-?\d+", self.fields.get("rank", ""))
        return int(m.group()) if m else None

    def exitcode(self) -> int | None:
        m = re.match(r"-?\d+", self.fields.get("exitcode", ""))
        return int(m.group()) if m else None

    def signal(self) -> str | None:
        m = re.search(r"\((SIG[A-Z0-9]+)\)", self.fields.get("exitcode", ""))
        if m:
            return m.group(1)
        code = self.exitcode()
        return _SIGNALS.get(-code) if code is not None and code < 0 else None


def last_metrics_step(path: Path) -> int | None:
    """The step of the last complete line of a metrics file, reading only its tail."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def stage_dir(spec_path: Path, workdir: Path) -> Path:
    """The stage folder a spec trains in (its out_dir; the work folder when unreadable)."""
    return Path(_spec_path(spec_path, "out_dir") or workdir)


def _spec_path(spec_path: Path, field: str) -> str | None:
    """A path field of a spec file, made absolute the way TrainSpec.load does (a spec inside a
    workspace records its paths relative to itself: model/spec.py)."""
    try:
        value = json.loads(Path(spec_path).read_text()).get(field)
    except (OSError, ValueError, AttributeError):
        return None
    return path_from_file(value, spec_path) if isinstance(value, str) and value else None


def stage_progress(spec_path: Path, workdir: Path) -> tuple[int | None, int | None]:
    """(last step in metrics.jsonl, step of the newest complete checkpoint) of a stage folder."""
    out = stage_dir(spec_path, workdir)
    metrics_path = _spec_path(spec_path, "metrics_path")
    metrics = Path(metrics_path) if metrics_path else out / "metrics.jsonl"
    checkpoint = None
    root = out / "checkpoints"
    if root.is_dir():
        for folder in sorted(root.glob("step_*"), reverse=True):
            record = manifest.quick_check(folder)
            if record is not None:
                checkpoint = int(record.get("step", folder.name[5:]))
                break
    return last_metrics_step(metrics), checkpoint


def failure_facts(
    spec_path: Path,
    workdir: Path,
    summary: TorchrunSummary,
    first: FirstError,
    returncode: int | None = None,
    who: str = "the trainer",
    state: str | None = None,
    signal_name: str | None = None,
    lost: LostPeer | None = None,
) -> FailureFacts:
    """Everything known about a failed launch: torchrun's summary when it printed one, else the
    launcher's own view (torchrun itself killed, a node lost: no rank to name)."""
    last_step, checkpoint_step = stage_progress(spec_path, workdir)
    hangs = hang_reports(stage_dir(spec_path, workdir))
    code, sig = summary.exitcode(), summary.signal()
    if code is None:
        code, sig = returncode, signal_name
        if sig is None and returncode is not None and returncode < 0:
            sig = _SIGNALS.get(-returncode)
    if first.line and first.line.startswith("stopped on SIG"):  # the trainer's own word (trainers/rank_signals.py)
        code, sig = EXIT_STOPPED, None  # torchrun, itself signalled, prints no summary of it
    return FailureFacts(
        rank=summary.rank(),
        host=summary.fields.get("host"),
        exitcode=code,
        signal=sig,
        error=first.line,
        last_step=last_step,
        checkpoint_step=checkpoint_step,
        who=who,
        state=state,
        lost=lost.describe() if lost is not None else None,
        hung=describe_hang(hangs[0]) if hangs else None,
        node=suspect_node(hangs, lost),
    )


def suspect_node(hangs: Sequence[dict], lost: LostPeer | None = None) -> str | None:
    """The node a failed launch's next attempt should avoid: the host of the first frozen rank of
    the first hang report (its heartbeat stopped: SIGSTOP, a dead GPU or node), else the host of the
    rank that reported the hang; without a hang, the host of the peer or rendezvous store a survivor
    lost, when the transport named it by name (an IP address is not a node name Slurm or Kubernetes
    can exclude). None when nothing names a node (a rank's own error is not the node's fault)."""
    if hangs:
        report = hangs[0]
        frozen = [f for f in report.get("frozen") or () if isinstance(f, dict) and f.get("host")]
        host = frozen[0]["host"] if frozen else report.get("host")
        return host if isinstance(host, str) and host else None
    if lost is None:
        return None
    where = lost.store or (lost.endpoint if lost.store_lost else None) or lost.peer
    host = (where or "").rpartition(":")[0].strip("[]")
    if not host or host == "localhost":
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return None


class SlurmLaunchConfig(BaseModel):
    """Slurm settings of a launch (used when kind is slurm)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partition: ShellWord | None = None  # partition to submit to; None = the cluster's default
    account: ShellWord | None = None  # account charged for the allocation
    qos: ShellWord | None = None  # quality of service
    time: ShellWord = "24:00:00"  # wall-clock limit (Slurm syntax: D-HH:MM:SS or HH:MM:SS)
    cpus_per_task: int | None = Field(default=None, gt=0)  # CPUs for each node's torchrun; None = the stage plan's
    open_files: int | None = Field(default=None, gt=0)  # `ulimit -n` of the job; None = the stage plan's
    mem: ShellWord | None = None  # memory per node ("0" = all of it); None = the stage plan's (HostNeeds)
    exclusive: bool = True  # whole nodes: training shares nothing well
    requeue: bool = True  # let Slurm requeue on node failure/preemption; the trainer resumes (False: --no-requeue)
    # Slurm's own requeues of a job after node failures with no newer checkpoint in between, before
    # its script refuses to train again and the step fails (slurm.py `_requeue_budget`); the time
    # limit's and preemption's requeues lose no step and are not counted
    max_node_requeues: int = Field(default=3, ge=0)
    signal_s: int = Field(default=300, gt=0)  # SIGUSR1 this long before the time limit: save, then requeue
    controller_grace_s: float = Field(default=600.0, gt=0)  # keep following while slurmctld does not answer
    setup: tuple[OneLine, ...] = ()  # shell lines before srun (module load, source venv/bin/activate)
    sbatch_args: dict[ShellWord, OneLine] = {}  # extra `#SBATCH --key=value` lines (e.g. reservation)
    poll_seconds: float = Field(default=10.0, ge=0.01)  # how often to check the job and its log (a floor: no busy loop)
    job_name: ShellWord = "smollm3"  # shown in squeue


class KubernetesLaunchConfig(BaseModel):
    """Kubernetes settings of a launch (used when kind is kubernetes): a Kubeflow PyTorchJob."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # image with this repo and its venv, pinned: `registry/name:tag` or `name@sha256:...`
    # (`:latest` or no tag is refused: every restart of a 24-day job must run the same code)
    image: str | None = None
    namespace: str = "default"  # namespace of the PyTorchJob
    job_name: str = "smollm3"  # PyTorchJob name prefix (a spec digest is appended)
    service_account: str | None = None  # for IRSA / workload identity (S3 without static keys)
    gpu_resource: str = "nvidia.com/gpu"  # extended resource name of the accelerators
    cpu: str | None = None  # CPU request/limit per pod; None = the stage plan's (HostNeeds)
    memory: str | None = None  # memory request/limit per pod; None = the stage plan's (HostNeeds)
    workspace_claim: str | None = None  # PVC mounted at the workspace path (shared by all pods): required
    workspace_mount: str = "/workspace"  # where the claim is mounted (the spec's paths live here)
    credentials_secret: str | None = None  # Secret whose keys become env vars (AWS_* chain)
    node_selector: dict[str, str] = {}  # e.g. {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    code_dir: str = "/app"  # the repo inside the image (working directory of the trainer)
    poll_seconds: float = Field(default=15.0, ge=0.01)  # how often kubectl is asked for the status (a floor)
    # All pods or none: "auto" = "volcano" for a multi-pod job, the default scheduler for one pod;
    # "volcano" sets `schedulerName: volcano` and asks the training operator (started with
    # --gang-scheduler-name=volcano) for a PodGroup of minAvailable = nodes; "kueue" labels the
    # job for a Kueue LocalQueue (`queue`); "none": the default scheduler, which may start some
    # pods only and leave them waiting on the rest
    gang: Literal["auto", "none", "kueue", "volcano"] = "auto"
    queue: str | None = None  # Kueue LocalQueue / Volcano queue (kueue: required)
    priority_class: str | None = None  # Kueue WorkloadPriorityClass / Volcano priority class
    # The RDMA devices a pod requests when launch.fabric.kind is efa or infiniband (the device
    # plugin's extended resource): None = by fabric, efa "vpc.amazonaws.com/efa" (the AWS EFA
    # device plugin), infiniband "rdma/rdma_shared_device_a" (NVIDIA network operator's shared
    # RDMA device plugin); `fabric_devices` of them (None = efa 32, a p5.48xlarge's EFA
    # interfaces; infiniband 1, the shared device)
    fabric_resource: str | None = None
    fabric_devices: int | None = Field(default=None, gt=0)
    # What a failed pod restarts: "elastic" = torchrun's c10d rendezvous under the operator's
    # elasticPolicy (every node's torchrun restarts its ranks and they meet again, a lone restarted
    # pod included, up to max_restarts); "job" = no pod restarts alone: the job fails whole and the
    # step's retry applies it again
    restart: Literal["elastic", "job"] = "elastic"
    max_restarts: int = Field(default=3, ge=0)  # elastic: rendezvous rounds torchrun may restart
    # pod eviction: SIGTERM, then SIGKILL this much later; must exceed launch.rendezvous.stop_grace_s
    termination_grace_s: int = Field(default=300, gt=0)

    @model_validator(mode="after")
    def _queue_for_kueue(self) -> KubernetesLaunchConfig:
        if self.gang == "kueue" and not self.queue:
            raise ValueError("kubernetes.gang is kueue: name the LocalQueue in kubernetes.queue")
        return self

    @field_validator("image")
    @classmethod
    def _pinned_image(cls, image: str | None) -> str | None:
        if image is not None and not pinned_image(image):
            raise ValueError(
                f"launch.kubernetes.image {image!r} is not pinned: name a tag other than latest "
                "(registry/smollm3:1.0) or a digest (registry/smollm3@sha256:...), so that every pod "
                "and every restart runs the same code"
            )
        return image

    def gang_for(self, nodes: int) -> str:
        """The gang scheduler a job of `nodes` pods uses ("auto" resolved)."""
        if self.gang != "auto":
            return self.gang
        return "volcano" if nodes > 1 else "none"

    def rdma(self, fabric: str) -> tuple[str, int] | None:
        """(extended resource, count) of RDMA devices a pod requests on this fabric; None on ethernet."""
        default = {"efa": ("vpc.amazonaws.com/efa", 32), "infiniband": ("rdma/rdma_shared_device_a", 1)}.get(fabric)
        if default is None:
            return None
        return (self.fabric_resource or default[0], self.fabric_devices or default[1])


def pinned_image(image: str) -> bool:
    """Whether a container image names one build: a digest, or a tag other than `latest`."""
    if "@" in image:
        return image.split("@", 1)[1].startswith("sha256:")
    last = image.rsplit("/", 1)[-1]  # a registry's port (host:5000/name) is not a tag
    return ":" in last and last.rsplit(":", 1)[1] not in ("", "latest")


@dataclass(frozen=True)
class HostNeeds:
    """What one node of a stage needs besides its GPUs (model/host_memory.py computes it from the
    stage plan): host memory, CPUs for the node's torchrun and its ranks, and the open-file
    limit of each rank. `parts` holds the memory terms per node, in GB, for reports."""

    mem_gb: int  # per node, rounded up
    cpus: int  # per node: the one task's --cpus-per-task
    open_files: int  # per process: ulimit -n
    parts: dict[str, float]

    def describe(self) -> str:
        terms = ", ".join(f"{k} {v:.1f}" for k, v in self.parts.items())
        return f"host {self.mem_gb} GB per node ({terms}), {self.cpus} CPUs, {self.open_files} open files per rank"


class LaunchConfig(BaseModel):
    """The recipe's `launch` section: where and at what size a training stage runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["local", "slurm", "kubernetes"] = "local"  # registered launcher name
    nodes: int = Field(default=1, gt=0)  # machines (local: must be 1)
    # nodes a stage's later attempts may exclude after failures that named them (a frozen or hung
    # rank's host, a lost peer's): Slurm `--exclude`, a Kubernetes node anti-affinity; 0 = never
    max_excluded_nodes: int = Field(default=4, ge=0)
    procs_per_node: int = Field(default=1, gt=0)  # torchrun ranks per node (= GPUs per node on GPU)
    gpus_per_node: int = Field(default=0, ge=0)  # GPUs requested per node (0: CPU/gloo)
    master_port: int | None = Field(default=None, gt=0, lt=65536)  # None: free (local) / per job (Slurm)
    torchrun: ShellWord = "torchrun"  # torchrun executable (a venv path on clusters)
    module: ModuleName = "trainers.pretrain"  # the trainer's module (`-m module SPEC.json`)
    # accelerate config file (FSDP, DeepSpeed ZeRO, mixed precision) for Hugging Face trainers:
    # ranks start with `accelerate launch --config_file FILE`, nodes and processes still from
    # here; relative to code_dir. None: plain torchrun (DDP when the trainer asks for it)
    accelerate_config: ShellWord | None = None
    accelerate: ShellWord = "accelerate"  # accelerate executable (a venv path on clusters)
    # Python on the nodes for helper pools beside the trainer (SAO's rollout pool, pool.py); the
    # local launcher runs this interpreter
    python: ShellWord = "python"
    code_dir: ShellWord | None = None  # checkout holding `model/`; None = this one (shared FS on Slurm)
    env: dict[
        EnvName, OneLine
    ] = {}  # extra environment (NCCL_*, OMP_NUM_THREADS; wins over fabric's); never credentials
    fabric: FabricConfig = FabricConfig()  # interconnect, NCCL error handling and timeouts (fabric.py)
    rendezvous: RendezvousConfig = RendezvousConfig()  # torchrun's rendezvous timeouts, stop grace, rank labels
    slurm: SlurmLaunchConfig = SlurmLaunchConfig()  # used when kind is slurm
    kubernetes: KubernetesLaunchConfig = KubernetesLaunchConfig()  # used when kind is kubernetes

    @model_validator(mode="after")
    def _grace_covers_the_save(self) -> LaunchConfig:
        if self.kind == "kubernetes" and self.kubernetes.termination_grace_s <= self.rendezvous.stop_grace_s:
            raise ValueError(
                f"kubernetes.termination_grace_s ({self.kubernetes.termination_grace_s}) must exceed "
                f"rendezvous.stop_grace_s ({self.rendezvous.stop_grace_s}): an evicted pod is killed "
                "before its ranks can save their step"
            )
        return self

    @model_validator(mode="after")
    def _kubernetes_pods_can_run(self) -> LaunchConfig:
        if self.kind != "kubernetes":
            return self
        if self.kubernetes.image is None:
            raise ValueError(
                "launch.kubernetes.image is not set: name the trainer's image with a pinned tag or digest "
                "(registry/smollm3:1.0)"
            )
        if self.kubernetes.workspace_claim is None:
            raise ValueError(
                "launch.kubernetes.workspace_claim is not set: the pods read the stage's spec.json and write "
                "its checkpoints on the workspace; name the PersistentVolumeClaim that holds it"
            )
        return self

    def sized(self, needs: HostNeeds) -> LaunchConfig:
        """This launch with the host resources a stage plan needs where the recipe left them unset
        (Slurm `mem`, `cpus_per_task`, `open_files`; Kubernetes `memory`, `cpu`): a value the
        recipe sets wins."""
        s, k = self.slurm, self.kubernetes
        slurm = {
            "mem": s.mem if s.mem is not None else f"{needs.mem_gb}G",
            "cpus_per_task": s.cpus_per_task or needs.cpus,
            "open_files": s.open_files or needs.open_files,
        }
        kube = {"memory": k.memory or f"{needs.mem_gb}G", "cpu": k.cpu or str(needs.cpus)}
        return self.model_copy(update={"slurm": s.model_copy(update=slurm), "kubernetes": k.model_copy(update=kube)})

    @field_validator("env")
    @classmethod
    def _no_credentials(cls, env: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in env if _SECRET_NAME.search(k))
        if bad:
            raise ValueError(
                f"launch.env must not carry credentials ({', '.join(bad)}): configs are saved with "
                "every run and in lineage; provide them through the cluster's environment "
                "(AWS credential chain, instance/pod roles, a Kubernetes Secret via "
                "kubernetes.credentials_secret)"
            )
        return env

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def code_path(self) -> Path:
        return Path(self.code_dir) if self.code_dir else CODE_DIR

    @property
    def direct(self) -> bool:
        """One rank on this machine without accelerate: the local launcher runs it directly under
        its guard, without torchrun's agent (infra/launchers/local.py)."""
        return self.kind == "local" and self.nodes == 1 and self.procs_per_node == 1 and not self.accelerate_config

    @property
    def starter(self) -> str:
        """What starts the ranks: `torchrun`, `accelerate (FILE)`, or `direct` (one local rank
        started by the launcher's guard itself)."""
        if self.accelerate_config:
            return f"accelerate ({self.accelerate_config})"
        return "direct" if self.direct else "torchrun"

    def describe(self) -> str:
        """One line for plans and logs: `slurm, 8 nodes x 8 processes (8 GPUs each), accelerate
        (configs/accelerate/fsdp.yaml), -m trainers.posttrain`."""
        gpus = f" ({self.gpus_per_node} GPUs each)" if self.gpus_per_node else ""
        nodes = "1 node" if self.nodes == 1 else f"{self.nodes} nodes"
        procs = "1 process" if self.procs_per_node == 1 else f"{self.procs_per_node} processes"
        return f"{self.kind}, {nodes} x {procs}{gpus}, {self.starter}, -m {self.module}"


class Launcher(ABC):
    """Runs the trainer on one stage spec; subclasses know one substrate."""

    def __init__(self, config: LaunchConfig):
        self.config = config

    @abstractmethod
    def render(self, spec_path: Path, workdir: Path) -> str:
        """The command, script or manifest that `launch` would run or submit."""

    @abstractmethod
    def launch(self, spec_path: Path, workdir: Path, log: LogFn = print, *, on_start: OnStart = None) -> None:
        """Run the trainer to completion, streaming its output to `log`; raise on failure.

        `on_start` receives the handle of what was started, as soon as it exists: the process
        group id (local torchrun) or the Slurm job id; Kubernetes calls it with 0.
        """

    # -- helper pools beside the trainer's job (infra/launchers/pool.py) --

    def render_pool(self, pool, workdir: Path) -> str:
        """What `submit_pool` would submit for `pool` (a PoolSpec): script, manifest, commands."""
        raise NotImplementedError(f"the {self.config.kind} launcher runs no helper pool")

    def submit_pool(self, pool, workdir: Path, log: LogFn = print) -> str:
        """Start `pool` beside the trainer's job; returns its handle (a job id, a name, pids)."""
        raise NotImplementedError(f"the {self.config.kind} launcher runs no helper pool")

    def pool_state(self, pool, handle: str) -> str | None:
        """None while the pool runs or waits for nodes; else how it ended, one clause starting
        with "completed" when every node exited 0 (the trainer was done) ("ended FAILED (exit 1:0)")."""
        raise NotImplementedError(f"the {self.config.kind} launcher runs no helper pool")

    def cancel_pool(self, pool, handle: str, workdir: Path) -> None:
        """Stop the pool (whatever it is doing) and forget its record."""
        raise NotImplementedError(f"the {self.config.kind} launcher runs no helper pool")

    def describe_pool(self, pool, handle: str) -> str:
        """The pool for people: "Slurm job 12 (2 nodes), log ..."."""
        return f"{self.config.kind} {pool.name} pool {handle}"


LAUNCHERS: Registry[type[Launcher]] = Registry("launcher")


def get_launcher(config: LaunchConfig) -> Launcher:
    """The registered launcher for `config.kind`, built with its config."""
    return LAUNCHERS.get(config.kind)(config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobRecord:
    """`{workdir}/launch/{name}`: the cluster job a launch submitted, what it runs, who follows it.

    Written right after submission and removed once the job is known to have ended. A record left
    behind means its follower died without cleaning up (SIGKILL, OOM, a lost login node): the
    next launch of the same stage folder re-attaches to that job when it still runs the same
    thing (`digest`: the rendered script or manifest and the spec it reads), replaces it when it
    does not, and refuses while the recorded owner is still alive on this host (two launches of
    one stage). `history` lists every submission and re-attachment, oldest first.
    """

    def __init__(self, workdir: Path, name: str):
        self.path = Path(workdir) / "launch" / name

    def write(self, job: str, digest: str | None = None, cluster: str | None = None) -> None:
        """A new job was submitted: it starts the record (and its history) afresh. `cluster`
        names the scheduler's cluster the job id belongs to, when known."""
        raw = {"job": job, "digest": digest, "history": [self._event("submitted")]}
        self._save(raw | ({"cluster": cluster} if cluster is not None else {}), job)

    def attach(self) -> None:
        """This process now follows the recorded job (its earlier follower is gone)."""
        raw = self.raw()
        if raw is not None:
            self._save(raw | {"history": [*raw.get("history", []), self._event("attached")]}, str(raw["job"]))

    def _event(self, what: str) -> dict:
        return {"event": what, "owner": asdict(ProcessRef.current()), "time": time.time()}

    def _save(self, raw: dict, job: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = raw["history"][-1]
        write_json_atomic(self.path, raw | {"job": job, "owner": now["owner"], "submitted": raw["history"][0]["time"]})

    def raw(self) -> dict | None:
        try:
            raw = json.loads(self.path.read_text())
            return raw if isinstance(raw, dict) and "job" in raw else None
        except (OSError, ValueError):
            return None

    def read(self) -> tuple[str, ProcessRef] | None:
        raw = self.raw()
        try:
            return str(raw["job"]), ProcessRef(**raw["owner"])
        except (KeyError, TypeError):
            return None

    @property
    def digest(self) -> str | None:
        raw = self.raw()
        return raw.get("digest") if raw else None

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def live_owner(self) -> ProcessRef | None:
        """The owner of the recorded job when it is another process still alive on this host."""
        found = self.read()
        if found is None:
            return None
        owner = found[1]
        return owner if owner.alive() and owner != ProcessRef.current() else None


def launch_digest(rendered: str, spec_path: Path) -> str:
    """What a cluster job runs: its rendered script or manifest, and the spec file it reads."""
    h = hashlib.sha256(rendered.encode())
    h.update(b"\0")
    try:
        h.update(Path(spec_path).read_bytes())
    except OSError:
        pass
    return h.hexdigest()


def accelerate_args(config: LaunchConfig) -> list[str]:
    """`accelerate launch` arguments every substrate shares: the config file and the totals.

    accelerate's `--num_processes` counts every rank of every machine (torchrun's is per node);
    arguments given here win over the file's own `num_machines` / `num_processes`.
    """
    return [
        "launch",
        "--config_file",
        str(config.accelerate_config),
        "--num_machines",
        str(config.nodes),
        "--num_processes",
        str(config.world_size),
        "--max_restarts",
        "0",
    ]


def check_spec(spec_path: Path) -> Path:
    spec_path = Path(spec_path)
    if not spec_path.is_file():
        raise FileNotFoundError(f"stage spec {spec_path} does not exist; write the resolved TrainSpec JSON first")
    return spec_path.resolve()
