"""Supervised fine-tuning with TRL's `SFTTrainer`: chat messages, assistant-only loss, packing.

The conversations are rendered with our tokenizer's dual-mode chat template; its `{% generation %}`
markers give TRL the assistant-token mask, so only assistant turns (content and closing
`<|im_end|>`) carry loss (`assistant_only_loss=True`, as SmolLM3). Packing (best-fit decreasing,
whole conversations, position ids restart per conversation) fills every row of `max_length`.
The held-out conversations give an eval loss, of all of them and per reasoning mode (think,
no-think), every `save_steps` (to the tracker) and after training (to the meta).

The step launches `train_sft` on the recipe's launcher (trainers/posttrain/launch.py); it resumes
from its newest checkpoint when a killed attempt left one.

Runs on every rank of a launch (`python -m trainers.posttrain`); the `sft` step
(tasks/posttrain/sft.py) launches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainers.posttrain.chat_data import by_mode, read_jsonl
from trainers.posttrain.common import (
    checkpoint_callback,
    fit,
    load_policy,
    model_meta,
    plain_print,
    progress_callback,
    quiet,
    save_policy,
    trainer_args,
    write_history,
)
from trainers.posttrain.sections import SFTConfig


@plain_print()
def train_sft(
    cfg: SFTConfig,
    base: Path,
    data: Path,
    out: Path,
    seed: int = 0,
    device: str = "auto",
    log: Callable[[str], None] = print,
    progress: Callable[[float], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Fine-tune the model in `base` on `data/train.jsonl` (resuming from a checkpoint in `out`);
    write `out/model`; return the meta."""
    import trl  # trl.SFTConfig, not ours (trainers/posttrain/sections.py)
    from datasets import Dataset

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(base, cfg.bf16)
    train = Dataset.from_list([{"messages": r["messages"]} for r in read_jsonl(data / "train.jsonl")])
    heldout_rows = read_jsonl(data / "heldout.jsonl")
    # The held-out loss of all conversations and of each reasoning mode's, every `save_steps` (the
    # tracker's `train/eval_think_loss`, `train/eval_no_think_loss`) and after training (the meta).
    heldout = None
    if heldout_rows:
        sets = {"all": heldout_rows, **by_mode(heldout_rows)}
        heldout = {k: Dataset.from_list([{"messages": r["messages"]} for r in rows]) for k, rows in sets.items()}
    common = trainer_args(cfg, out, seed, device)
    args = trl.SFTConfig(
        **common,
        max_length=cfg.max_length,
        packing=cfg.packing,
        assistant_only_loss=cfg.assistant_only_loss,
        per_device_eval_batch_size=common["per_device_train_batch_size"],
        eval_strategy="steps" if heldout else "no",
        eval_steps=cfg.save_steps,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=heldout,
        processing_class=tokenizer,
        callbacks=[progress_callback(progress, log, out), checkpoint_callback(out, cfg.keep_checkpoints), *callbacks],
    )
    quiet(trainer)
    resumed = fit(trainer, out, log, "sft")
    facts = write_history(trainer, out)
    if heldout is not None:
        # the evaluation at the last step, when this launch trained it (else evaluate now)
        step, scores = trainer.state.global_step, {}
        for row in trainer.state.log_history:  # one row per held-out set
            if row.get("step") == step:
                scores.update({k: v for k, v in row.items() if k.startswith("eval_")})
        if any(f"eval_{m}_loss" not in scores for m in heldout):
            scores = trainer.evaluate()
        facts["eval_loss"] = round(float(scores["eval_all_loss"]), 5)
        facts["eval_loss_by_mode"] = {m: round(float(scores[f"eval_{m}_loss"]), 5) for m in heldout if m != "all"}
    folder = save_policy(trainer, tokenizer, out / "model")
    log(
        f"sft: {facts['steps']} steps, loss {facts['first_loss']} -> {facts['last_loss']}, "
        f"held-out loss {facts.get('eval_loss')} (by mode: {facts.get('eval_loss_by_mode')})"
    )
    return model_meta("sft", folder, started, examples=len(train), resumed_from_step=resumed, **facts)
