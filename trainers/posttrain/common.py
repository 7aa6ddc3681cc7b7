"""What every post-training trainer shares: loading a policy, trainer arguments, checkpoints a
killed run resumes from, live metrics and progress, saving a model.

A post-training step reads an `hf_model` artifact (a `save_pretrained` folder with our tokenizer
and its chat template) and writes another into `{step folder}/model`. Saved models stop
generation at `<|im_end|>` (the end of an assistant turn) as well as at `<|endoftext|>`.

The trainers are TRL's and run on every rank of a launch (`python -m trainers.posttrain SPEC.json`
under torchrun or `accelerate launch`, see trainers/posttrain/launch.py), or in the calling process
when called directly (tests); the world size comes from the environment. Only the main process
writes the model folder, `metrics.jsonl` and `result.json`.

Checkpoints use the stage layout of model/checkpoint.py, so the launchers' failure reports, the
S3 uploader and its pulls treat them like pretraining checkpoints: TRL writes
`trainer/checkpoint-N` every `save_steps` (and at the last step); once every rank has written its
part, the main process lists every file with its size and SHA-256 in `_CHECKPOINT.json`
(infra/manifest.py) and renames the folder to `checkpoints/step_{N:08d}`. A start resumes from
the newest checkpoint whose files match their digests (each rank hashes a share), falling back
to older ones with a warning. With `TrainerSpec.mirror`, the main process uploads each published
checkpoint to S3 from a background thread (`use_uploader`, as the pretraining trainer does).
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from infra import manifest
from infra.files import write_atomic, write_json_atomic
from pipeline.artifact import Artifact
from trainers.posttrain.sections import micro_batches
from trainers.rank_signals import StopRequested, StopSignals, trainer_callback

CHECKPOINTS = "checkpoints"  # {step folder}/checkpoints/step_{N:08d}, as model/checkpoint.py
METRICS = "metrics.jsonl"

IM_END = "<|im_end|>"
_PRINT = builtins.print if getattr(builtins.print, "__module__", "builtins") == "builtins" else None


@contextmanager
def plain_print():
    """Let `print` reach stdout while a trainer runs (also usable as a decorator).

    Why: with Prefect's `log_prints`, every print becomes a log line, including the bytecode that
    dill prints into a captured stdout while `datasets` fingerprints TRL's map functions (~500
    lines per step). The trainers report through `log` (`progress_callback`) instead. Only a
    trainer called inside a flow process needs it (tests, notebooks): launched ranks have no
    Prefect, and their stdout is the step's log.
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
        raise ValueError(f"expected an hf_model artifact with meta model_dir, got {artifact.kind} {artifact.short}")
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
            f"tokenizer in {folder} has no chat template; post-training needs the chat template "
            "from tasks/tokenizer.py (export the model with the run's tokenizer)"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16 if bf16 else torch.float32)
    model.generation_config.eos_token_id = stop_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def rank() -> int:
    """This process's global rank in the launch (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def trainer_args(section, out: Path, seed: int, device: str, **overrides: Any) -> dict[str, Any]:
    """TrainingArguments fields every TRL config here shares (section: a TrainerConfig).

    `section.batch` sequences per optimizer step whatever the world size: each rank takes an equal
    share, in micro-batches of at most `per_device_batch` (the rest is gradient accumulation).
    Checkpoints go to `out/trainer/checkpoint-N`, published by `Checkpoints` below.
    """
    micro, accum = micro_batches(section.batch, section.per_device_batch, world_size())
    args = {
        "output_dir": str(out / "trainer"),
        "max_steps": section.max_steps,
        "learning_rate": section.lr,
        "warmup_steps": int(section.warmup_ratio * section.max_steps),
        "lr_scheduler_type": "linear",
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accum,
        "bf16": section.bf16,
        "gradient_checkpointing": section.gradient_checkpointing,
        "use_cpu": resolve_device(device) == "cpu",
        "logging_steps": 1,
        "save_strategy": "steps",  # every save_steps, and at the last step
        "save_steps": section.save_steps,
        "save_total_limit": None,  # `Checkpoints` keeps and prunes the published ones
        "report_to": [],
        "seed": seed,
        "data_seed": seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "ddp_find_unused_parameters": False,  # every parameter gets a gradient: skip the search
    }
    return {**args, **overrides}


def step_folder(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """(step, folder, marker) of the complete checkpoints under `root` (sizes checked), oldest first."""
    found = []
    for folder in Path(root).glob("step_*"):
        if folder.is_dir() and folder.name[5:].isdigit():
            record = manifest.quick_check(folder)
            if record is not None:
                found.append((int(folder.name[5:]), folder, record))
    return sorted(found, key=lambda f: f[0])


# The main rank's S3 uploader (trainers/posttrain/__main__.py, with `TrainerSpec.mirror`): handed
# every published checkpoint; what it has not yet verified on S3 is never pruned locally.
_uploader: Any = None


def use_uploader(uploader: Any) -> None:
    """Hand every checkpoint this process publishes to `uploader` (infra/storage.py
    `CheckpointUploader`; None: none)."""
    global _uploader
    _uploader = uploader


def publish_checkpoint(src: Path, root: Path, step: int, final: bool, keep: int) -> Path:
    """Seal TRL's `src` checkpoint (manifest written last) and move it to `root/step_N`; hand it
    to the S3 uploader, if any; prune."""
    # TRL pickles its arguments next to the weights; resuming never reads them, so no checkpoint
    # (local or on S3) carries a pickle that something might load one day.
    (src / "training_args.bin").unlink(missing_ok=True)
    files = manifest.payload_files(src)
    entries = manifest.entries(src, files)
    write_json_atomic(src / manifest.MARKER, manifest.marker_record(step, final, entries))
    dest = step_folder(root, step)
    root.mkdir(parents=True, exist_ok=True)
    if dest.exists():  # an older attempt's checkpoint of this step that failed verification
        shutil.rmtree(dest)
    os.replace(src, dest)
    if _uploader is not None:
        _uploader.submit(dest)
    prune_checkpoints(root, keep)
    return dest


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints and the final one; incomplete ones stay (a
    mirror or a human may be looking at them; the next publish of that step replaces them)."""
    complete = complete_checkpoints(root)
    keep_set = {f for _, f, _ in complete[-keep:]} | {f for _, f, r in complete if r.get("stage_end")}
    if _uploader is not None:  # still waiting for its upload
        keep_set |= {Path(root) / name for name in _uploader.pending()}
    for _, folder, _ in complete:
        if folder not in keep_set:
            shutil.rmtree(folder, ignore_errors=True)


def checkpoint_callback(out: Path, keep: int):
    """A TrainerCallback publishing every checkpoint TRL saves (see the module docstring)."""
    from transformers import TrainerCallback

    class Checkpoints(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            # Every rank writes part of a checkpoint (its RNG state; FSDP/ZeRO shards): the
            # manifest may list the files only once all of them are there.
            barrier()
            if state.is_world_process_zero:
                src = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                publish_checkpoint(
                    src, out / CHECKPOINTS, state.global_step, state.global_step >= state.max_steps, keep
                )
            barrier()  # nobody reads the folder before it is published

    return Checkpoints()


def resume_point(out: Path, log: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint under `out/checkpoints` whose files match their digests and whose
    pickles cannot run code (`refused_pickles`), or None.

    Collective when a process group exists: each rank hashes every world_size-th file and the
    verdicts are shared, so every rank resumes from the same folder.
    """
    import torch.distributed as dist

    collective = dist.is_available() and dist.is_initialized()
    r, w = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)
    for _step, folder, record in reversed(complete_checkpoints(out / CHECKPOINTS)):
        names = sorted(record["files"])
        problems = manifest.verify(folder, names=names[r::w])
        if collective:
            shared: list[Any] = [None] * w
            dist.all_gather_object(shared, problems)
            problems = [p for part in shared for p in part]
        if not problems:
            problems = refused_pickles(folder)
        if not problems:
            return folder
        if r == 0:
            log(f"warning: checkpoint {folder.name} cannot be trusted ({'; '.join(problems[:3])}); trying an older one")
    return None


def refused_pickles(folder: Path) -> list[str]:
    """Why the pickles in a TRL checkpoint could run code when resumed (empty: none can).

    transformers loads the optimizer, scheduler, scaler and RNG files with
    `torch.load(weights_only=True)`, but a checkpoint saved with FSDP's SHARDED_STATE_DICT holds
    DCP folders whose `.metadata` accelerate reads with plain `pickle`: each must first pass the
    allow-list unpickler the pretraining checkpoints use (model/checkpoint.py)."""
    import pickle

    from model.checkpoint import SafeFileSystemReader

    problems = []
    for metadata in sorted(Path(folder).rglob(".metadata")):
        try:
            SafeFileSystemReader(str(metadata.parent)).read_metadata()
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            problems.append(f"{metadata.relative_to(folder)}: {exc}")
    return problems


def resumed_step(folder: Path | None) -> int | None:
    return int(folder.name[5:]) if folder is not None else None


def start_metrics(out: Path, resume: Path | None) -> None:
    """Main process: keep the metrics lines up to the checkpoint a run resumes from (the steps a
    killed attempt trained after it are trained again), or start an empty file."""
    if not is_main():
        return
    path = out / METRICS
    step = resumed_step(resume) or 0
    kept = []
    if resume is not None and path.exists():
        for line in path.read_text().splitlines():
            try:
                if int(json.loads(line).get("step", 0)) <= step:
                    kept.append(line)
            except (ValueError, TypeError, AttributeError):
                continue  # a line cut by the kill
    write_atomic(path, "".join(line + "\n" for line in kept))


def progress_callback(progress: Callable[[float], None] | None, log: Callable[[str], None], out: Path | None = None):
    """A transformers TrainerCallback: on the main process, a line per logged step (step/total,
    loss or reward, LR, ETA at the pace since this launch began), the step's progress percentage,
    and (with `out`) every log row appended to `out/metrics.jsonl` as training goes."""
    from transformers import TrainerCallback

    from infra.progress import duration, eta

    class _Progress(TrainerCallback):
        started, reported, first = 0.0, -1, 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.first = time.monotonic(), state.global_step
            if state.is_world_process_zero:
                log(f"training {state.max_steps} steps")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not (logs and state.is_world_process_zero):
                return
            if out is not None:
                with open(out / METRICS, "a") as fh:
                    fh.write(json.dumps({**logs, "step": state.global_step}) + "\n")
            shown = ("loss", "reward", "rewards/exact_match_reward/mean", "eval_loss", "eval_all_loss")
            keys = [k for k in (*shown, "eval_think_loss", "eval_no_think_loss") if k in logs]
            if keys:
                elapsed = time.monotonic() - self.started
                named = {"eval_all_loss": "eval_loss"}  # SFT's held-out loss of every conversation
                parts = [f"step {state.global_step}/{state.max_steps}"]
                parts += [f"{named.get(k, k)} {logs[k]:.4g}" for k in keys]
                if "learning_rate" in logs:
                    parts.append(f"lr {logs['learning_rate']:.2e}")
                done = state.global_step - self.first  # a resumed launch: steps since it began
                parts.append(f"ETA {duration(eta(done, state.max_steps - self.first, elapsed))}")
                log(" | ".join(parts))
            if progress is not None and state.max_steps and state.global_step != self.reported:
                self.reported = state.global_step  # eval and summary logs repeat the last step
                progress(100.0 * state.global_step / state.max_steps)

    return _Progress()


def tracker_callback(config: Any, folder: Path, name: str):
    """A transformers TrainerCallback: the main process's log rows (loss, reward, KL, LR, ...) to
    the recipe's tracker (trainers/tracker.py) as `train/{key}` at the trainer's step, in `folder`
    (the flow run's tracker folder: post-training beside the pretraining stages)."""
    from transformers import TrainerCallback

    from trainers.tracker import open_tracker

    class _Tracker(TrainerCallback):
        tracker = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.tracker = open_tracker(config, folder, name, resume_step=state.global_step or None)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.tracker is not None and logs:
                self.tracker.log(state.global_step, {f"train/{k}": v for k, v in logs.items()})

        def on_train_end(self, args, state, control, **kwargs):
            if self.tracker is not None:
                self.tracker.close()
                self.tracker = None

    return _Tracker()


def quiet(trainer) -> None:
    """Drop transformers' stdout printer: `progress_callback` logs through the step's logger."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def fit(trainer, out: Path, log: Callable[[str], None], what: str) -> int | None:
    """Train, resuming from the newest verified checkpoint in `out`; returns its step (or None).

    A stop signal (trainers/rank_signals.py) saves the step being trained and raises StopRequested."""
    resume = resume_point(out, log)
    start_metrics(out, resume)
    if resume is not None:
        log(f"{what}: resuming from {resume.name}")
    # SIGUSR1/SIGTERM (time limit, preemption, eviction): save the current step and stop
    stop = StopSignals().install()
    stopper = trainer_callback(stop)
    trainer.add_callback(stopper)
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        stop.restore()
    if stopper.stopped_at is not None:
        step = stopper.stopped_at
        raise StopRequested(stop.received or "a signal", step, str(step_folder(out / CHECKPOINTS, step)))
    return resumed_step(resume)


def write_history(trainer, out: Path) -> dict[str, Any]:
    """Trainer log history to `metrics.jsonl`; the first and last logged loss for the meta."""
    history = trainer.state.log_history
    if trainer.is_world_process_zero():  # one writer under accelerate/torchrun
        write_atomic(out / METRICS, "".join(json.dumps(h) + "\n" for h in history))
    losses = [h["loss"] for h in history if "loss" in h]
    return {
        "steps": trainer.state.global_step,
        "first_loss": round(float(losses[0]), 5) if losses else None,
        "last_loss": round(float(losses[-1]), 5) if losses else None,
    }


MIN_PER_SHARE = 3  # updates in each share of `reward_trend`: its stderr needs 3 at least


def reward_trend(rewards: list[float], parts: int = 4) -> tuple[dict[str, Any], str]:
    """Did an RL run's reward rise? The updates' rewards (one per logged update, in order) cut into
    `parts` consecutive shares of at least 3 updates (halves when there are fewer than 3 per part;
    none below 6 updates), each share's mean ± its stderr over its updates, and the verdict on last
    share - first share: `rose` / `fell` beyond 2 combined stderr, else `flat`. A first and last
    update alone are one sample each: a reward of 0.125 then 0.375 is noise at a few completions
    per update. A stderr from 2 updates is no estimate: an SAO run of 4 updates rewarded 0.45,
    0.45, 0.2, 0.2 had halves of stderr 0 and read as `fell`. Returns the meta's facts and a log
    phrase."""
    import itertools
    import statistics

    n = len(rewards)
    if n < 2 * MIN_PER_SHARE:
        return {"reward_by_part": None, "reward_trend": None}, f"{n} update(s): too few for a trend"
    k = parts if n >= MIN_PER_SHARE * parts else 2
    cuts = [round(i * n / k) for i in range(k + 1)]
    shares = [rewards[a:b] for a, b in itertools.pairwise(cuts)]
    stats = [(statistics.fmean(x), statistics.stdev(x) / len(x) ** 0.5) for x in shares]
    (m0, s0), (m1, s1) = stats[0], stats[-1]
    diff, se = m1 - m0, (s0**2 + s1**2) ** 0.5
    trend = "rose" if diff > 2 * se else "fell" if diff < -2 * se else "flat"  # se 0, diff 0: flat
    name = {4: "quarter", 2: "half"}.get(k, f"1/{k}")
    verdict = {"rose": "rose beyond", "fell": "fell beyond", "flat": "no change beyond"}[trend]
    text = (
        f"by {name} of the updates {', '.join(f'{m:.3f} ± {e:.3f}' for m, e in stats)}: "
        f"{verdict} 2 stderr (last - first {diff:+.3f} ± {se:.3f})"
    )
    facts = {"reward_by_part": [[round(m, 4), round(e, 4)] for m, e in stats], "reward_trend": trend}
    return facts, text


def save_policy(trainer, tokenizer, folder: Path) -> Path:
    """Save the trained model and tokenizer as an HF folder, published by rename (main process).

    Every rank calls this: under FSDP or ZeRO-3 the full weights are gathered for the save."""
    tmp = folder.with_name(folder.name + ".tmp")
    if is_main() and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    plugin = getattr(getattr(trainer.accelerator, "state", None), "fsdp_plugin", None)
    if plugin is not None:  # sharded checkpoints during training, one full state dict at the end
        plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(tmp))
    barrier()
    if is_main():
        from transformers import GenerationConfig

        tokenizer.save_pretrained(str(tmp))
        generation = GenerationConfig.from_pretrained(str(tmp))
        generation.eos_token_id = stop_ids(tokenizer)  # stop at the end of an assistant turn
        generation.save_pretrained(str(tmp))
        (tmp / "training_args.bin").unlink(missing_ok=True)  # a pickle: nothing should load it
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    barrier()
    return folder


def count_parameters(folder: Path) -> int:
    """Parameters stored in a saved model's safetensors (read from the headers only)."""
    total = 0
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with open(shard, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= d
                total += n
    return total


def model_meta(stage: str, folder: Path, started: float, **facts: Any) -> dict[str, Any]:
    """The `hf_model` artifact meta every post-training step returns."""
    return {
        "stage": stage,
        "kind": "posttrain",
        "model_dir": str(folder),
        "parameters": count_parameters(folder) if is_main() else None,
        "world_size": world_size(),
        "seconds": round(time.monotonic() - started, 1),
        **facts,
    }
