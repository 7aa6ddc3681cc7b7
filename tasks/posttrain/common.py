"""What every post-training step shares: loading a policy, trainer arguments, saving a model.

A post-training step reads an `hf_model` artifact (a `save_pretrained` folder with our tokenizer
and its ChatML template) and writes another into `{step folder}/model`. Saved models stop
generation at `<|im_end|>` (the end of an assistant turn) as well as at `<|endoftext|>`.

Runs through TRL's trainers, so the same code runs on CPU (tiny) and under `accelerate launch`
on GPUs (see docs/posttraining.md); only the main process writes the model folder.
"""

from __future__ import annotations

import builtins
import json
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from infra.artifact import Artifact

IM_END = "<|im_end|>"
_PRINT = builtins.print if getattr(builtins.print, "__module__", "builtins") == "builtins" else None


@contextmanager
def plain_print():
    """Let `print` reach stdout while a trainer runs (also usable as a decorator).

    Why: with Prefect's `log_prints`, every print becomes a log line, including the bytecode that
    dill prints into a captured stdout while `datasets` fingerprints TRL's map functions (~500
    lines per step). The trainers report through `log` (`progress_callback`) instead.
    """
    patched = builtins.print
    if _PRINT is not None:
        builtins.print = _PRINT
    try:
        yield
    finally:
        builtins.print = patched


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("posttrain.device is 'cuda' but no GPU is visible; use 'auto' or 'cpu'")
    return device


def model_dir(artifact: Artifact) -> Path:
    """The HF folder of an `hf_model` artifact, or an error naming the artifact."""
    if artifact.kind != "hf_model" or "model_dir" not in artifact.meta:
        raise ValueError(
            f"expected an hf_model artifact with meta model_dir, got {artifact.kind} {artifact.short}"
        )
    return Path(artifact.meta["model_dir"])


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: `<|im_end|>` first, then the tokenizer's EOS."""
    ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    unk = tokenizer.unk_token_id
    return [i for i in dict.fromkeys(ids) if i is not None and i != unk]


def load_policy(folder: Path, bf16: bool = False):
    """(model, tokenizer) from an HF folder; pad token set for batched generation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json (not a save_pretrained folder)")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer in {folder} has no chat template; post-training needs the ChatML template "
            "from tasks/tokenizer.py (export the model with the run's tokenizer)"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.bfloat16 if bf16 else torch.float32
    )
    model.generation_config.eos_token_id = stop_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def trainer_args(section, out: Path, seed: int, device: str, **overrides: Any) -> dict[str, Any]:
    """TrainingArguments fields every TRL config here shares (section: a TrainerSection)."""
    args = {
        "output_dir": str(out),
        "max_steps": section.max_steps,
        "learning_rate": section.lr,
        "warmup_steps": int(section.warmup_ratio * section.max_steps),
        "lr_scheduler_type": "linear",
        "per_device_train_batch_size": section.per_device_batch,
        "gradient_accumulation_steps": section.grad_accum,
        "bf16": section.bf16,
        "gradient_checkpointing": section.gradient_checkpointing,
        "use_cpu": resolve_device(device) == "cpu",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": seed,
        "data_seed": seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    return {**args, **overrides}


def progress_callback(progress: Callable[[float], None] | None, log: Callable[[str], None]):
    """A transformers TrainerCallback: on the main process, a line per logged step (step/total,
    loss or reward, LR, ETA at the pace so far) and the step's progress percentage."""
    from transformers import TrainerCallback

    from infra.progress import duration, eta

    class _Progress(TrainerCallback):
        started, reported = 0.0, -1

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.monotonic()
            if state.is_world_process_zero:
                log(f"training {state.max_steps} steps")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not (logs and state.is_world_process_zero):
                return
            keys = [k for k in ("loss", "reward", "rewards/exact_match_reward/mean", "eval_loss") if k in logs]
            if keys:
                elapsed = time.monotonic() - self.started
                parts = [f"step {state.global_step}/{state.max_steps}",
                         *(f"{k} {logs[k]:.4g}" for k in keys)]
                if "learning_rate" in logs:
                    parts.append(f"lr {logs['learning_rate']:.2e}")
                parts.append(f"ETA {duration(eta(state.global_step, state.max_steps, elapsed))}")
                log(" | ".join(parts))
            if progress is not None and state.max_steps and state.global_step != self.reported:
                self.reported = state.global_step  # eval and summary logs repeat the last step
                progress(100.0 * state.global_step / state.max_steps)

    return _Progress()


def quiet(trainer) -> None:
    """Drop transformers' stdout printer: `progress_callback` logs through the step's logger."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def write_history(trainer, out: Path) -> dict[str, Any]:
    """Trainer log history to `metrics.jsonl`; the first and last logged loss for the meta."""
    history = trainer.state.log_history
    if trainer.is_world_process_zero():  # one writer under accelerate/torchrun
        (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    losses = [h["loss"] for h in history if "loss" in h]
    return {
        "steps": trainer.state.global_step,
        "first_loss": round(float(losses[0]), 5) if losses else None,
        "last_loss": round(float(losses[-1]), 5) if losses else None,
    }


def save_policy(trainer_or_model, tokenizer, folder: Path) -> Path:
    """Save model + tokenizer as an HF folder (main process only), published by rename."""
    model = getattr(trainer_or_model, "model", trainer_or_model)
    accelerator = getattr(trainer_or_model, "accelerator", None)
    if accelerator is not None:
        accelerator.wait_for_everyone()
        model = accelerator.unwrap_model(model)
        if not accelerator.is_main_process:
            return folder
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.generation_config.eos_token_id = stop_ids(tokenizer)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def model_meta(stage: str, folder: Path, model, started: float, **facts: Any) -> dict[str, Any]:
    """The `hf_model` artifact meta every post-training step returns."""
    return {
        "stage": stage,
        "kind": "posttrain",
        "model_dir": str(folder),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.monotonic() - started, 1),
        **facts,
    }
