"""Experiment trackers: what rank 0 writes as it trains, for the tools users already read.

`training.tracker.kind` picks one (TrackerConfig, model/spec.py):
- `tensorboard` (default): event files written with torch's `SummaryWriter`, one folder per flow
  run with a sub-run per stage (`{workspace}/tensorboard/{flow run}/{stage}-{folder}`), flushed at
  every metrics line, so `tensorboard --logdir {workspace}/tensorboard` shows every stage of every
  run live. Stages log at the run's global step (`TrainSpec.run_first_step` + the stage's step:
  a run's stages draw one curve) with the tokens seen (`progress/tokens_seen`, and the loss and
  learning rate against tokens under `by_tokens/`). A resumed launch purges the events after its
  checkpoint (`purge_step`): the redone steps replace the lost ones instead of drawing a second
  curve. A reused (cached) stage keeps the folder of the flow run that trained it;
- `wandb`: a W&B run per stage through W&B's own client (`wandb.init`, `wandb.log`), its files in
  the stage's run folder, resumed by a stable id; `tracker.wandb_mode: offline` writes locally
  (`wandb sync` uploads later);
- `mlflow`: an MLflow run per stage through MLflow's client (`tracker.mlflow_uri`, default a file
  store `{workspace}/mlruns`), resumed by the run id kept in the stage's run folder;
- `none`: metrics.jsonl and the lineage only.
W&B and MLflow are not dependencies of this project: choosing one without its package installed
fails before any rank starts, naming the package to install (`check_tracker`).

Scalars (trainers/pretrain.py, per metrics line): train/loss, train/lr, train/grad_norm,
train/skipped_steps, perf/tokens_per_s, perf/mfu, memory/peak_gib (CUDA) or memory/rss_gib (CPU);
progress/tokens_seen, progress/stage_step; the evaluation of a stage's checkpoint adds
eval/{task}/{metric} at its global step (tasks/evaluate.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.files import path_from_file
from model.spec import TrackerConfig

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # kind -> PyPI package
MLFLOW_RUN_FILE = "mlflow_run_id"
BY_TOKENS = ("train/loss", "train/lr")  # drawn against tokens seen too in TensorBoard


class TrackerUnavailable(RuntimeError):
    """The tracker a recipe chose cannot be used here; the message names what to install."""


def check_tracker(config: TrackerConfig) -> None:
    """Raise `TrackerUnavailable` when the chosen tracker's client package is not installed."""
    package = PACKAGES.get(config.kind)
    if package is not None and importlib.util.find_spec(package) is None:
        raise TrackerUnavailable(
            f"training.tracker.kind is {config.kind!r} but the {package!r} package is not installed; "
            f"install it (pip install {package}) or choose another tracker (tensorboard, none)"
        )


def _folder_name(text: str) -> str:
    """`text` as one safe folder name (runs of other characters become `-`)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)


def run_name(stage_dir: Path, stage: str) -> str:
    """`{stage}-{folder}`: readable in a tracker's run list, unique per stage folder."""
    return _folder_name(f"{stage}-{Path(stage_dir).name}")


def tracker_dir(
    workspace: Path, config: TrackerConfig, stage_dir: Path, stage: str, flow_run: str | None = None
) -> Path:
    """Where a stage's tracker files go: `{workspace}/{tensorboard|wandb|mlruns}/{flow run}/{stage}-{folder}`
    (one folder per flow run, its stages as sub-runs: TensorBoard draws them as one run's runs);
    without a flow run (a build called directly) `.../{stage}-{folder}`."""
    root = Path(workspace) / {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlruns"}.get(
        config.kind, "tracker"
    )
    if flow_run:
        root = root / _folder_name(flow_run)
    return root / run_name(stage_dir, stage)


def _flow_run_of(folder: Path) -> str | None:
    """The flow run a tracker folder belongs to (`{root}/{flow run}/{stage}-{folder}`), if any."""
    parent = Path(folder).parent
    return parent.name if parent.parent.name in ("tensorboard", "wandb", "mlruns", "tracker") else None


def _finite(scalars: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in scalars.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class Tracker:
    """A sink for scalars by step (the run's global step); `close()` flushes. Subclasses talk to
    one tool. `tokens`, when given, is the run's tokens seen at that step: W&B and MLflow get it
    as the scalar `progress/tokens_seen` to plot against; TensorBoard, whose x-axis is a step,
    also draws the losses against it (`by_tokens/...`, step = tokens seen)."""

    def log(self, step: int, scalars: Mapping[str, Any], tokens: int | None = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    def __init__(self, folder: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder.mkdir(parents=True, exist_ok=True)
        # purge_step: events at or after it (steps lost with a killed launch) are hidden when read.
        self.writer = SummaryWriter(str(folder), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, scalars: Mapping[str, Any], tokens: int | None = None) -> None:
        values = _finite(scalars)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        if tokens is not None:
            for tag in BY_TOKENS:
                if tag in values:
                    self.writer.add_scalar(f"by_tokens/{tag.replace('/', '_')}", values[tag], tokens)
        self.writer.flush()  # live: the file grows at every metrics line

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, folder: Path, config: TrackerConfig, name: str, settings: Mapping[str, Any]) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        # A stable id per stage folder: a resumed launch continues the same W&B run.
        run_id = re.sub(r"[^a-z0-9]+", "-", name.lower())[-64:]
        self.run = wandb.init(
            project=config.project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(folder),
            mode=config.wandb_mode,
            config=dict(settings),
            group=_flow_run_of(folder),  # a flow run's stages and trainers side by side
        )

    def log(self, step: int, scalars: Mapping[str, Any], tokens: int | None = None) -> None:
        self.run.log(_finite(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    def __init__(self, folder: Path, config: TrackerConfig, name: str, settings: Mapping[str, Any]) -> None:
        import mlflow

        folder.mkdir(parents=True, exist_ok=True)
        self.client = mlflow.MlflowClient(tracking_uri=config.mlflow_uri or folder.parent.resolve().as_uri())
        experiment = self.client.get_experiment_by_name(config.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(config.project)
        saved = folder / MLFLOW_RUN_FILE
        if saved.exists():  # a resumed launch continues its run
            self.run_id = saved.read_text().strip()
        else:
            group = _flow_run_of(folder)
            run = self.client.create_run(experiment_id, run_name=name, tags={"flow_run": group} if group else None)
            self.run_id = run.info.run_id
            saved.write_text(self.run_id)
            for key, value in settings.items():
                self.client.log_param(self.run_id, key, json.dumps(value) if not isinstance(value, str) else value)

    def log(self, step: int, scalars: Mapping[str, Any], tokens: int | None = None) -> None:
        for key, value in _finite(scalars).items():
            self.client.log_metric(self.run_id, key, value, step=step)

    def close(self) -> None:
        pass  # the run stays open: an evaluation of the stage's checkpoint may still log to it


def open_tracker(
    config: TrackerConfig,
    folder: Path,
    name: str,
    resume_step: int | None = None,
    settings: Mapping[str, Any] | None = None,
) -> Tracker | None:
    """The tracker `config` chooses, writing to `folder`; None for kind `none`."""
    if config.kind == "none":
        return None
    check_tracker(config)
    if config.kind == "tensorboard":
        return TensorBoardTracker(folder, resume_step)
    if config.kind == "wandb":
        return WandbTracker(folder, config, name, settings or {})
    return MlflowTracker(folder, config, name, settings or {})


def log_scores(stage_dir: Path, step: int, scores: Mapping[str, Mapping[str, Any]]) -> Path | None:
    """Evaluation scores of a stage's checkpoint (`{task: {metric: value}}`, stderr left out) into
    that stage's tracker at the stage's `step` (logged at the run's global step: the stage's
    `run_first_step` plus `step`), as `eval/{task}/{metric}`. Reads the stage's spec.json for its
    tracker; returns the run folder written to (None: no tracker, or no stage spec)."""
    try:
        spec = json.loads((Path(stage_dir) / "spec.json").read_text())
    except (OSError, ValueError):
        return None
    config = TrackerConfig(**spec.get("tracker", {}))
    # recorded relative to spec.json inside a workspace (TrainSpec.save(relative_to=))
    recorded = spec.get("tracker_dir")
    folder = Path(path_from_file(recorded, Path(stage_dir) / "spec.json")) if recorded else Path(stage_dir) / "tracker"
    tracker = open_tracker(config, folder, run_name(stage_dir, spec.get("stage", "stage")))
    if tracker is None:
        return None
    scalars = {
        f"eval/{task}/{metric}": value
        for task, metrics in scores.items()
        for metric, value in metrics.items()
        if not metric.endswith("_stderr")
    }
    try:
        tracker.log(int(spec.get("run_first_step") or 0) + step, scalars)  # the run's global step
    finally:
        tracker.close()
    return folder
