"""AdamW with the SmolLM3 weight-decay rule: decay matrices, never embeddings or norms."""

from __future__ import annotations

import torch
from torch import nn

from model.spec import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # 1-D parameters are norm gains; the embedding doubles as the tied output head.
        if param.ndim < 2 or name.startswith("embed."):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, spec: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, spec.weight_decay),
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        foreach=True,
    )


def apply_hyperparameters(optimizer: torch.optim.Optimizer, spec: OptimizerConfig) -> None:
    """Re-impose the spec after loading a checkpoint, whose param_groups carry the old values."""
    decay_group, no_decay_group = optimizer.param_groups
    for group in (decay_group, no_decay_group):
        group["betas"], group["eps"] = spec.betas, spec.eps
    decay_group["weight_decay"], no_decay_group["weight_decay"] = spec.weight_decay, 0.0
