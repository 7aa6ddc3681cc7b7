"""The arithmetic of single-rollout asynchronous RL (trainers/posttrain/sao.py), as plain functions.

- Staleness: a sample carries the policy version that generated it; one more than
  `max_staleness` versions behind the trainer is dropped, and counted (`split_stale`).
- GAE over one completion (`gae`): the reward arrives at the last token, the state after it is
  terminal (value 0). Run twice with separate lambdas, as VAPO does: lambda 1 for the value
  targets (Monte-Carlo returns, unbiased for the value), a smaller one for the policy advantages
  (less variance).
- The decoupled PPO objective of AReaL (`decoupled_ppo_loss`): the behaviour policy (the rollout
  worker's, possibly versions old) is separated from the trust-region anchor, the proximal policy
  (the trainer's policy when the batch arrived). Per token,

      w = min(pi_prox / pi_behav, is_cap)         (truncated importance weight, no gradient)
      r = pi_theta / pi_prox                      (ratio the clip acts on)
      loss = -w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)

  averaged over the completion tokens of the batch. With behaviour = proximal (on-policy) w is 1
  and it is PPO's clipped objective.
- The effective sample size of the importance weights, `(sum w)^2 / sum w^2` (`ess`): the batch's
  token count when every weight is equal, less the more the weights spread.
- Explained variance of the value predictions, `1 - Var(target - value) / Var(target)`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch


def staleness(version: int, sample_version: int) -> int:
    """Policy versions between the trainer (`version`) and the policy that generated a sample."""
    if sample_version > version:
        raise ValueError(
            f"a sample from policy version {sample_version} reached the trainer at version {version}: "
            "samples from a newer policy than the trainer's cannot exist (a stale queue after a restart?)"
        )
    return version - sample_version


def split_stale(
    samples: Sequence[dict[str, Any]], version: int, max_staleness: int
) -> tuple[list[dict[str, Any]], Counter]:
    """(samples at most `max_staleness` versions behind `version`, dropped count by staleness)."""
    kept, dropped = [], Counter()
    for s in samples:
        lag = staleness(version, int(s["version"]))
        if lag > max_staleness:
            dropped[lag] += 1
        else:
            kept.append(s)
    return kept, dropped


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimates of one trajectory: (T,) rewards and (T,) values of the
    states before each action; the state after the last action is terminal (value 0)."""
    if rewards.shape != values.shape or rewards.dim() != 1:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must be equal (T,)")
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    for t in reversed(range(T)):
        following = values[t + 1] if t + 1 < T else torch.zeros((), dtype=values.dtype)
        delta = rewards[t] + gamma * following - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


def decoupled_ppo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    is_cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO loss over (B, T) token log-probs (current with gradient, proximal
    and behaviour without), advantages and a 0/1 mask of completion tokens; and its statistics:
    mean importance weight, share of weights truncated, share of tokens clipped, ESS."""
    mask = mask.to(logp.dtype)
    tokens = mask.sum().clamp(min=1.0)
    raw = torch.exp(logp_prox - logp_behav).detach()
    weights = raw.clamp(max=is_cap)
    ratio = torch.exp(logp - logp_prox.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    per_token = -weights * torch.min(unclipped, clipped)
    loss = (per_token * mask).sum() / tokens
    w = weights[mask.bool()]
    with torch.no_grad():
        stats = {
            "is_weight_mean": float(w.mean()) if w.numel() else 1.0,
            "is_truncated_share": float(((raw > is_cap).to(logp.dtype) * mask).sum() / tokens),
            # tokens whose ratio left [1 - clip, 1 + clip]
            "clip_share": float((((ratio < 1 - clip) | (ratio > 1 + clip)).to(logp.dtype) * mask).sum() / tokens),
            **ess(w),
        }
    return loss, stats


def ess(weights: torch.Tensor) -> dict[str, float]:
    """Effective sample size of importance weights, `(sum w)^2 / sum w^2`, and its share of the count."""
    n = weights.numel()
    if n == 0:
        return {"ess": 0.0, "ess_share": 0.0}
    value = float(weights.sum() ** 2 / (weights**2).sum().clamp(min=1e-12))
    return {"ess": value, "ess_share": value / n}


def explained_variance(values: torch.Tensor, targets: torch.Tensor) -> float:
    """1 - Var(targets - values) / Var(targets): 1 a perfect value, 0 no better than the mean."""
    var = targets.var(unbiased=False)
    if var <= 0:
        return 0.0
    return float(1.0 - (targets - values).var(unbiased=False) / var)
