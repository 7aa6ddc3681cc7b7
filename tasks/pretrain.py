"""Pretraining stages: one torchrun launch of `trainers.pretrain` per stage, resumable inside its folder.

SmolLM3's schedule, as data (planned into one `StageSpec` per stage by flows/stage_plan.py):
- the `pretrain` stages (stage 1, 2, 3) share ONE warmup-stable-decay schedule: each stage knows
  its position in it (`start_step` of `total_steps`), and the decay covers the last
  `decay_stages` stages (SmolLM3: stage 3, ~11% of the steps), so a stage boundary never resets
  the learning rate;
- `long_context` stages follow, each from the previous stage's final checkpoint with a raised
  sequence length and RoPE theta, a fresh optimizer and a fresh (cosine) schedule at a fraction of
  the peak LR (SmolLM3: 4k->32k->64k at 2e-5, 10% of 2e-4);
- `reasoning` stages (SmolLM3's reasoning mid-training) come last: the same trainer on reasoning
  traces rendered in ChatML (tasks/reasoning_data.py), packed, with a fresh optimizer and cosine
  schedule of their own at `lr_scale` x the peak LR.

The step writes `spec.json` into its folder and launches
`python -m torch.distributed.run --standalone --nproc-per-node N -m trainers.pretrain spec.json` through
`infra.proc.run_streaming` (own process group, output streamed to the run logger, killed with the
task). The folder is resumable: after a crash or a `prefect flow-run retry`, the trainer restarts
from the newest complete checkpoint in `checkpoints/`. Metrics land in `metrics.jsonl` (rank 0;
the step reads only its downsampled `metrics.curve.jsonl`, evals/training_metrics.py);
the publish hook ingests them into DuckDB and posts a summary with the loss curve to the UI.

While the trainer runs, a supervisor thread (trainers/supervise.py) turns the ranks' flags
(stragglers, throughput drops, skipped steps, non-finite values) into task-log lines, lineage rows
(`train_events`) and Prefect events (`smollm3.training.<kind>`), and ends a local launch whose
ranks hung where torchrun cannot (the attempt fails as `hung`, transient: the retry resumes).
After a non-finite value the step relaunches the stage from its last verified checkpoint with the
data that led there skipped, at most `training.nonfinite.retries` times (docs/training.md "A
long run"). Rank 0 writes the stage's TensorBoard run (or W&B / MLflow) under
`{workspace}/tensorboard/{stage}-{folder}`.

With `storage.s3_uri`, the trainer mirrors its own checkpoints: rank 0 uploads each one to
`{s3_uri}/pretrain/{fp12}/checkpoints/` from a background thread as its marker is written, and
applies `storage.checkpoints` retention there (infra/storage.py `CheckpointUploader`, recorded in
`mirror.jsonl`). When no complete local checkpoint is left (a fresh machine), the newest one is
pulled back before the trainer resumes: by this process on the local launcher, by the trainer's
rank 0 into the shared folder on Slurm and Kubernetes (`MirrorTarget.pull`, trainers/pretrain.py
`pull_mirror`), so there the flow host moves no checkpoint bytes.

Testing hook: `SMOLLM3_INJECT_FAILURE=<stage>` kills that stage's trainer (SIGKILL of its process
group, as a node failure would) once its first checkpoint is complete (with a mirror: and
uploaded), once per stage folder.
"""

from __future__ import annotations

import base64
import contextvars
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from evals.training_metrics import loss_curve, read_metrics, summarize
from infra.launchers import LaunchConfig, get_launcher
from infra.launchers.base import last_metrics_step
from infra.launchers.exclude import adopt_excluded
from infra.proc import kill_tree
from infra.storage import MIRROR_RECORD, MirrorTarget, StorageConfig, has_complete_checkpoint, pull_latest_checkpoint
from model.calibration import host_calibration
from model.spec import TrainSettings, TrainSpec
from pipeline.artifact import Artifact, operational
from pipeline.step import step
from trainers.supervise import (
    RunRef,
    StageEvents,
    StageSupervisor,
    end_local,
    flag_counts,
    non_finite,
    reset_launch_files,
    roll_back,
)
from trainers.tracker import check_tracker, tracker_dir

_FAILURE_ENV = "SMOLLM3_INJECT_FAILURE"


class TrainingConfig(TrainSettings):
    """The recipe's `training` section: every `TrainSettings` field (model/spec.py, where each
    training setting is declared once; `training.optimizer.lr` is the peak LR the trainer uses, one
    name end to end), plus what lays the stages out. Each stage may override any setting
    (`stages[].tp`, `stages[].micro_batch`, ...). Operational fields change how stages run, not
    what they compute, and never enter a fingerprint."""

    model: str = "tiny"  # ModelConfig preset: tiny, smollm3_3b, ablation_1b
    warmup_steps: int = Field(default=10, ge=0)  # linear warmup at the start of stage 1
    min_lr: float = Field(default=0.0, ge=0)  # LR at the end of the decay
    decay_stages: int = Field(default=1, ge=0)  # last N pretrain stages are the WSD decay
    nproc_per_node: int = operational(1, gt=0)  # torchrun processes (GPUs) per node
    # Attempts after a transient failure of a stage (a hang, a lost node or rank, an NCCL error,
    # preemption, a time limit: pipeline.step.transient), each resuming from the last checkpoint;
    # every attempt is a lineage row with its cause. A config or data error is never retried. A
    # month-long stage wants several.
    retries: int = operational(1, ge=0)
    # Seconds before the first retry, doubled before each next one up to `retry_backoff_max_s`
    # (a scheduler or node that just failed gets time to recover; a fault storm is not hammered).
    retry_backoff_s: float = operational(30.0, ge=0)
    retry_backoff_max_s: float = operational(900.0, ge=0)

    def retry_policy(self) -> dict[str, Any]:
        """The stage's retry budget and backoff, as `Graph.add` takes them."""
        return {
            "retries": self.retries,
            "retry_delay": self.retry_backoff_s,
            "retry_delay_max": self.retry_backoff_max_s,
        }

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainingConfig:
        if self.nproc_per_node % self.tp:
            raise ValueError(f"tp {self.tp} must divide nproc_per_node {self.nproc_per_node} (TP stays in a node)")
        if self.nproc_per_node % (self.tp * self.cp):
            raise ValueError(
                f"cp {self.cp} x tp {self.tp} must divide nproc_per_node {self.nproc_per_node} (CP stays in a node)"
            )
        per_step = self.micro_batch * self.nproc_per_node // (self.tp * self.cp)
        if self.global_batch % per_step:
            per_model = "tp" if self.cp == 1 else "(tp x cp)"
            raise ValueError(
                f"global_batch {self.global_batch} must be a multiple of micro_batch x nproc_per_node / "
                f"{per_model} = {self.micro_batch} x {self.nproc_per_node} / {self.tp * self.cp}"
            )
        self.model_shape()  # unknown presets and bad overrides fail at load time, naming them
        return self

    def model_shape(self):
        """The model this section trains (its vocabulary is the tokenizer's, set at train time)."""
        from model.config import ModelConfig

        try:
            return ModelConfig.from_preset(self.model, **self.model_overrides)
        except TypeError as exc:  # a value of the wrong type reaches the dataclass's checks
            raise ValueError(f"training.model_overrides: {exc}") from None


class StageSpec(BaseModel):
    """The pretrain step's config: one stage's TrainSpec, and where and how it runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: TrainSpec  # what the trainer trains (its identity fields are the stage's identity)
    kind: Literal["pretrain", "long_context", "reasoning", "anneal", "cpt"] = "pretrain"  # what the stage is for
    # Downstream steps read a checkpoint every N steps (CPT's monitor): the stage then checkpoints
    # every N steps and keeps them all. Identity: which checkpoints exist is part of the output.
    keep_every: int | None = Field(default=None, gt=0)
    launch: LaunchConfig = operational(LaunchConfig())  # local torchrun, Slurm or Kubernetes
    storage: StorageConfig = operational(StorageConfig())  # S3 mirror of checkpoints
    nproc_per_node: int = operational(1, gt=0)  # ranks per node
    threads: int | None = operational(None, gt=0)  # CPU threads per rank (the train slot's)
    nodes: int | None = operational(None, gt=0)  # this stage's node count (None: the launch's)

    @property
    def name(self) -> str:
        return self.spec.stage

    def on(self, launch: LaunchConfig) -> LaunchConfig:
        """The recipe's launch for this stage (its own node count, when it has one)."""
        return launch if self.nodes is None else launch.model_copy(update={"nodes": self.nodes})

    def layout(self, tp: int | None = None):
        """The stage's ranks (model/layout.py) on its launch; ValueError naming what does not divide."""
        from model.layout import plan_layout

        nodes = self.nodes or self.launch.nodes
        procs = self.nproc_per_node
        return plan_layout(nodes * procs, procs, tp or self.spec.tp, self.spec.hsdp, self.spec.cp)

    def memory(self, vocab_size: int | None = None):
        """Predicted peak per rank (model/memory.py) on the stage's layout, on GPU when it trains
        there (a declared GPU memory, or device cuda), else on CPU."""
        from model.memory import stage_estimate

        gpu = self.spec.gpu_memory_gb is not None or self.spec.device == "cuda"
        return stage_estimate(self.spec, self.layout(), vocab_size, "cuda" if gpu else "cpu")

    def _threaded_launch(self) -> LaunchConfig:
        env = dict(self.launch.env)
        if "OMP_NUM_THREADS" not in env:
            threads = self.spec.num_threads or self.threads or max(1, (os.cpu_count() or 1) // self.nproc_per_node)
            env["OMP_NUM_THREADS"] = str(threads)
        return self.launch.model_copy(update={"procs_per_node": self.nproc_per_node, "env": env})

    def host_needs(self):
        """What one node of the stage needs besides its GPUs (model/host_memory.py HostNeeds)."""
        from model.host_memory import host_needs

        threads = self._threaded_launch().env["OMP_NUM_THREADS"]
        threads = int(threads) if threads.isdigit() else 1
        return host_needs(self.spec, self.layout(), self.nproc_per_node, threads=threads)

    def launch_config(self) -> LaunchConfig:
        """The launcher for the stage: ranks per node from the recipe, on CPU the stage's threads
        (its train slot's, else the machine's cores split between the ranks; torchrun would
        otherwise pin one thread per rank), and on a cluster the host memory, CPUs and open files
        its plan needs where the recipe sets none (model/host_memory.py)."""
        launch = self._threaded_launch()
        return launch if launch.kind == "local" else launch.sized(self.host_needs())

    def launch_summary(self) -> str:
        """Where and how the stage runs, and its predicted memory, for `smollm3 plan`."""
        launch = self.on(self.launch).model_copy(update={"procs_per_node": self.nproc_per_node})
        layout = self.layout()
        spec = self.spec
        accum = spec.global_batch // (spec.micro_batch * layout.dp)
        est = self.memory()
        limit = f" of {spec.gpu_memory_gb:g} GB" if spec.gpu_memory_gb else ""
        return (
            f"{launch.describe()}; {layout.describe()}; batch {spec.global_batch} = DP {layout.dp} x "
            f"{spec.micro_batch} x {accum} accumulation; checkpointing {est.mode}; peak {est.describe()}"
            + (f", {est.budget_gb():.1f} GB with context and fragmentation{limit}" if est.peak_bytes >= 1e9 else "")
        )


class _Watcher(threading.Thread):
    """Reports progress from the last line of metrics.jsonl and, when asked, kills the trainer
    right after its first complete checkpoint (the failure-injection hook)."""

    def __init__(self, out: Path, steps: int, progress, inject: bool, mirrored: bool = False):
        super().__init__(daemon=True)
        self.out, self.steps, self.progress, self.inject = out, steps, progress, inject
        self.mirrored = mirrored  # with a mirror, the kill waits until the trainer uploaded one
        self.stop = threading.Event()
        self.injected = False

    def run(self) -> None:
        from model.checkpoint import Checkpointer

        tick, last_report, reported = (0.05 if self.inject else 2.0), 0.0, -10.0
        while not self.stop.wait(tick):
            if self.progress and time.monotonic() - last_report >= 2.0:
                last_report = time.monotonic()
                step = last_metrics_step(self.out / "metrics.jsonl")
                # Every update is an event in the UI and in `--watch` output: report in 10% steps.
                if step is not None and 100.0 * step / self.steps >= reported + 10.0:
                    reported = 100.0 * step / self.steps
                    self.progress(reported)
            if (
                self.inject
                and Checkpointer(self.out / "checkpoints").latest() is not None
                and (not self.mirrored or _uploaded(self.out))
            ):
                pgid = _trainer_pgid(self.out)
                if pgid:
                    (self.out / ".failure-injected").write_text(time.strftime("%FT%T"))
                    self.injected = True
                    kill_tree(pgid)  # torchrun and its ranks (each in a session of its own)
                    return


def _uploaded(out: Path) -> bool:
    """The trainer recorded a verified upload of a checkpoint (`mirror.jsonl`, infra/storage.py)."""
    try:
        return any(
            json.loads(line).get("event") == "uploaded" for line in (out / MIRROR_RECORD).read_text().splitlines()
        )
    except (OSError, ValueError):
        return False


def _run_position(init: Artifact | None) -> tuple[int, int]:
    """Where a stage continuing `init` starts in its run's training: the previous stage's own
    position plus its steps and tokens (its spec.json and meta), so the trackers of a run's stages
    draw one curve. (0, 0) for a first stage and for a base that is not a stage's checkpoint (a
    pinned import, an anneal's or CPT's pin: their curves start at 0)."""
    if init is None or init.kind != "checkpoint":
        return 0, 0
    try:
        before = json.loads((init.path / "spec.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0, 0
    steps, tokens = int(before.get("steps") or 0), int(init.meta.get("tokens") or 0)
    return int(before.get("run_first_step") or 0) + steps, int(before.get("run_first_token") or 0) + tokens


def _run_context() -> tuple[RunRef, Callable[[str, dict[str, Any]], None] | None]:
    """The calling thread's Prefect run (flow run, its attempt, the task's try) and a function
    that emits a Prefect event related to it; no run and no function outside a flow run (a build
    called directly). Captured here, in the task's thread: the supervisor's thread has no Prefect
    context."""
    from prefect.runtime import flow_run, task_run

    if not flow_run.id:
        return RunRef(), None
    # This thread's Prefect context, its API's settings among it: the supervisor's thread has
    # none, and Prefect's events worker started there would start a temporary server of its own.
    context = contextvars.copy_context()
    related = [{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"}]
    if task_run.id:
        related.append({"prefect.resource.id": f"prefect.task-run.{task_run.id}", "prefect.resource.role": "task-run"})
    ref = RunRef(str(flow_run.id), int(flow_run.run_count or 1), int(task_run.run_count or 1) if task_run.id else None)

    def emit(event: str, payload: dict[str, Any]) -> None:
        from prefect.events import emit_event

        payload = dict(payload)
        resource = payload.pop("resource")
        context.copy().run(emit_event, event=event, resource=resource, related=related, payload=payload)

    return ref, emit


def _trainer_pgid(out: Path) -> int | None:
    try:
        return int((out / ".trainer.pgid").read_text())
    except (OSError, ValueError):
        return None


def _device(spec: TrainSpec) -> str:
    """Where the trainer will run ("cpu" or "cuda"), as it decides it."""
    if spec.device != "auto":
        return spec.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _stage_markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# {meta['stage']} ({meta['kind']})",
        "",
        f"- steps: {meta['steps']}, sequence length {meta['seq_len']}",
        f"- final loss: {meta['final_loss']:.4f}" if meta["final_loss"] is not None else "- no metrics",
        f"- throughput: {meta['tokens_per_s']:,.0f} tokens/s" if meta["tokens_per_s"] else "",
        _mfu_line(meta),
        f"- resumed from an earlier attempt: {meta['resumed']}",
        f"- initialised from: {meta['init_from'] or 'scratch'}",
        "",
        "| source | tokens drawn |",
        "|---|---|",
        *[f"| {k} | {v:,} |" for k, v in sorted(meta["tokens_per_source"].items())],
    ]
    return "\n".join(x for x in lines if x is not None) + "\n"


def _mfu_line(meta: dict[str, Any]) -> str:
    source = meta.get("mfu_peak_source") or "no peak recorded"
    if meta.get("mfu_invalid"):
        return f"- MFU: **not reported: {meta['mfu_invalid']}**"
    if meta.get("mfu") is None:
        return f"- MFU: not reported ({source})"
    return f"- MFU: {meta['mfu']:.1%} of {meta['mfu_peak_flops']:.3g} FLOP/s per device ({source})"


def publish_stage(artifact: Artifact, ws, label: str) -> None:
    """Metrics to DuckDB (the curve file's rows: every line of a stage of up to `CURVE_POINTS`
    lines, evenly spaced ones beyond); the stage summary with its loss curve to the Prefect UI."""
    import re

    from prefect.artifacts import create_markdown_artifact

    rows = read_metrics(artifact.path / "metrics.jsonl")
    facts = [
        (artifact.fingerprint, r["step"], name, float(r[name]))
        for r in rows
        for name in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "skipped_steps")
        if isinstance(r.get(name), int | float)
    ]
    ws.lineage().record_rows("metrics", facts)
    markdown = (artifact.path / "summary.md").read_text()
    png = artifact.path / "loss.png"
    if png.exists():
        data = base64.b64encode(png.read_bytes()).decode()
        markdown += f"\n![loss curve](data:image/png;base64,{data})\n"
    key = re.sub(r"[^a-z0-9-]+", "-", f"stage-{label}".lower())
    create_markdown_artifact(markdown=markdown, key=key, description=f"{label}: loss and mixture")


# Retried once when the trainer was killed or its node failed: the retry resumes from the last
# complete checkpoint (a Python error or a non-finite loss fails at once: pipeline.step.transient).
# 3: the loader interleaves sources in exact proportion and draws windows in a seeded order
@step(
    "pretrain",
    version=3,
    kind="checkpoint",
    resumable=True,
    publish=publish_stage,
    resource="train",
    retries=1,
    retry_delay=30,
)
def pretrain(
    config: StageSpec, mixture: Artifact, init: Artifact | None = None, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """Train one stage in `out` (resuming what an earlier attempt left there) on its `mixture`
    plan; `init`, when the stage continues a model, is the checkpoint it starts from (the
    previous stage, or a pinned anneal/CPT base)."""
    init_from = init.meta["checkpoint"] if init is not None else None
    spec = config.spec
    storage = config.storage
    s3_checkpoints = (
        f"{storage.s3_uri.rstrip('/')}/{out.parent.name}/{out.name}/checkpoints" if storage.s3_uri else None
    )
    if config.keep_every:
        spec = spec.model_copy(
            update={"checkpoint_interval": config.keep_every, "keep_last": spec.steps // config.keep_every + 1}
        )
        # every checkpoint is part of the output: the bucket keeps them all too
        storage = storage.model_copy(update={"checkpoints": storage.checkpoints.model_copy(update={"keep_last": None})})
    # The local launcher's ranks run on this host: the step pulls a lost checkpoint back itself.
    # A cluster launch's rank 0 does (spec.mirror.pull): checkpoint bytes never pass this host.
    pulls_here = config.launch.kind == "local"
    mirror = MirrorTarget(uri=s3_checkpoints, storage=storage, pull=not pulls_here) if s3_checkpoints else None
    spec = spec.bind(mixture.path / "plan.json", out, init_from, mirror)
    check_tracker(spec.tracker)  # a missing W&B / MLflow package fails here, not in every rank
    first_step, first_token = _run_position(init)
    from pipeline.runner import flow_run_name

    folder = tracker_dir(out.parent.parent, spec.tracker, out, spec.stage, flow_run_name())
    spec = spec.model_copy(
        update={"tracker_dir": str(folder), "run_first_step": first_step, "run_first_token": first_token}
    )
    if spec.peak_flops is None:
        # The MFU peak where no datasheet value applies: this host's preflight measurement.
        spec = spec.model_copy(update={"peak_calibration": host_calibration(out.parent.parent, _device(spec))})
    spec.save(out / "spec.json", relative_to=out.parent.parent)  # paths inside the workspace: relative
    ckpt_dir = out / "checkpoints"
    if s3_checkpoints and pulls_here and not has_complete_checkpoint(ckpt_dir):
        # The local copy is gone (a new machine, a cleaned disk, a killed pull's leftovers): resume
        # from the mirror.
        pulled = pull_latest_checkpoint(s3_checkpoints, ckpt_dir, storage)
        if pulled is not None:
            log(f"{spec.stage}: pulled {pulled.name} from {s3_checkpoints}")
    resumed = has_complete_checkpoint(ckpt_dir)
    sched = spec.schedule
    start = sched.start_step or 0
    log(
        f"{spec.stage}: {spec.steps} steps x {spec.global_batch} x {spec.seq_len} tokens, "
        f"{sched.kind} lr {spec.optimizer.lr:g} (positions {start}..{start + spec.steps} of "
        f"{sched.total_steps or spec.steps}), seed {spec.seed}"
        f"{', resuming in ' + str(out) if resumed else ''}"
    )
    if spec.tracker.kind != "none":
        log(f"{spec.stage}: {spec.tracker.kind} run folder {spec.tracker_dir}")
    launch = config.launch_config()
    if launch.kind != "local":  # nodes the workspace's preflight found bad (infra/launchers/exclude.py)
        adopt_excluded(out, out.parent.parent, launch.max_excluded_nodes, log)
    launcher = get_launcher(launch)
    inject = os.environ.get(_FAILURE_ENV) == spec.stage and not (out / ".failure-injected").exists()
    sink = StageEvents(out, spec.stage, log, *_run_context())
    while True:  # again only after a non-finite value, with its data skipped (bounded)
        watcher = _Watcher(out, spec.steps, progress, inject, mirror is not None)
        reset_launch_files(out)  # hang reports and heartbeats describe this launch only
        local = config.launch.kind == "local"
        supervisor = StageSupervisor(out, spec.watchdog, sink, end_launch=(lambda: end_local(out)) if local else None)
        watcher.start()
        supervisor.start()
        try:
            # The trainer's rank 0 uploads each checkpoint to `s3_checkpoints` itself (spec.mirror).
            launcher.launch(
                out / "spec.json", out, log, on_start=lambda handle: (out / ".trainer.pgid").write_text(str(handle))
            )
        except Exception as exc:
            if watcher.injected:
                raise RuntimeError(
                    f"injected failure ({_FAILURE_ENV}={spec.stage}): trainer killed after its first checkpoint"
                ) from None
            if non_finite(exc) and roll_back(out, spec, sink, log):
                continue
            raise
        finally:
            watcher.stop.set()
            watcher.join()
            supervisor.close()
        break
    result = json.loads((out / "result.json").read_text())
    rows = read_metrics(out / "metrics.jsonl")  # the curve file: bounded at any stage length
    if rows:
        loss_curve(rows, out / "loss.png", f"{spec.stage} ({config.kind})")
    figures = summarize(rows)
    meta = {
        "stage": spec.stage,
        "kind": config.kind,
        "steps": spec.steps,
        "seq_len": spec.seq_len,
        "tokens": spec.steps * spec.global_batch * spec.seq_len if spec.seq_len else None,
        "final_loss": figures["final_loss"],
        "checkpoint": result.get("checkpoint"),
        "tokens_per_source": figures["tokens_per_source"],
        **{k: figures[k] for k in ("tokens_per_s", "mfu", "mfu_invalid", "mfu_peak_flops", "mfu_peak_source")},
        "resumed": resumed or bool(result.get("resumed")),  # a cluster launch's rank 0 may have pulled
        "init_from": init_from,
        "skipped_steps": result.get("skipped_steps", 0),  # the skip-step rule's
        "skipped_data": result.get("skipped_data", []),  # windows skipped after non-finite values
        "flags": flag_counts(out),
        "tracker_dir": spec.tracker_dir if spec.tracker.kind != "none" else None,
        **({"s3_checkpoints": s3_checkpoints} if s3_checkpoints else {}),
    }
    if meta["mfu_invalid"]:
        log(f"WARNING: {spec.stage}: MFU not reported: {meta['mfu_invalid']}")
    (out / "summary.md").write_text(_stage_markdown(meta, rows))
    return meta
