"""Learning-rate schedules: warmup-stable-decay (WSD, SmolLM3) and cosine.

A schedule is a pure function of a position in a run of `total` steps, so one WSD schedule
can span several stages: stage k evaluates positions s_k, s_k + 1, ... of the same curve.
"""

from __future__ import annotations

import math

from model.spec import ScheduleSpec


def lr_at(position: int, peak_lr: float, spec: ScheduleSpec, total: int) -> float:
    """Learning rate of the optimizer step at `position` (0-indexed) of a `total`-step schedule."""
    if position < spec.warmup_steps:
        return peak_lr * (position + 1) / spec.warmup_steps
    if position >= total:
        return spec.min_lr
    if spec.kind == "wsd":
        decay_steps = round(spec.decay_fraction * total)
        decay_start = total - decay_steps
        if position < decay_start or decay_steps == 0:
            return peak_lr
        progress = (position - decay_start + 1) / decay_steps  # the last step reaches min_lr
        return peak_lr + (spec.min_lr - peak_lr) * progress
    progress = (position - spec.warmup_steps + 1) / max(1, total - spec.warmup_steps)
    return spec.min_lr + (peak_lr - spec.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
