"""How a post-training step runs its trainer: as a launched job, exactly like a pretraining stage.

The step's build runs in the flow process and stays light (no TRL import there): it writes
`spec.json` (a `TrainerSpec`) into the step folder and hands it to the launcher of
`PosttrainSpec.launch` (infra/launchers: local torchrun or `accelerate launch`, Slurm, Kubernetes),
which runs `-m trainers.posttrain spec.json` on every rank (trainers/posttrain/__main__.py). What a
pretraining stage gets, a post-training step gets the same way:

- streaming logs, cancellation and process-group cleanup: the local launcher starts the ranks
  through `infra.proc.run_streaming` under the `infra/guard.py` guard, each rank arms
  `protect_rank`, Slurm jobs are `scancel`led and PyTorchJobs deleted with the task;
- one trainer per folder: rank 0 leases the step folder before writing (exit 4 otherwise);
- resume: TRL checkpoints are published as `checkpoints/step_N` with a verified manifest
  (trainers/posttrain/common.py), and a rerun, Slurm requeue or pod restart resumes from the newest;
- S3: with `storage.s3_uri`, the main rank uploads each checkpoint as it is published
  (`TrainerSpec.mirror`, infra/storage.py `CheckpointUploader`, with `storage.checkpoints`
  retention); when no complete local copy is left, the newest is pulled back by this process for
  the local launcher, and by the main rank for a cluster launch (`MirrorTarget.pull`, so the flow
  host moves no checkpoint bytes; trainers/posttrain/__main__.py `pull_mirror`);
- failures: `LaunchFailed.cause` names the rank, its signal or exit code, the last logged step
  and the last checkpoint ("a retry resumes from step 4");
- progress: the main rank prints `pipeline.step` progress marks, turned back into `progress()` here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializeAsAny, ValidationError, model_validator

from infra.files import write_atomic
from infra.launchers import LaunchConfig, get_launcher
from infra.launchers.pool import NODE, PoolRunner, PoolSpec
from infra.storage import PULLED, MirrorTarget, has_complete_checkpoint, pull_latest_checkpoint
from model.spec import TrackerConfig
from pipeline.child import progress_lines
from trainers.posttrain import rollout, sections
from trainers.posttrain.sections import PosttrainSpec
from trainers.tracker import tracker_dir

SPEC, RESULT = "spec.json", "result.json"

# A post-training step retries like a pretraining stage: once, 30 s later, when its trainer was
# killed by a signal or its node failed (pipeline.step.transient), resuming from its newest
# checkpoint; a Python error or a bad config fails at once.
TRAINER_RETRIES = {"retries": 1, "retry_delay": 30.0}

# trainer name -> (module, function, section class); the functions run on every rank
TRAINERS: dict[str, tuple[str, str, type[sections.TrainerConfig]]] = {
    "sft": ("trainers.posttrain.sft", "train_sft", sections.SFTConfig),
    "preference": ("trainers.posttrain.preference", "train_preference", sections.PreferenceConfig),
    "grpo": ("trainers.posttrain.grpo", "train_grpo", sections.GRPOConfig),
    "sao": ("trainers.posttrain.sao", "train_sao", sections.SAOConfig),
    "distill": ("trainers.posttrain.distill", "train_distill", sections.DistillConfig),
}


class TrainerSpec(BaseModel):
    """What one launch trains: `spec.json` in the step folder, read by every rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trainer: Literal["sft", "preference", "grpo", "sao", "distill"]
    # The step's recipe section (posttrain.sft, ...), typed as the trainer's own class (TRAINERS);
    # a mapping (spec.json) is read as that class.
    section: SerializeAsAny[sections.TrainerConfig]
    policy: str  # HF folder of the model to train
    data: str  # posttrain_data folder (train/heldout conversations, prompts)
    out: str  # the step folder: checkpoints/, model/, metrics.jsonl, result.json
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tracker: TrackerConfig = TrackerConfig(kind="none")  # where the main rank sends its log rows
    tracker_dir: str = ""  # ... into this run folder (trainers/tracker.py)
    mirror: MirrorTarget | None = None  # the step's S3 prefix for its checkpoints; None: local only

    @model_validator(mode="before")
    @classmethod
    def _section_of_its_trainer(cls, data: Any) -> Any:
        if not (isinstance(data, dict) and isinstance(data.get("section"), dict) and data.get("trainer") in TRAINERS):
            return data
        try:
            return {**data, "section": TRAINERS[data["trainer"]][2].model_validate(data["section"])}
        except ValidationError as err:  # named as fields of `section`, not of the spec
            problems = "; ".join(f"section.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ValueError(problems) from None

    @model_validator(mode="after")
    def _section_matches(self) -> TrainerSpec:
        expected = TRAINERS[self.trainer][2]
        if type(self.section) is not expected:
            raise ValueError(
                f"section: trainer {self.trainer!r} takes a {expected.__name__}, got a {type(self.section).__name__}"
            )
        return self

    def save(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: Path) -> TrainerSpec:
        return cls.model_validate_json(Path(path).read_text())


def launch_config(run: PosttrainSpec) -> LaunchConfig:
    """The launcher for a trainer: on CPU each rank gets the train slot's threads (else the
    machine's cores split between the local ranks; torchrun would pin one thread per rank)."""
    env = dict(run.launch.env)
    if "OMP_NUM_THREADS" not in env:
        threads = run.threads or max(1, (os.cpu_count() or 1) // run.launch.procs_per_node)
        env["OMP_NUM_THREADS"] = str(threads)
    return run.launch.model_copy(update={"env": env})


def s3_checkpoints(run: PosttrainSpec, out: Path) -> str | None:
    """Where the step's checkpoints are mirrored: `{s3_uri}/{step}/{fp12}/checkpoints`."""
    uri = run.storage.s3_uri
    return f"{uri.rstrip('/')}/{out.parent.name}/{out.name}/checkpoints" if uri else None


def rollout_pool(section: sections.TrainerConfig, out: Path) -> PoolSpec | None:
    """SAO's rollout pool (`posttrain.sao.rollout_nodes` > 0): each node runs
    `python -m trainers.posttrain.rollout pool {out}/rollout --node I --nodes N --procs W`."""
    if not isinstance(section, sections.SAOConfig) or section.rollout_nodes == 0:
        return None
    n = section.rollout_nodes
    folder = str(out / "rollout")
    args = ("pool", folder, "--node", NODE, "--nodes", str(n), "--procs", str(section.rollout_workers))
    return PoolSpec("rollout", n, "trainers.posttrain.rollout", args, parent_arg="--parent")


def helper_pool(run: PosttrainSpec, out: Path, log: Callable[[str], None]):
    """The trainer's helper pool, running for as long as its launch (a no-op without one). The
    pool's job runs on the step's launcher with the pool's node count, one task per node; the
    rollout folder's `done` of an earlier launch is removed first, so the new pool does not end
    at once."""
    pool = rollout_pool(run.section, out)
    if pool is None:
        return nullcontext()
    (out / "rollout" / rollout.DONE).unlink(missing_ok=True)
    config = run.launch.model_copy(update={"nodes": pool.nodes, "procs_per_node": 1})
    poll = {"slurm": config.slurm.poll_seconds, "kubernetes": config.kubernetes.poll_seconds}.get(config.kind, 1.0)
    return PoolRunner(get_launcher(config), pool, out, log, poll_s=poll)


def launch_trainer(
    trainer: str,
    run: PosttrainSpec,
    policy: Path,
    data: Path,
    out: Path,
    log: Callable[[str], None] = print,
    progress: Callable[[float], None] | None = None,
    flow_run: str | None = None,
) -> dict[str, Any]:
    """Run trainer `trainer` on `run.launch` until it finishes; return the meta its main rank wrote.
    In a flow run (`flow_run`, its name), the main rank's log rows go to `run.tracker` in that
    run's tracker folder, beside its pretraining stages."""
    out.mkdir(parents=True, exist_ok=True)
    spec = TrainerSpec(
        trainer=trainer,
        section=run.section,
        policy=str(policy),
        data=str(data),
        out=str(out),
        seed=run.seed,
        device=run.device,
        tracker=run.tracker,
        tracker_dir=str(tracker_dir(out.parent.parent, run.tracker, out, trainer, flow_run)) if flow_run else "",
    )
    remote = s3_checkpoints(run, out)
    config = launch_config(run)
    # A cluster launch's main rank pulls a lost checkpoint itself (trainers/posttrain/__main__.py
    # `pull_mirror`): the flow host moves no checkpoint bytes. The local launcher's ranks run here,
    # so the step pulls before the launch.
    cluster = config.kind != "local"
    if remote:
        spec = spec.model_copy(update={"mirror": MirrorTarget(uri=remote, storage=run.storage, pull=cluster)})
    spec.save(out / SPEC)
    (out / RESULT).unlink(missing_ok=True)  # only this launch's result counts
    (out / PULLED).unlink(missing_ok=True)  # the other ranks wait for this launch's pull
    ckpts = out / "checkpoints"
    if remote and not cluster and not has_complete_checkpoint(ckpts):
        # The local copy is gone (a new machine, a cleaned disk, a killed pull's leftovers): resume from the mirror.
        pulled = pull_latest_checkpoint(remote, ckpts, run.storage)
        if pulled is not None:
            log(f"{trainer}: pulled {pulled.name} from {remote}")
    log(f"{trainer}: {run.section.max_steps} steps of {run.section.batch} on {config.describe()}")
    line = progress_lines(log, progress)

    with helper_pool(run, out, log):  # the main rank uploads the checkpoints itself (spec.mirror)
        get_launcher(config).launch(
            out / SPEC, out, line, on_start=lambda handle: (out / ".trainer.pgid").write_text(str(handle))
        )
    try:
        meta = json.loads((out / RESULT).read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"{trainer}: the launch finished but its main rank wrote no {out / RESULT} ({exc}); see the log above"
        ) from None
    return {**meta, "launch": config.describe(), **({"s3_checkpoints": remote} if remote else {})}
