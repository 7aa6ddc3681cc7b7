"""TrainSpec: the resolved stage spec, the one JSON crossing from orchestration into torch.

The orchestration layer writes a spec into the stage's folder and launches
`torchrun ... -m model.train spec.json`. Every field is documented where it is declared;
unknown keys are refused, so a typo fails before any rank starts work.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class OptimizerSpec:
    lr: float = 3e-4  # peak learning rate (SmolLM3: 2e-4)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas (SmolLM3)
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # applied to matrices only: never to embeddings or norms
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        _check(
            self.lr >= 0 and not math.isnan(self.lr), f"optimizer.lr must be >= 0, got {self.lr}"
        )
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optimizer.betas must be two values in [0, 1), got {self.betas}",
        )
        _check(self.eps > 0, f"optimizer.eps must be > 0, got {self.eps}")
        _check(
            self.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {self.weight_decay}"
        )
        _check(self.grad_clip >= 0, f"optimizer.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass(frozen=True)
class ScheduleSpec:
    kind: str = "wsd"  # "wsd" (warmup-stable-decay, SmolLM3) or "cosine"
    warmup_steps: int = 0  # linear warmup from 0 over the first steps of the whole schedule
    decay_fraction: float = 0.1  # wsd: share of total_steps spent decaying linearly to min_lr
    min_lr: float = 0.0  # learning rate at the end of the schedule
    # One schedule can span several stages: stage k runs positions start_step .. start_step +
    # steps of a schedule of total_steps. None = this stage alone (total = the stage's steps).
    total_steps: int | None = None
    # Position of this stage's first step. None = 0, or, with init_from and not
    # reset_schedule, the global step stored in the init checkpoint (the schedule continues).
    start_step: int | None = None

    def __post_init__(self) -> None:
        _check(
            self.kind in ("wsd", "cosine"),
            f"schedule.kind must be wsd or cosine, got {self.kind!r}",
        )
        _check(
            self.warmup_steps >= 0, f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}"
        )
        _check(
            0 <= self.decay_fraction <= 1,
            f"schedule.decay_fraction must be in [0, 1], got {self.decay_fraction}",
        )
        _check(self.min_lr >= 0, f"schedule.min_lr must be >= 0, got {self.min_lr}")
        _check(
            self.total_steps is None or self.total_steps > 0,
            f"schedule.total_steps must be > 0, got {self.total_steps}",
        )
        _check(
            self.start_step is None or self.start_step >= 0,
            f"schedule.start_step must be >= 0, got {self.start_step}",
        )


@dataclass(frozen=True)
class TrainSpec:
    mixture_plan: str  # path of the mixture plan JSON written by the data pipeline
    out_dir: str  # stage folder: checkpoints/, metrics.jsonl, result.json land here
    steps: int  # optimizer steps of this stage
    global_batch: int  # sequences per optimizer step, over all ranks
    micro_batch: (
        int  # sequences per rank per forward/backward (global_batch / (micro * W) = accumulation)
    )
    model_preset: str = "tiny"  # ModelConfig preset name: tiny, smollm3_3b, ablation_1b
    model_overrides: dict[str, Any] = field(
        default_factory=dict
    )  # ModelConfig fields to change; vocab_size defaults to the plan's
    seq_len: int | None = (
        None  # tokens per sequence; None = the plan's (raise it for context extension)
    )
    rope_theta: float | None = None  # RoPE base override (context extension: 2M, 5M)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)  # AdamW settings
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)  # learning-rate schedule
    init_from: str | None = (
        None  # checkpoint step folder (or run folder) to start from, e.g. the previous stage's end
    )
    reset_optimizer: bool = False  # with init_from: fresh AdamW moments instead of the checkpoint's
    reset_schedule: bool = False  # with init_from: schedule restarts at 0 instead of continuing
    checkpoint_interval: int = (
        100  # save every N steps (and always at the last step, flagged stage end)
    )
    keep_last: int = 2  # complete checkpoints kept besides stage ends
    seed: int = 0  # model init seed; the data order comes from the plan's seed
    metrics_path: str | None = None  # JSONL metrics file; None = {out_dir}/metrics.jsonl
    log_interval: int = 1  # write a metrics line every N steps
    device: str = "auto"  # "auto" (cuda if available), "cpu" or "cuda"
    attention_backend: str = "auto"  # "auto" (flex on cuda, sdpa on cpu), "sdpa" or "flex"
    precision: str = "auto"  # "auto" (bf16 autocast on cuda, fp32 on cpu), "bf16" or "fp32"
    compile_model: bool = False  # torch.compile each block (forward and backward)
    num_threads: int | None = None  # CPU threads per rank; fix it for bit-reproducible CPU runs
    peak_flops: float | None = (
        None  # declared peak FLOP/s per device for MFU; None = measured matmul peak
    )
    debug_step_sleep_s: float = (
        0.0  # testing only: sleep after each step so a test can kill mid-stage
    )

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            object.__setattr__(self, "optimizer", OptimizerSpec(**self.optimizer))
        if isinstance(self.schedule, dict):
            object.__setattr__(self, "schedule", ScheduleSpec(**self.schedule))
        for name in ("steps", "global_batch", "micro_batch", "checkpoint_interval", "log_interval"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and value > 0,
                f"spec.{name} must be a positive int, got {value!r}",
            )
        _check(
            self.global_batch % self.micro_batch == 0,
            f"spec.global_batch={self.global_batch} is not a multiple of micro_batch={self.micro_batch}",
        )
        _check(self.keep_last >= 1, f"spec.keep_last must be >= 1, got {self.keep_last}")
        _check(
            self.seq_len is None or self.seq_len > 0,
            f"spec.seq_len must be > 0, got {self.seq_len}",
        )
        _check(
            self.rope_theta is None or self.rope_theta > 0,
            f"spec.rope_theta must be > 0, got {self.rope_theta}",
        )
        _check(
            self.device in ("auto", "cpu", "cuda"),
            f"spec.device must be auto, cpu or cuda, got {self.device!r}",
        )
        _check(
            self.attention_backend in ("auto", "sdpa", "flex"),
            f"spec.attention_backend must be auto, sdpa or flex, got {self.attention_backend!r}",
        )
        _check(
            self.peak_flops is None or self.peak_flops > 0,
            f"spec.peak_flops must be > 0, got {self.peak_flops}",
        )
        _check(self.debug_step_sleep_s >= 0, "spec.debug_step_sleep_s must be >= 0")
        _check(
            (not self.reset_optimizer and not self.reset_schedule) or self.init_from is not None,
            "spec.reset_optimizer / reset_schedule only mean something with init_from",
        )

    @property
    def metrics_file(self) -> Path:
        return (
            Path(self.metrics_path) if self.metrics_path else Path(self.out_dir) / "metrics.jsonl"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSpec:
        for klass, payload, where in (
            (cls, data, "spec"),
            (OptimizerSpec, data.get("optimizer") or {}, "spec.optimizer"),
            (ScheduleSpec, data.get("schedule") or {}, "spec.schedule"),
        ):
            unknown = set(payload) - {f.name for f in dataclasses.fields(klass)}
            if unknown:
                raise ValueError(f"unknown {where} field(s) {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as err:  # a required field is missing
            raise ValueError(f"spec is incomplete: {err}") from err

    @classmethod
    def load(cls, path: str | Path) -> TrainSpec:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
