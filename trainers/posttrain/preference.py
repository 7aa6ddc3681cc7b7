"""Preference optimisation with TRL's `DPOTrainer` (APO-zero by default, as SmolLM3).

Pairs come from a dataset (`pairs: files:...|hf:...`, rows of prompt/chosen/rejected), from the
preference_pairs step (`pairs: on_policy`: the step's folder is this trainer's data, its
`pairs.jsonl` rows carry their mode and sources; tasks/posttrain/preference_pairs.py) or, with
`pairs: self`, from the SFT model's own samples judged by the arithmetic verifier: for each
prompt the policy samples `samples_per_prompt` answers; an incorrect one is the rejected
completion; the chosen one is a correct sample when the policy produced one, else the reference
worked solution (at tiny scale the policy is rarely right, so the reference keeps the signal;
SmolLM3 took chosen answers from a stronger model, which the reference stands in for). Prompts
whose samples are all correct give no pair. The SFT model is the frozen reference.

Pairs are made once, by the main rank, before training (the others wait, then read them), and
kept in `pairs.jsonl`: every rank trains on the same pairs whatever the world size, and a resumed
run trains on the pairs of the run it continues. The step launches `train_preference` on the
recipe's launcher (trainers/posttrain/launch.py); it resumes from its newest checkpoint.

Runs on every rank of a launch (`python -m trainers.posttrain`); the `preference` step
(tasks/posttrain/preference.py) launches it.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from infra.files import write_atomic
from trainers.posttrain.chat_data import is_correct, preference_rows, question, read_jsonl
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
from trainers.posttrain.sampling import generate_left_padded
from trainers.posttrain.sections import PreferenceConfig


def sample_completions(
    model,
    tokenizer,
    prompts: list[list[dict]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int = 64,
) -> list[list[str]]:
    """`n` sampled assistant replies per chat prompt (left-padded batches, chat template)."""
    import torch

    torch.manual_seed(seed)
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    flat = [t for t in texts for _ in range(n)]
    replies = generate_left_padded(
        model,
        tokenizer,
        flat,
        batch_size,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
    )
    return [replies[i * n : (i + 1) * n] for i in range(len(prompts))]


def verified_pairs(
    prompts: list[dict[str, Any]], samples: list[list[str]], reference: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """prompt/chosen/rejected rows from judged samples, and counts for the meta."""
    rows, correct, total, from_policy = [], 0, 0, 0
    for item, outs in zip(prompts, samples, strict=True):
        right = [s for s in outs if is_correct(s, item["answer"])]
        wrong = [s for s in outs if not is_correct(s, item["answer"])]
        correct += len(right)
        total += len(outs)
        if not wrong:
            continue
        chosen = right[0] if right else (reference or {}).get(question(item["prompt"]))
        if chosen is None:
            continue
        from_policy += bool(right)
        rows.append(
            {
                "prompt": item["prompt"],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": wrong[0]}],
            }
        )
    return rows, {
        "sample_accuracy": round(correct / max(total, 1), 4),
        "pairs": len(rows),
        "chosen_from_policy": from_policy,
    }


def reference_solutions(data: Path) -> dict[str, str]:
    """The reference worked solution of every prompt, keyed by its question."""
    return {question(r["prompt"]): r["reference"] for r in read_jsonl(data / "prompts.jsonl") if "reference" in r}


def self_pairs(cfg: PreferenceConfig, model, tokenizer, data: Path, seed: int, log) -> tuple[list, dict]:
    prompts = read_jsonl(data / "prompts.jsonl")
    need = cfg.max_steps * cfg.batch
    rng = random.Random(f"preference:{seed}")
    rng.shuffle(prompts)
    prompts = prompts[: max(need, 1)]
    samples = sample_completions(
        model,
        tokenizer,
        [p["prompt"] for p in prompts],
        cfg.samples_per_prompt,
        cfg.max_new_tokens,
        cfg.temperature,
        seed,
    )
    rows, facts = verified_pairs(prompts, samples, reference_solutions(data))
    log(
        f"preference: {len(prompts)} prompts x {cfg.samples_per_prompt} samples, policy accuracy "
        f"{facts['sample_accuracy']:.1%}, {facts['pairs']} pairs ({facts['chosen_from_policy']} with a "
        "policy-sampled chosen answer)"
    )
    return rows, facts


def on_policy_pairs(data: Path, log) -> tuple[list, dict]:
    """The preference_pairs step's rows (`data` is its folder), with their mode and sources."""
    path = data / "pairs.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"preference: pairs 'on_policy' reads {path}, which does not exist; the input `data` must "
            "be the preference_pairs step's folder"
        )
    rows = read_jsonl(path)
    modes = Counter(r.get("mode", "unknown") for r in rows)
    sources = Counter(f"{r.get('chosen_source')} > {r.get('rejected_source')}" for r in rows)
    log(f"preference: {len(rows)} on-policy pairs ({dict(modes)}; chosen > rejected: {dict(sources)})")
    return rows, {"pairs": len(rows), "pairs_by_mode": dict(modes), "pair_sources": dict(sources)}


def make_pairs(
    cfg: PreferenceConfig, args, model, tokenizer, data: Path, out: Path, seed: int, log
) -> tuple[list, dict]:
    """The preference pairs of this step: made by the main rank (once per step folder), read by
    the others; `out/pairs.jsonl` and its counts `out/pairs.json` are written atomically."""
    rows_path, facts_path = out / "pairs.jsonl", out / "pairs.json"
    with args.main_process_first(local=False, desc="preference pairs"):
        if rows_path.exists() and facts_path.exists():
            return read_jsonl(rows_path), json.loads(facts_path.read_text())
        if cfg.pairs == "self":
            rows, facts = self_pairs(cfg, model.to(args.device), tokenizer, data, seed, log)
        elif cfg.pairs == "on_policy":
            rows, facts = on_policy_pairs(data, log)
        else:
            rows = preference_rows(cfg.pairs, cfg.pairs_subset, cfg.pairs_split, cfg.pairs_revision, cfg.max_pairs)
            facts = {"pairs": len(rows)}
        if rows:
            write_atomic(rows_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            write_atomic(facts_path, json.dumps(facts))
        return rows, facts


@plain_print()
def train_preference(
    cfg: PreferenceConfig,
    policy: Path,
    data: Path,
    out: Path,
    seed: int = 0,
    device: str = "auto",
    log: Callable[[str], None] = print,
    progress: Callable[[float], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """DPO/APO from the model in `policy` (resuming from a checkpoint in `out`); write
    `out/model` and `out/pairs.jsonl`."""
    import trl  # trl.DPOConfig, not ours (trainers/posttrain/sections.py)
    from datasets import Dataset

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(policy, cfg.bf16)
    args = trl.DPOConfig(
        **trainer_args(cfg, out, seed, device),
        loss_type=[cfg.loss_type],
        beta=cfg.beta,
        max_length=cfg.max_length,
    )
    rows, facts = make_pairs(cfg, args, model, tokenizer, data, out, seed, log)
    if not rows:
        raise ValueError(
            "preference: no pairs (every sampled answer was correct, or the data is empty); "
            "raise posttrain.preference.temperature or give pairs as a dataset"
        )
    trainer = trl.DPOTrainer(
        model=model,
        args=args,
        # DPO reads these three; a pair's mode and sources stay in pairs.jsonl
        train_dataset=Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]),
        processing_class=tokenizer,
        callbacks=[progress_callback(progress, log, out), checkpoint_callback(out, cfg.keep_checkpoints), *callbacks],
    )
    quiet(trainer)
    resumed = fit(trainer, out, log, "preference")
    facts = {**facts, **write_history(trainer, out)}
    folder = save_policy(trainer, tokenizer, out / "model")
    log(
        f"preference ({cfg.loss_type}, beta {cfg.beta}): {facts['steps']} steps, loss "
        f"{facts['first_loss']} -> {facts['last_loss']}"
    )
    return model_meta(
        cfg.loss_type.split("_")[0] if cfg.loss_type.startswith("apo") else cfg.loss_type,
        folder,
        started,
        loss_type=cfg.loss_type,
        beta=cfg.beta,
        seed=seed,
        resumed_from_step=resumed,
        **facts,
    )
