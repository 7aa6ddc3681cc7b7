"""RL with verifiable rewards: TRL's `GRPOTrainer` on arithmetic prompts.

Rewards: exact match of the final `Answer: N` against the known answer (1/0) plus a weighted
format reward (a worked solution ending in `Answer: N`), so early policies that never hit the
answer still get a gradient towards the right shape. Each prompt gets `num_generations`
completions whose rewards are normalised within the group; `beta` is the KL penalty to the
starting policy.

The step launches `train_grpo` on the recipe's launcher (trainers/posttrain/launch.py) and is
resumable like every post-training step: the trainer checkpoints every `save_steps` into
`{step folder}/checkpoints/step_N` (trainers/posttrain/common.py); after a crash the rerun (same
fingerprint, folder kept by `resumable=True`) resumes from the newest verified checkpoint
(weights, optimizer, scheduler, RNG, data position) instead of starting over.

Runs on every rank of a launch (`python -m trainers.posttrain`); the `grpo` step
(tasks/posttrain/grpo.py) launches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainers.posttrain.chat_data import exact_match_reward, format_reward, read_jsonl
from trainers.posttrain.common import (
    checkpoint_callback,
    fit,
    load_policy,
    model_meta,
    plain_print,
    progress_callback,
    quiet,
    reward_trend,
    save_policy,
    stop_ids,
    trainer_args,
    write_history,
)
from trainers.posttrain.sections import GRPOConfig


def weighted(fn: Callable[..., list[float]], weight: float) -> Callable[..., list[float]]:
    def reward(completions, **kw):
        return [weight * r for r in fn(completions, **kw)]

    reward.__name__ = fn.__name__
    return reward


@plain_print()
def train_grpo(
    cfg: GRPOConfig,
    policy: Path,
    data: Path,
    out: Path,
    seed: int = 0,
    device: str = "auto",
    log: Callable[[str], None] = print,
    progress: Callable[[float], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """GRPO from the model in `policy` on `data/prompts.jsonl` (resuming from a checkpoint in
    `out`); write `out/model`; return the meta."""
    import trl  # trl.GRPOConfig, not ours (trainers/posttrain/sections.py)
    from datasets import Dataset

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(policy, cfg.bf16)
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in read_jsonl(data / "prompts.jsonl")]
    if cfg.prompts is not None:
        if cfg.prompts > len(prompts):
            raise ValueError(
                f"posttrain.grpo.prompts = {cfg.prompts}, but {data / 'prompts.jsonl'} holds "
                f"{len(prompts)} prompts: lower it, or raise posttrain.data.prompts"
            )
        prompts = prompts[: cfg.prompts]
    draws = cfg.max_steps * cfg.batch // cfg.num_generations
    log(
        f"grpo: a pool of {len(prompts)} prompts, {draws} drawn over {cfg.max_steps} updates ({draws / len(prompts):.1f} epochs)"
    )
    args = trl.GRPOConfig(
        **trainer_args(cfg, out, seed, device),
        num_generations=cfg.num_generations,
        beta=cfg.beta,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        generation_kwargs={"eos_token_id": stop_ids(tokenizer)},
    )
    trainer = trl.GRPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
        reward_funcs=[exact_match_reward, weighted(format_reward, cfg.format_weight)],
        callbacks=[progress_callback(progress, log, out), checkpoint_callback(out, cfg.keep_checkpoints), *callbacks],
    )
    quiet(trainer)
    resumed = fit(trainer, out, log, "grpo")
    facts = write_history(trainer, out)
    rewards = [
        h["rewards/exact_match_reward/mean"]
        for h in trainer.state.log_history
        if "rewards/exact_match_reward/mean" in h
    ]
    trend, said = reward_trend(rewards)
    facts |= {"resumed_from_step": resumed, **{f"exact_{k}": v for k, v in trend.items()}}
    folder = save_policy(trainer, tokenizer, out / "model")
    log(f"grpo: {facts['steps']} steps; exact-match reward {said}")
    return model_meta(
        "grpo", folder, started, num_generations=cfg.num_generations, beta=cfg.beta, prompts=len(prompts), **facts
    )
