"""The recipe's pretraining stages planned into launches of the pretrain step (tasks/pretrain.py).

SmolLM3's schedule, as data: the `pretrain` stages share ONE warmup-stable-decay schedule (each
stage knows its position in it, `start_step` of `total_steps`, and the decay covers the last
`training.decay_stages` stages), so a stage boundary never resets the learning rate; each
`long_context` stage, then each `reasoning` stage, gets a fresh optimizer and a fresh cosine
schedule at `lr_scale` x the peak LR. `optimizer_steps` is the one formula from tokens to optimizer steps (anneals and CPT use it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from model.spec import ScheduleSpec, TrainSpec, stage_settings
from tasks.mixture import StageConfig
from tasks.pretrain import StageSpec, TrainingConfig


def optimizer_steps(tokens: int, global_batch: int, seq_len: int) -> int:
    """Optimizer steps that train on `tokens` (at least one): the one steps formula."""
    return max(1, math.ceil(tokens / (global_batch * seq_len)))


def stage_batch(stage: StageConfig, training: TrainingConfig) -> tuple[int, int]:
    """(global_batch, micro_batch) of a stage: its own, else the training section's."""
    return (stage.global_batch or training.global_batch, stage.micro_batch or training.micro_batch)


def stage_steps(stage: StageConfig, training: TrainingConfig) -> int:
    return optimizer_steps(stage.tokens, stage_batch(stage, training)[0], stage.seq_len)


def stage_spec(stage: StageConfig, training: TrainingConfig, seed: int, **fields: Any) -> TrainSpec:
    """A recipe stage as a TrainSpec: the training settings, the stage's own over them, and
    `fields`, what the schedule layout decides."""
    settings = {**training.settings(), **stage_settings(stage)}
    own = {"stage": stage.name, "seq_len": stage.seq_len, "rope_theta": stage.rope_theta, "seed": seed}
    return TrainSpec(**{**settings, **own, "model_preset": training.model, **fields})


def schedule_stages(training: TrainingConfig, stages: Sequence[StageConfig], seed: int = 0) -> list[StageSpec]:
    """Resolve the recipe's stages into launches: one WSD across the pretrain stages, then a fresh
    cosine schedule (and optimizer) per long-context and per reasoning stage, in recipe order, at
    `lr_scale` x the peak LR."""
    main = [s for s in stages if s.kind == "pretrain"]
    steps = [stage_steps(s, training) for s in main]
    total = sum(steps)
    decay = sum(steps[len(steps) - training.decay_stages :]) if training.decay_stages else 0
    runs, position = [], 0
    for s, n in zip(main, steps, strict=True):
        schedule = ScheduleSpec(
            kind="wsd",
            warmup_steps=min(training.warmup_steps, total),
            decay_fraction=decay / total if total else 0.0,
            min_lr=training.min_lr,
            total_steps=total,
            start_step=position,
        )
        spec = stage_spec(s, training, seed, steps=n, optimizer=training.optimizer, schedule=schedule)
        runs.append(StageSpec(spec=spec, kind="pretrain", nproc_per_node=training.nproc_per_node, nodes=s.nodes))
        position += n
    for s in stages:
        if s.kind == "pretrain":
            continue
        n = stage_steps(s, training)
        schedule = ScheduleSpec(
            kind="cosine",
            warmup_steps=min(s.warmup_steps, n),
            decay_fraction=1.0,
            min_lr=training.min_lr,
            total_steps=n,
            start_step=0,
        )
        optimizer = training.optimizer.model_copy(update={"lr": training.optimizer.lr * s.lr_scale})
        spec = stage_spec(
            s,
            training,
            seed,
            steps=n,
            optimizer=optimizer,
            schedule=schedule,
            reset_optimizer=True,
            reset_schedule=True,
        )
        runs.append(StageSpec(spec=spec, kind=s.kind, nproc_per_node=training.nproc_per_node, nodes=s.nodes))
    return runs
