"""TrainSpec: a training stage as one typed value, the pretrain step's config and the trainer's input.

Every training setting is declared once, in `TrainSettings`: the recipe's `training` section
(tasks/pretrain.py `TrainingConfig`) and `TrainSpec` extend it, and a stage's own settings are
`StageSettings`, derived from it with every field optional (`all_optional`), so a new setting is
one line here plus its use in the trainer. The recipe's `training.optimizer` is the trainer's own
`OptimizerConfig`. flows/stage_plan.py lays the recipe's stages out as `TrainSpec`s (schedule
positions, per-stage batch and sequence length, seed); the pretrain step fingerprints the spec's identity fields, binds the paths that come from
its inputs and folder (`mixture_plan`, `out_dir`, `init_from`), writes it as `spec.json` and
launches `torchrun ... -m trainers.pretrain spec.json`. One type end to end: no dict in between, no
mapping back from `spec.json` (an anneal reads a stage's spec with `TrainSpec.load`).

Fields marked operational (`pipeline.artifact.operational`) say how a stage runs (checkpoint and
log intervals, threads, micro-batching, the data loader's open shards and prefetch, the MFU peak, activation checkpointing, the loss chunk,
tensor and context parallelism and HSDP, asynchronous checkpoint writes, the hang watchdog, flag thresholds,
NaN recovery, the tracker): they never enter a fingerprint, since they change memory, speed,
floating-point summation order or what is watched, never what is computed. `skip_spikes` changes
the weights, so it is identity, but added after fingerprints were published
(`pipeline.artifact.added_identity`): left off, it moves no fingerprint. Unknown keys are refused,
so a typo fails before any rank starts work.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_serializer, model_validator
from pydantic.fields import FieldInfo

from infra.files import path_for_file, path_from_file
from infra.storage import MirrorTarget
from pipeline.artifact import added_identity, operational

# The spec's paths (bound by the pretrain step from its inputs and folder)
PATH_FIELDS = ("metrics_path", "mixture_plan", "out_dir", "init_from", "tracker_dir")


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OptimizerConfig(_Spec):
    """AdamW, as SmolLM3 trained it; the recipe's `training.optimizer` is this class."""

    # peak learning rate (SmolLM3 3B: 2e-4). A recipe's is at most MAX_LR (flows/recipe_values.py);
    # a spec written by hand may go past it, as the trainer's divergence tests do on purpose
    lr: float = Field(default=3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas (SmolLM3)
    eps: float = Field(default=1e-8, gt=0)  # AdamW epsilon
    weight_decay: float = Field(default=0.1, ge=0)  # applied to matrices only: never to embeddings or norms
    grad_clip: float = Field(default=1.0, ge=0)  # max global gradient norm; 0 disables clipping

    @model_validator(mode="after")
    def _betas(self) -> OptimizerConfig:
        if math.isnan(self.lr):
            raise ValueError("optimizer.lr is NaN")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two values in [0, 1), got {list(self.betas)}")
        return self


class ScheduleSpec(_Spec):
    """The learning-rate schedule of one stage, as a window of a possibly longer schedule."""

    kind: Literal["wsd", "cosine"] = "wsd"  # warmup-stable-decay (SmolLM3) or cosine
    warmup_steps: int = Field(default=0, ge=0)  # linear warmup from 0 over the first steps of the whole schedule
    decay_fraction: float = Field(default=0.1, ge=0, le=1)  # wsd: share of total_steps decaying linearly to min_lr
    min_lr: float = Field(default=0.0, ge=0)  # learning rate at the end of the schedule
    # One schedule can span several stages: stage k runs positions start_step .. start_step +
    # steps of a schedule of total_steps. None = this stage alone (total = the stage's steps).
    total_steps: int | None = Field(default=None, gt=0)
    # Position of this stage's first step. None = 0, or, with init_from and not
    # reset_schedule, the global step stored in the init checkpoint (the schedule continues).
    start_step: int | None = Field(default=None, ge=0)


class PeakCalibration(_Spec):
    """A host's measured matmul rate, stored by preflight: the MFU peak where no datasheet value
    applies (CPU, unknown GPUs). See model/flops.py `resolve_peak`."""

    host: str  # where it was measured: a rank on another host does not use it
    device: Literal["cpu", "cuda"]  # what was measured
    dtype: Literal["float32", "bfloat16"]  # in which precision
    flops: float = Field(gt=0)  # FLOP/s per device (CPU: per process at `threads` threads)
    threads: int | None = Field(default=None, gt=0)  # CPU threads of the measurement
    source: str  # how it was measured, for the metrics (`mfu_peak_source`)


class WatchdogConfig(_Spec):
    """When a stage counts as hung (trainers/watchdog.py): no completed step on a rank within
    max(floor_s, multiple x the running median step time); before the first step and while a
    checkpoint is written, their own bounds. Every rank watches itself; the pretrain step watches
    the ranks' heartbeats too (a rank frozen whole cannot watch itself)."""

    enabled: bool = True  # off: nothing watches for hangs (a hung collective waits for its own timeout)
    multiple: float = Field(default=10.0, gt=1)  # bound = this x the running median step time...
    floor_s: float = Field(default=300.0, gt=0)  # ...never below this many seconds
    window: int = Field(default=100, ge=1)  # steps in the running median
    startup_s: float = Field(default=1800.0, gt=0)  # bound before a launch's first step (build, load, compile)
    checkpoint_s: float = Field(default=1800.0, gt=0)  # bound while a checkpoint is being saved
    heartbeat_s: float = Field(
        default=10.0, ge=0.1
    )  # how often each rank writes its heartbeat file (a floor: no busy loop)
    grace_s: float = Field(
        default=30.0, ge=0
    )  # step side: after a hang is known, wait this long for the launch to end, then end it
    # step side: polls in a row (each on time: the step's own process ran) a rank must be seen
    # silent or idle past its bound before it is reported (a late heartbeat on a loaded host is not)
    confirm: int = Field(default=2, ge=1)


class MonitorConfig(_Spec):
    """Stragglers and throughput drops (trainers/monitor.py), checked at every metrics line over
    the last `window` lines, each launch against its own warm-up and the machine's pace; a flag
    is raised (and cleared) only when its rule held on `confirm` lines in a row."""

    # A rank whose own work (data loading and optimizer update: the parts of a step that wait for
    # no other rank) takes this fraction longer than the median of the other ranks' is named.
    straggler_margin: float = Field(default=0.5, gt=0)
    # ...and only when that excess is at least this share of a step at the stage's reference pace
    # (noise in tiny sections; the measured step is lengthened by the straggler itself).
    straggler_min_share: float = Field(default=0.01, ge=0)
    # ...and only when it was over that margin (and that excess) on at least this share of the
    # window's lines: its mean over the window is what it cost, but one or two lines a loaded
    # machine slowed on any rank name nobody
    straggler_min_lines: float = Field(default=0.3, gt=0, le=1)
    # tokens/s (over the window) below this fraction of the launch's own reference, at the
    # machine's pace now (its CPU wait), is a drop; recovered at half-way back to it
    throughput_fraction: float = Field(default=0.7, gt=0, lt=1)
    reference_skip: int = Field(default=5, ge=0)  # first steps of each launch judged by nothing (warm-up)
    reference_steps: int = Field(default=50, ge=1)  # steps after those whose median tokens/s is the launch's reference
    window: int = Field(default=5, ge=1)  # metrics lines a flag is decided over (one noisy line is no flag)
    confirm: int = Field(default=3, ge=1)  # lines in a row a rule must hold before a flag is raised or cleared


class SpikeSkipConfig(_Spec):
    """OLMo-core's skip-step rule: a step whose loss or gradient norm lies more than `sigma`
    standard deviations from the mean of the previous `window` steps is not applied (no weight or
    optimizer-state update); its batch is consumed. Two-sided, as OLMo-core's."""

    window: int = Field(default=128, ge=2)  # previous steps the mean and deviation are taken over
    sigma: float = Field(default=6.0, gt=0)  # how many deviations away a step is skipped
    min_history: int = Field(default=20, ge=2)  # steps of history before the rule applies


class NonFiniteConfig(_Spec):
    """After a non-finite loss, gradient norm or weights: the pretrain step relaunches the stage
    from its last verified checkpoint with the data that led there skipped (PaLM's remedy)."""

    retries: int = Field(default=2, ge=0)  # data windows skipped per stage before it fails; 0 = fail at once
    # Steps' data up to and including the failing step that is skipped; None = everything since
    # the checkpoint the stage rolls back to (no data that led to the failure is replayed).
    skip_steps: int | None = Field(default=None, ge=1)


class TrackerConfig(_Spec):
    """Where rank 0 sends its metrics as it trains (trainers/tracker.py), besides metrics.jsonl."""

    kind: Literal["tensorboard", "wandb", "mlflow", "none"] = "tensorboard"  # tensorboard: event files in the workspace
    project: str = "smollm3"  # W&B project, MLflow experiment
    wandb_mode: Literal["online", "offline"] | None = None  # None: W&B's own (WANDB_MODE, else online)
    mlflow_uri: str | None = None  # MLflow tracking URI; None = a file store `mlruns/` in the workspace


class LoaderConfig(_Spec):
    """How a rank reads its token shards (model/token_shards.py): memory, open files and overlap,
    never which tokens; every setting draws the same batches."""

    open_shards: int = Field(default=64, gt=0)  # shards open at once per rank: 2 files and 2 memory maps each
    prefetch: int = Field(default=2, ge=0)  # micro-batches a background thread draws ahead; 0 = in the step


class TrainSettings(_Spec):
    """Every training setting a user writes, declared once: the recipe's `training` section is
    this class plus the recipe-only fields (tasks/pretrain.py `TrainingConfig`), a stage's
    overrides are `StageSettings` (the same fields, all optional, derived below), and the
    trainer's `TrainSpec` is this class plus what the schedule layout decides. A new setting is
    one line here and its use in the trainer; the recipe, stages and spec follow."""

    # --- what a stage computes (identity) -----------------------------------------------------
    model_overrides: dict[str, Any] = {}  # ModelConfig fields to change; vocab_size defaults to the plan's
    global_batch: int = Field(default=16, gt=0)  # sequences per optimizer step, over all ranks
    optimizer: OptimizerConfig = OptimizerConfig()  # AdamW: lr (peak), betas, eps, weight_decay, grad_clip
    device: Literal["auto", "cpu", "cuda"] = "auto"  # cuda if available (NCCL + bf16), else cpu
    # Intra-document masking (SmolLM3): attention stays inside each packed document and RoPE
    # positions restart at each document. False = plain causal attention over the whole packed
    # sequence (positions 0..T-1), the ablation the playbook runs against it.
    doc_masking: bool = True
    attention_backend: Literal["auto", "sdpa", "flex"] = "auto"  # flex on cuda, sdpa on cpu
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on cuda, fp32 on cpu
    skip_spikes: SpikeSkipConfig | None = added_identity(None)  # OLMo-core's skip-step rule; None = off

    # --- how it runs (operational) ------------------------------------------------------------
    micro_batch: int = operational(8, gt=0)  # sequences per data-parallel rank per forward/backward
    # What each block keeps for backward (model/recompute.py); "auto": the lightest mode whose
    # predicted peak fits `gpu_memory_gb` (model/memory.py), "none" where no memory is declared.
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = operational("none")
    loss_chunk_tokens: int = operational(1024, gt=0)  # logits rows alive at once in the loss (model/loss.py)
    tp: int = operational(1, gt=0)  # tensor-parallel degree inside a node (model/parallel.py)
    cp: int = operational(
        1, gt=0
    )  # context-parallel degree: ranks each sequence is split over (model/context_parallel.py)
    hsdp: bool = operational(False)  # shard inside a node, replicate across nodes (multi-node runs)
    async_checkpoint: bool = operational(False)  # DCP async_save: training goes on while shards are written
    gpu_memory_gb: float | None = operational(None, gt=0)  # declared memory per GPU (GB; H100: 80): stages must fit it
    checkpoint_interval: int = operational(25, gt=0)  # save every N steps (and at the last step)
    keep_last: int = operational(2, ge=1)  # complete checkpoints kept besides stage ends
    log_interval: int = operational(1, gt=0)  # a metrics line every N steps
    # torch.compile each block (same math, fused kernels); "auto": on CUDA, eager elsewhere (CPU:
    # compiling costs more than it saves at test sizes, and eager is the oracle the tests compare to)
    compile_model: Literal["auto"] | bool = operational("auto")
    # q, k, v as one matmul over their concatenated weights (model/attention.py); off by default:
    # 2.7-5.3% slower on CPU (docs/model.md, Throughput), no GPU gain measured yet
    fused_qkv: bool = operational(False)
    num_threads: int | None = operational(None, gt=0)  # CPU threads per rank (default: the train slot's)
    peak_flops: float | None = operational(None, gt=0)  # declared peak FLOP/s per device for MFU
    watchdog: WatchdogConfig = operational(WatchdogConfig())  # hang detection
    monitor: MonitorConfig = operational(MonitorConfig())  # stragglers, throughput drops
    # Recovery from a non-finite loss. Operational: a stage that never meets one computes the same;
    # one that does records the data it skipped in its result, metadata and lineage.
    nonfinite: NonFiniteConfig = operational(NonFiniteConfig())
    tracker: TrackerConfig = operational(TrackerConfig())  # TensorBoard (default), W&B or MLflow
    loader: LoaderConfig = operational(LoaderConfig())  # shards open at once, micro-batches drawn ahead

    def settings(self) -> dict[str, Any]:
        """This object's training settings by name (nested sections as they are, not dumped)."""
        return {name: getattr(self, name) for name in TrainSettings.model_fields}


class _Overrides(_Spec):
    """Base of the models `all_optional` derives: they dump their own fields, then only the
    derived settings that are set (a resolved recipe lists what a stage changes, not 25 nulls)."""

    derived: ClassVar[frozenset[str]] = frozenset()  # the fields copied from the declaring class

    @model_serializer(mode="wrap")
    def _set_only(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        own = {k: v for k, v in data.items() if k not in self.derived}
        return {**own, **{k: v for k, v in data.items() if k in self.derived and v is not None}}


def all_optional(model: type[BaseModel], name: str, doc: str, exclude: Collection[str] = ()) -> type[BaseModel]:
    """A frozen model with every field of `model` but `exclude`, each optional with default None
    (= not set), keeping its constraints and its identity/operational marker: overrides derived
    from the one declaration, never a hand-kept copy of it."""
    fields = {
        field: (info.annotation | None, FieldInfo.merge_field_infos(info, default=None))
        for field, info in model.model_fields.items()
        if field not in exclude
    }
    derived = create_model(name, __base__=_Overrides, __doc__=doc, __module__=__name__, **fields)
    derived.derived = frozenset(fields)
    return derived


# Settings with one value for the whole run, which no stage sets apart: the model (every stage
# trains the same weights), the optimizer (one peak LR for the one WSD schedule; long-context
# stages scale it by their `lr_scale`), the device and the GPU the recipe checks every stage on.
RUN_WIDE = ("model_overrides", "optimizer", "device", "gpu_memory_gb")

StageSettings = all_optional(
    TrainSettings,
    "StageSettings",
    "A stage's own training settings (the recipe's `stages[]`): any `TrainSettings` field but RUN_WIDE; "
    "None = the `training` section's. A nested section (watchdog, ...) replaces the training one whole.",
    exclude=RUN_WIDE,
)


def stage_settings(overrides: BaseModel) -> dict[str, Any]:
    """The settings a `StageSettings` (or a model derived from it) sets, by name."""
    return {name: v for name in StageSettings.model_fields if (v := getattr(overrides, name)) is not None}


CURVE_POINTS = 1000  # about this many lines in a stage's curve file, whatever its length


def curve_path(metrics: Path) -> Path:
    """Beside a metrics file (`metrics.jsonl`), its downsampled copy (`metrics.curve.jsonl`): every
    `curve_stride`-th line and the last, each with the per-source token and epoch counts that the
    metrics lines themselves leave out."""
    return metrics.with_name(f"{metrics.stem}.curve{metrics.suffix}")


def curve_stride(steps: int, log_interval: int) -> int:
    """Every how many metrics lines of a stage of `steps` steps go to its curve file: at most
    `CURVE_POINTS` (plus the last line); 1 (every line) for a stage of fewer lines."""
    lines = -(-steps // log_interval)
    return max(1, -(-lines // CURVE_POINTS))


class TrainSpec(TrainSettings):
    """One training stage (see the module docstring): its settings, and what the schedule layout
    decides for it."""

    # --- what the stage computes (identity) ---------------------------------------------------
    stage: str = "stage"  # stage name, recorded in checkpoints and metrics
    steps: int = Field(gt=0)  # optimizer steps of this stage
    seq_len: int | None = Field(default=None, gt=0)  # tokens per sequence; None = the plan's
    model_preset: str = "tiny"  # ModelConfig preset name: tiny, smollm3_3b, ablation_1b
    rope_theta: float | None = Field(default=None, gt=0)  # RoPE base override (context extension)
    schedule: ScheduleSpec = ScheduleSpec()  # learning-rate schedule
    reset_optimizer: bool = False  # with init_from: fresh AdamW moments instead of the checkpoint's
    reset_schedule: bool = False  # with init_from: schedule restarts at 0 instead of continuing
    seed: int = 0  # model initialisation seed (the recipe's seed); the data order is the plan's

    # --- how it runs (operational) ------------------------------------------------------------
    # The MFU peak where neither peak_flops nor a datasheet applies (model/flops.py resolve_peak)
    peak_calibration: PeakCalibration | None = operational(None)
    debug_step_sleep_s: float = operational(0.0, ge=0)  # testing only: sleep after each step
    # testing only: a micro-batch holding this token id gets a NaN loss (tests plant it in a shard)
    debug_nan_token: int | None = operational(None, ge=0)
    metrics_path: str | None = operational(None)  # JSONL metrics file; None = {out_dir}/metrics.jsonl

    # --- bound at launch (not identity: the inputs' fingerprints are) -------------------------
    mixture_plan: str = operational("")  # plan.json of the stage's mixture step
    out_dir: str = operational("")  # stage folder: checkpoints/, metrics.jsonl, result.json
    init_from: str | None = operational(None)  # checkpoint to start from (the previous stage's end)
    tracker_dir: str = operational("")  # the stage's tracker run folder; "" = {out_dir}/tracker
    # Where the stage starts in its run's training (the steps and tokens of the stages before it,
    # along its init chain): trackers log at run_first_step + step, so the stages of a run draw
    # one curve against one global step and tokens seen (trainers/tracker.py).
    run_first_step: int = operational(0, ge=0)
    run_first_token: int = operational(0, ge=0)
    # The stage's S3 prefix for its checkpoints (the recipe's `storage`): rank 0 uploads each one
    # as its marker is written (infra/storage.py CheckpointUploader); with `mirror.pull` (a cluster
    # launch) it first pulls the newest one back when the checkpoints folder holds no complete one
    # (trainers/pretrain.py pull_mirror). None: local disk only.
    mirror: MirrorTarget | None = operational(None)

    @model_validator(mode="after")
    def _consistent(self) -> TrainSpec:
        if self.global_batch % self.micro_batch:
            raise ValueError(f"global_batch={self.global_batch} is not a multiple of micro_batch={self.micro_batch}")
        if (self.reset_optimizer or self.reset_schedule) and self.init_from is None and self.out_dir:
            raise ValueError("reset_optimizer / reset_schedule only mean something with init_from")
        return self

    @property
    def monitor_dir(self) -> Path:
        """`{out_dir}/monitor`: heartbeats, hang reports, flags, data skips (trainers/monitor.py)."""
        return Path(self.out_dir) / "monitor"

    @property
    def tracker_path(self) -> Path:
        return Path(self.tracker_dir) if self.tracker_dir else Path(self.out_dir) / "tracker"

    @property
    def metrics_file(self) -> Path:
        return Path(self.metrics_path) if self.metrics_path else Path(self.out_dir) / "metrics.jsonl"

    @property
    def curve_file(self) -> Path:
        """The stage's downsampled metrics (`curve_path`): what the flow process reads."""
        return curve_path(self.metrics_file)

    def bind(
        self, mixture_plan: Path | str, out_dir: Path | str, init_from: str | None, mirror: MirrorTarget | None = None
    ) -> TrainSpec:
        """This stage with the paths its step resolved from its inputs and folder, and its own S3
        prefix (never a spec's it was copied from: an anneal starts from another stage's spec)."""
        return TrainSpec.model_validate(
            {
                **self.model_dump(),
                "mixture_plan": str(mixture_plan),
                "out_dir": str(out_dir),
                "init_from": init_from,
                "mirror": mirror.model_dump() if mirror is not None else None,
            }
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSpec:
        try:
            spec = cls.model_validate(data)
        except ValidationError as err:
            problems = "; ".join(
                f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else f"spec: {e['msg']}"
                for e in err.errors()
            )
            raise ValueError(problems) from None
        if not spec.mixture_plan or not spec.out_dir:
            raise ValueError("spec is incomplete: mixture_plan and out_dir are required to train")
        return spec

    @classmethod
    def load(cls, path: str | Path) -> TrainSpec:
        """A spec file; paths it records relative to itself (`save(relative_to=)`) made absolute."""
        try:
            data = json.loads(Path(path).read_text())
            for name in PATH_FIELDS:
                if isinstance(data.get(name), str) and data[name]:  # "": the field's default place
                    data[name] = path_from_file(data[name], path)
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def save(self, path: str | Path, *, relative_to: str | Path | None = None) -> None:
        """Write the spec; with `relative_to` (the workspace root), its paths inside that root are
        recorded relative to the file (`./REL`, `../REL`), so the workspace can move."""
        data = self.to_dict()
        if relative_to is not None:
            for name in PATH_FIELDS:
                if isinstance(data.get(name), str) and data[name]:
                    data[name] = path_for_file(data[name], path, relative_to)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
