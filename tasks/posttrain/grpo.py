"""RL with verifiable rewards: TRL's `GRPOTrainer` on arithmetic prompts.

Rewards: exact match of the final `Answer: N` against the known answer (1/0) plus a weighted
format reward (a worked solution ending in `Answer: N`), so early policies that never hit the
answer still get a gradient towards the right shape. Each prompt gets `num_generations`
completions whose rewards are normalised within the group; `beta` is the KL penalty to the
starting policy.

The step is resumable: the trainer checkpoints into `{step folder}/trainer/checkpoint-N` every
`save_steps`; after a crash the rerun (same fingerprint, folder kept by `resumable=True`)
resumes from the newest complete checkpoint (weights, optimizer, scheduler, RNG, data position)
instead of starting over.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from infra.artifact import Inputs
from tasks.posttrain.common import (
    load_policy,
    model_dir,
    model_meta,
    plain_print,
    progress_callback,
    quiet,
    save_policy,
    stop_ids,
    trainer_args,
    write_history,
)
from tasks.posttrain.config import GRPOSection, TrainerRun
from tasks.posttrain.data import exact_match_reward, format_reward, read_jsonl
from tasks.step import one, step

# What makes a checkpoint folder usable for resuming: Trainer writes trainer_state.json after
# the weights and optimizer, so a folder cut short by a crash lacks it.
_CHECKPOINT_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt")


def newest_checkpoint(folder: Path) -> Path | None:
    """The highest-step complete `checkpoint-N` under `folder`, or None."""
    found = []
    for path in Path(folder).glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if m and path.is_dir() and all((path / f).is_file() for f in _CHECKPOINT_FILES):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def weighted(fn: Callable[..., list[float]], weight: float) -> Callable[..., list[float]]:
    def reward(completions, **kw):
        return [weight * r for r in fn(completions, **kw)]

    reward.__name__ = fn.__name__
    return reward


@plain_print()
def train_grpo(
    cfg: GRPOSection, policy: Path, data: Path, out: Path, seed: int = 0, device: str = "auto",
    log: Callable[[str], None] = print, progress: Callable[[float], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """GRPO from the model in `policy` on `data/prompts.jsonl`; resume if `out/trainer` holds a
    checkpoint; write `out/model`; return the meta."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(policy, cfg.bf16)
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in read_jsonl(data / "prompts.jsonl")]
    args = GRPOConfig(
        **trainer_args(cfg, out / "trainer", seed, device, save_strategy="steps",
                       save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit),
        num_generations=cfg.num_generations,
        beta=cfg.beta,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        generation_kwargs={"eos_token_id": stop_ids(tokenizer)},
    )
    trainer = GRPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(prompts), processing_class=tokenizer,
        reward_funcs=[exact_match_reward, weighted(format_reward, cfg.format_weight)],
        callbacks=[progress_callback(progress, log), *callbacks],
    )
    quiet(trainer)
    resume = newest_checkpoint(out / "trainer")
    if resume is not None:
        log(f"grpo: resuming from {resume.name}")
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    facts = write_history(trainer, out)
    rewards = [h["rewards/exact_match_reward/mean"] for h in trainer.state.log_history
               if "rewards/exact_match_reward/mean" in h]
    facts |= {
        "resumed_from_step": int(resume.name.split("-")[1]) if resume else None,
        "first_exact_reward": round(rewards[0], 4) if rewards else None,
        "last_exact_reward": round(rewards[-1], 4) if rewards else None,
    }
    folder = save_policy(trainer, tokenizer, out / "model")
    log(f"grpo: {facts['steps']} steps, exact-match reward {facts['first_exact_reward']} -> "
        f"{facts['last_exact_reward']}")
    return model_meta("grpo", folder, model, started, num_generations=cfg.num_generations,
                      beta=cfg.beta, **facts)


@step("grpo", version=2, kind="hf_model", resumable=True, resource="train", isolate=True)
def grpo(config: TrainerRun[GRPOSection], inputs: Inputs, out: Path, *, log=print, progress=None) -> dict[str, Any]:
    """The policy (input `model`) trained with GRPO on the prompts of input `data`; resumes."""
    return train_grpo(config.section, model_dir(one(inputs, "model")), one(inputs, "data").path, out,
                      config.seed, config.device, log, progress)
