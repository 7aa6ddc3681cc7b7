"""SAO, single-rollout asynchronous RL, on the GRPO prompts and rewards: the trainer side.

GRPO (trainers/posttrain/grpo.py) samples a group of completions per prompt, waits for the whole
batch and uses the group mean as the baseline. Here, as in the SAO note (GLM post-training with
slime; AReaL's decoupled objective; VAPO's value model):

- **One rollout per prompt, generated elsewhere.** `rollout_workers` processes
  (trainers/posttrain/rollout.py; transformers generation, or vLLM) sample completions and write
  them into a bounded file queue in the step folder; the trainer takes them in sequence order and
  updates as soon as it holds `batch` usable samples. Every `push_every` policy updates it
  publishes its weights (a new policy version) for the workers to load between samples. The
  workers run beside the trainer, started by it, or (`rollout_nodes` > 0) as a pool job of their
  own that the step's launch submits (infra/launchers/pool.py); the trainer then starts none, and
  stops with an error naming the pool's job when no sample comes for `rollout_timeout_s`.
- **Bounded staleness, off-policy correction.** Each sample carries the version that generated it
  and its behaviour log-probs. A sample more than `max_staleness` versions behind the trainer is
  dropped and counted. The loss is AReaL's decoupled PPO (trainers/posttrain/sao_objective.py):
  truncated importance weight behaviour -> proximal (the trainer's policy when the batch arrived),
  PPO clipping proximal -> current over `epochs` passes; the batch's ESS is logged.
- **A value baseline.** A value model initialised from the policy (its decoder, a zero linear
  head) is trained alone for `value_warmup` batches, then beside the policy. GAE with
  `lam_value` for its targets and `lam_policy` for the policy advantages (whitened per batch).
  Value loss and explained variance are logged.

Versions: the policy version is the number of policy updates; warmup batches leave it at 0.
Trainer steps (`checkpoints/step_N`, metrics rows) count warmup and policy batches together.

Checkpoints (every `save_steps` trainer steps and at the end): policy and value weights
(safetensors), both optimizers, and `state.json` (step, version, queue position, dropped and
restart counts), sealed with the manifest of trainers/posttrain/common.py. A restart resumes
from the newest verified one: the queue's samples after its position are deleted (they may come
from versions the restart no longer has) and generated again by the restored policy, so every
sample number is trained or dropped exactly once in the run's `metrics.jsonl` (`seqs`,
`dropped_seqs`). A restart is a new session of the rollout folder: a pool's workers see it and
start over at the restart's position. A local rollout worker that dies is restarted by the
trainer at its first missing sample (a pool's, by its pool node; a pool job that ends, by the
step's launch); samples already queued are kept.

Runs as one process (`python -m trainers.posttrain spec.json`, the step's launch with one rank);
the `sao` step (tasks/posttrain/sao.py) launches it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.files import write_json_atomic
from trainers.posttrain import rollout
from trainers.posttrain.common import (
    CHECKPOINTS,
    METRICS,
    load_policy,
    model_meta,
    plain_print,
    publish_checkpoint,
    resolve_device,
    resume_point,
    resumed_step,
    reward_trend,
    start_metrics,
    stop_ids,
)
from trainers.posttrain.sao_objective import decoupled_ppo_loss, explained_variance, gae, split_stale
from trainers.posttrain.sections import SAOConfig
from trainers.rank_signals import StopRequested, StopSignals

STATE = "state.json"


def value_model(policy):
    """A value model initialised from the policy: a copy of its decoder and a zero linear head
    reading the last hidden state at every position: (B, L) values."""
    import torch

    class ValueModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = copy.deepcopy(policy.model)
            self.head = torch.nn.Linear(policy.config.hidden_size, 1, dtype=policy.dtype)
            torch.nn.init.zeros_(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)

        def forward(self, input_ids, attention_mask):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self.head(hidden)[..., 0]  # (B, L)

    return ValueModel()


def batch_tensors(samples: list[dict[str, Any]], pad_id: int, device: str):
    """Right-padded ids and mask (B, L), and for the completion tokens (B, T): the position whose
    output predicts each token, behaviour log-probs, a 0/1 mask and the token rewards (the
    sample's reward on its last token)."""
    import torch

    ids = [s["prompt_ids"] + s["completion_ids"] for s in samples]
    L = max(map(len, ids))
    T = max(len(s["completion_ids"]) for s in samples)
    input_ids = torch.full((len(ids), L), pad_id, dtype=torch.long)
    attention = torch.zeros((len(ids), L), dtype=torch.long)
    where = torch.zeros((len(ids), T), dtype=torch.long)
    behav = torch.zeros((len(ids), T))
    mask = torch.zeros((len(ids), T))
    rewards = torch.zeros((len(ids), T))
    for i, s in enumerate(samples):
        n, p, t = len(ids[i]), len(s["prompt_ids"]), len(s["completion_ids"])
        input_ids[i, :n] = torch.tensor(ids[i])
        attention[i, :n] = 1
        where[i, :t] = torch.arange(p - 1, p - 1 + t)
        behav[i, :t] = torch.tensor(s["behav_logp"])
        mask[i, :t] = 1.0
        rewards[i, t - 1] = float(s["reward"])
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention.to(device),
        "targets": input_ids.gather(1, (where + 1).clamp(max=L - 1)).to(device),
        "where": where.to(device),
        "behav": behav.to(device),
        "mask": mask.to(device),
        "rewards": rewards,
    }


def token_logp(model, b: dict, temperature: float):
    """(B, T) log-probs of the completion tokens under `model` at `temperature`."""
    import torch

    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, L, V)
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    picked = logits[rows, b["where"]].float() / temperature  # (B, T, V)
    return torch.log_softmax(picked, dim=-1).gather(2, b["targets"][..., None])[..., 0]


def advantages(rewards, values, mask, cfg: SAOConfig):
    """(policy advantages whitened over the batch's tokens, value targets), both (B, T)."""
    import torch

    adv = torch.zeros_like(rewards)
    targets = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        t = int(mask[i].sum())
        r, v = rewards[i, :t], values[i, :t]
        adv[i, :t] = gae(r, v, cfg.gamma, cfg.lam_policy)
        targets[i, :t] = gae(r, v, cfg.gamma, cfg.lam_value) + v
    m = mask.bool()
    mean, std = adv[m].mean(), adv[m].std(unbiased=False)
    return ((adv - mean) / (std + 1e-6)) * mask, targets


class RolloutPoolSilent(RuntimeError):
    """The external rollout pool produced no sample within `rollout_timeout_s`."""


class Rollouts:
    """The trainer's end of the queue: prepares the rollout folder for a new session, starts the
    local workers (none with a pool: `rollout_nodes` > 0), takes samples in order, restarts a
    local worker that died, stops when a worker cannot start or a pool stays silent, pushes
    weights."""

    def __init__(self, folder: Path, cfg: SAOConfig, policy: Path, prompts: Path, seed: int, log, device: str = "cpu"):
        self.folder, self.cfg, self.log = folder, cfg, log
        self.external = cfg.rollout_nodes > 0
        self.session = rollout.new_session()
        self.workers = rollout.Workers(folder, 0, cfg.rollout_workers, cfg.rollout_workers, cfg.rollout_threads, log)
        self.config = {
            "policy": str(policy),
            "prompts": str(prompts),
            "seed": seed,
            "temperature": cfg.temperature,
            "max_completion_length": cfg.max_completion_length,
            "format_weight": cfg.format_weight,
            "queue_size": cfg.queue_size,
            "threads": cfg.rollout_threads,
            "engine": cfg.engine,
            # a pool's workers generate on their node's GPUs when the trainer has one; local
            # workers stay on the CPU, leaving the trainer's GPU to the trainer
            "device": device if self.external else "cpu",
            "session": self.session,
        }

    @property
    def restarts(self) -> int:
        return self.workers.restarts

    @restarts.setter
    def restarts(self, n: int) -> None:
        self.workers.restarts = n

    def reset(self, consumed: int) -> None:
        """Before the workers start: end the local workers of a killed attempt, drop every queued
        sample and pushed weights (those after `consumed` may come from versions this run no
        longer has), then publish this session's settings last: workers (a pool's too) see the
        new session, start at their first free sample and wait for its first push."""
        self._end_old_workers()
        for name in (rollout.WEIGHTS, rollout.DONE, rollout.ERROR):
            (self.folder / name).unlink(missing_ok=True)
        if (self.folder / rollout.QUEUE).exists():
            shutil.rmtree(self.folder / rollout.QUEUE)
        for old in self.folder.glob("weights-*.safetensors"):
            old.unlink()
        rollout.queue_dir(self.folder, self.session).mkdir(parents=True)
        rollout.write_consumed(self.folder, consumed)
        write_json_atomic(self.folder / rollout.CONFIG, self.config)

    def _end_old_workers(self) -> None:
        """Workers end with their trainer (parent-death signal); one still finishing a sample is
        ended here, by the pid its trainer recorded, and only if it is that worker."""
        try:
            pids = json.loads((self.folder / rollout.WORKERS_FILE).read_text())
        except (OSError, ValueError):
            return
        for pid in pids.values():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"trainers.posttrain.rollout" in cmdline and str(self.folder).encode() in cmdline:
                os.kill(pid, 9)

    def start_all(self) -> None:
        if not self.external:
            self.workers.start_all()
            return
        (self.folder / rollout.WORKERS_FILE).unlink(missing_ok=True)
        self.log(
            f"sao: rollouts from {self.pool_name()} ({self.cfg.rollout_nodes} node(s) x "
            f"{self.cfg.rollout_workers} worker(s)); no local worker"
        )

    def pool_name(self) -> str:
        """The pool as the step's launch recorded it (`launch/rollout-pool.json`)."""
        from infra.launchers.pool import pool_record, read_pool_record

        record = read_pool_record(self.folder.parent, "rollout")
        if record is None:
            return (
                f"the rollout pool (no job recorded in {pool_record(self.folder.parent, 'rollout')}: "
                "rollout_nodes > 0 needs the step's launch to start it)"
            )
        restarts = f", resubmitted {record['restarts']} time(s)" if record.get("restarts") else ""
        return f"the {record.get('describe', 'rollout pool')}{restarts}"

    def take(self, seq: int) -> tuple[dict[str, Any], float]:
        """Sample `seq` (waiting for it; restarting a local worker that died) and the seconds waited."""
        path = rollout.sample_path(self.folder, self.session, seq)
        began = time.monotonic()
        while not path.exists():
            error = rollout.read_error(self.folder, self.session)
            if error is not None:
                raise RuntimeError(f"sao: a rollout worker cannot start: {error}")
            if self.external:
                if time.monotonic() - began > self.cfg.rollout_timeout_s:
                    raise RolloutPoolSilent(
                        f"sao: no sample from {self.pool_name()} for {self.cfg.rollout_timeout_s:.0f} s "
                        f"(waiting for sample {seq}; posttrain.sao.rollout_timeout_s); check the pool's job "
                        f"and its log, and that its nodes see {self.folder}"
                    )
            else:
                self.workers.check()
            time.sleep(0.005)
        waited = time.monotonic() - began
        sample = json.loads(path.read_text())
        path.unlink()
        rollout.write_consumed(self.folder, seq + 1)
        return sample, waited

    def push(self, model, version: int) -> None:
        rollout.push_weights(self.folder, model, version, self.session)

    def finish(self) -> None:
        """This session's trainer is done: the pool's nodes and the workers end."""
        rollout.finish(self.folder, self.session)

    def stop(self) -> None:
        self.workers.stop()


class State:
    """What a checkpoint's state.json holds besides weights and optimizers."""

    def __init__(self, **kw: Any):
        self.step = kw.get("step", 0)  # trainer steps done (value warmup + policy updates)
        self.version = kw.get("version", 0)  # policy updates done: the policy version
        self.consumed = kw.get("consumed", 0)  # samples taken from the queue (its position)
        self.dropped = Counter({int(k): v for k, v in kw.get("dropped", {}).items()})  # by staleness
        self.restarts = kw.get("restarts", 0)  # rollout workers restarted
        self.waited = kw.get("waited", 0.0)  # seconds the trainer waited for samples
        self.busy = kw.get("busy", 0.0)  # seconds the trainer trained

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "dropped": {str(k): v for k, v in sorted(self.dropped.items())}}


def save_checkpoint(out: Path, model, value, optimizers, state: State, final: bool, keep: int) -> Path:
    import torch
    from safetensors.torch import save_model

    src = out / "trainer" / f"checkpoint-{state.step}"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    save_model(model, str(src / "policy.safetensors"))
    save_model(value, str(src / "value.safetensors"))
    torch.save({k: o.state_dict() for k, o in optimizers.items()}, src / "optimizers.pt")
    write_json_atomic(src / STATE, state.as_dict())
    return publish_checkpoint(src, out / CHECKPOINTS, state.step, final, keep)


def load_checkpoint(folder: Path, model, value, optimizers) -> State:
    import torch
    from safetensors.torch import load_model

    load_model(model, str(folder / "policy.safetensors"))
    load_model(value, str(folder / "value.safetensors"))
    saved = torch.load(folder / "optimizers.pt", weights_only=True)
    for k, o in optimizers.items():
        o.load_state_dict(saved[k])
    return State(**json.loads((folder / STATE).read_text()))


def _chunks(b: dict, size: int) -> list[dict]:
    """The batch in micro-batches of at most `size` sequences (tensors sliced on their first dim)."""
    n = b["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in b.items()} for i in range(0, n, size)]


def train_batch(model, value, ref, optimizers, samples, cfg: SAOConfig, policy_phase: bool, pad_id: int, device: str):
    """One trainer step on `samples`: the value model always, the policy after the warmup. Forward
    passes take `per_device_batch` sequences at a time; gradients accumulate over them, each
    micro-batch's loss weighted by its share of the batch's completion tokens."""
    import torch

    b = batch_tensors(samples, pad_id, device)
    parts = _chunks(b, cfg.per_device_batch)
    mask, tokens = b["mask"], b["mask"].sum()
    with torch.no_grad():
        old_values = torch.cat([value(c["input_ids"], c["attention_mask"]).gather(1, c["where"]) for c in parts])
        old_values = (old_values.float() * mask).cpu()
        logp_prox = torch.cat([token_logp(model, c, cfg.temperature) for c in parts])
        logp_ref = torch.cat([token_logp(ref, c, cfg.temperature) for c in parts])
    adv, targets = advantages(b["rewards"], old_values, mask.cpu(), cfg)
    adv, targets = adv.to(device), targets.to(device)
    m = mask.bool()
    diff = logp_ref - logp_prox
    row: dict[str, Any] = {
        "explained_variance": explained_variance(old_values[m.cpu()], targets.cpu()[m.cpu()]),
        "kl_start": float((torch.exp(diff) - diff - 1)[m].mean()),  # k3 estimate, policy vs start
    }
    for epoch in range(cfg.epochs):
        optimizers["value"].zero_grad()
        value_loss = 0.0
        for c, t in zip(parts, targets.split(cfg.per_device_batch), strict=True):
            v = value(c["input_ids"], c["attention_mask"]).gather(1, c["where"]).float()
            part = 0.5 * (((v - t) ** 2) * c["mask"]).sum() / tokens
            part.backward()
            value_loss += part.item()
        torch.nn.utils.clip_grad_norm_(value.parameters(), 1.0)
        optimizers["value"].step()
        if epoch == 0:
            row["value_loss"] = value_loss
        if not policy_phase:
            continue
        optimizers["policy"].zero_grad()
        current = []
        for c, a, prox in zip(
            parts, adv.split(cfg.per_device_batch), logp_prox.split(cfg.per_device_batch), strict=True
        ):
            logp = token_logp(model, c, cfg.temperature)
            part, _ = decoupled_ppo_loss(logp, prox, c["behav"], a, c["mask"], cfg.clip, cfg.is_cap)
            (part * c["mask"].sum() / tokens).backward()
            current.append(logp.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizers["policy"].step()
        # the batch's loss and statistics, from the log-probs the gradient was taken at
        loss, stats = decoupled_ppo_loss(torch.cat(current), logp_prox, b["behav"], adv, mask, cfg.clip, cfg.is_cap)
        if epoch == 0:
            row |= {"loss": float(loss), **stats}
        else:
            row["clip_share"] = stats["clip_share"]  # clipping acts from the second pass on
    return row


def set_lr(optimizer, cfg: SAOConfig, version: int) -> None:
    """Linear warmup of the policy LR over the first `warmup_ratio` of the policy updates."""
    warmup = int(cfg.warmup_ratio * cfg.max_steps)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * min(1.0, (version + 1) / warmup) if warmup else cfg.lr


def save_model_folder(model, tokenizer, folder: Path) -> Path:
    """The trained policy as an HF folder with tokenizer and stop tokens, published by rename."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.generation_config.eos_token_id = stop_ids(tokenizer)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def take_batch(queue: Rollouts, state: State, cfg: SAOConfig) -> tuple[list[dict], list[int], float]:
    """The next `batch` samples within the staleness bound, in queue order; the numbers of those
    dropped as stale (counted in `state`) and the seconds waited."""
    samples, drops, waited = [], [], 0.0
    while len(samples) < cfg.batch:
        sample, w = queue.take(state.consumed)
        state.consumed += 1
        waited += w
        kept, dropped = split_stale([sample], state.version, cfg.max_staleness)
        samples += kept
        state.dropped += dropped
        drops += [sample["seq"]] if dropped else []
    return samples, drops, waited


def step_row(
    row: dict, state: State, samples: list[dict], lags: Counter, drops: list[int], waited: float, policy_phase: bool
):
    """The metrics row of a trainer step: the losses and statistics of `train_batch` (`row`), the
    rewards, the staleness histogram, the drops, the wait, and which sample numbers it took."""
    n = len(samples)
    return row | {
        "step": state.step,
        "phase": "policy" if policy_phase else "value",
        "version": state.version,
        "reward": sum(s["reward"] for s in samples) / n,
        "exact_reward": sum(s["exact"] for s in samples) / n,
        "format_reward": sum(s["format"] for s in samples) / n,
        "staleness_mean": sum(k * v for k, v in lags.items()) / n,
        **{f"staleness/{k}": v for k, v in sorted(lags.items())},
        "dropped_stale": sum(state.dropped.values()),
        "wait_s": round(waited, 3),
        "elapsed_s": round(state.busy + state.waited, 3),  # trainer time so far (reward vs time)
        "rollout_restarts": state.restarts,
        "seqs": [s["seq"] for s in samples],
        "dropped_seqs": drops,
    }


def report(row: dict, out: Path, board, log: Callable[[str], None], total: int) -> None:
    """The row to `metrics.jsonl`, its numbers to the tracker (`train/...`), a line to the log."""
    with open(out / METRICS, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    if board is not None:
        board.log(row["step"], {f"train/{k}": v for k, v in row.items() if isinstance(v, int | float)})
    log(
        f"sao: step {row['step']}/{total} ({row['phase']}) | reward {row['reward']:.3g} | value loss "
        f"{row['value_loss']:.4g} | explained var {row['explained_variance']:.3g}"
        + (f" | ess {row['ess_share']:.3f}" if "ess_share" in row else "")
        + f" | staleness {row['staleness_mean']:.2g} | dropped {row['dropped_stale']} | wait {row['wait_s']:.2f} s"
    )


def final_facts(state: State, cfg: SAOConfig, resumed: int | None, out: Path) -> tuple[dict[str, Any], str]:
    """The meta's figures: counts, idle share and throughput of the trainer's time (over every
    launch of the step), the reward's trend over the updates (`reward_trend`, from `metrics.jsonl`,
    so across resumes); and the trend's log phrase."""
    elapsed = state.busy + state.waited
    rewards = [json.loads(line)["reward"] for line in (out / METRICS).read_text().splitlines() if line.strip()]
    trend, said = reward_trend(rewards)
    return {
        "steps": state.step,
        "value_warmup": cfg.value_warmup,
        "policy_version": state.version,
        "resumed_from_step": resumed,
        "samples": state.consumed,
        "dropped_stale": dict(sorted(state.dropped.items())),
        "rollout_restarts": state.restarts,
        "trainer_idle_share": round(state.waited / elapsed, 3) if elapsed else None,
        "samples_per_s": round(state.consumed / elapsed, 3) if elapsed else None,
        **trend,
    }, said


def build_models(policy: Path, cfg: SAOConfig, device: str):
    """(policy, tokenizer, frozen start for the KL curve, value model, optimizers) on `device`."""
    import torch

    model, tokenizer = load_policy(policy, cfg.bf16)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    value = value_model(model)
    model.to(device), ref.to(device), value.to(device)
    optimizers = {
        "policy": torch.optim.AdamW(model.parameters(), lr=cfg.lr),
        "value": torch.optim.AdamW(value.parameters(), lr=cfg.value_lr),
    }
    return model, tokenizer, ref, value, optimizers


@plain_print()
def train_sao(
    cfg: SAOConfig,
    policy: Path,
    data: Path,
    out: Path,
    seed: int = 0,
    device: str = "auto",
    log: Callable[[str], None] = print,
    progress: Callable[[float], None] | None = None,
    tracker: tuple[Any, Path] | None = None,
) -> dict[str, Any]:
    """SAO from the model in `policy` on `data/prompts.jsonl` (resuming from a checkpoint in `out`);
    write `out/model`; return the meta. `tracker`: (TrackerConfig, run folder) for the curves."""
    import torch

    from trainers.tracker import open_tracker

    started = time.monotonic()
    device = resolve_device(device)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    # The queue position first: the workers start (import torch, load the policy) while the
    # trainer builds its models, then wait for the first push.
    resume = resume_point(out, log)
    position = json.loads((resume / STATE).read_text())["consumed"] if resume is not None else 0
    queue = Rollouts(out / "rollout", cfg, policy, data / "prompts.jsonl", seed, log, device)
    queue.reset(position)
    queue.start_all()
    try:
        model, tokenizer, ref, value, optimizers = build_models(policy, cfg, device)
        state = load_checkpoint(resume, model, value, optimizers) if resume is not None else State()
        queue.restarts = state.restarts
        queue.push(model, state.version)
    except BaseException:
        queue.stop()  # a trainer called in-process (tests) would leave its workers waiting
        raise
    if resume is not None:
        log(f"sao: resuming from {resume.name} (policy version {state.version}, sample {state.consumed})")
    start_metrics(out, resume)
    total = cfg.value_warmup + cfg.max_steps
    board = open_tracker(tracker[0], tracker[1], "sao", resume_step=state.step or None) if tracker else None
    log(
        f"sao: {cfg.value_warmup} value-only + {cfg.max_steps} policy steps of {cfg.batch} samples, "
        f"{cfg.rollout_workers} rollout worker(s), queue {cfg.queue_size}, max staleness {cfg.max_staleness}"
    )
    stop = StopSignals().install()  # SIGUSR1/SIGTERM: save the step being trained and exit 75
    ended = True  # whether the pool may stop: not after a stop signal (a restart resumes with it)
    try:
        while state.step < total:
            samples, drops, waited = take_batch(queue, state, cfg)
            lags = Counter(state.version - s["version"] for s in samples)  # versions behind, as trained
            began = time.monotonic()
            policy_phase = state.step >= cfg.value_warmup
            set_lr(optimizers["policy"], cfg, state.version)
            row = train_batch(model, value, ref, optimizers, samples, cfg, policy_phase, tokenizer.pad_token_id, device)
            state.step += 1
            if policy_phase:
                state.version += 1
                if state.version % cfg.push_every == 0:
                    queue.push(model, state.version)
            state.busy += time.monotonic() - began
            state.waited += waited
            state.restarts = queue.restarts
            row = step_row(row, state, samples, lags, drops, waited, policy_phase)
            report(row, out, board, log, total)
            if progress is not None:
                progress(100.0 * state.step / total)
            if state.step % cfg.save_steps == 0 or state.step == total or stop.received:
                saved = save_checkpoint(out, model, value, optimizers, state, state.step == total, cfg.keep_checkpoints)
                if stop.received and state.step < total:
                    ended = False
                    raise StopRequested(stop.received, state.step, str(saved))
    finally:
        stop.restore()
        if ended:
            queue.finish()
        queue.stop()
        if board is not None:
            board.close()
    folder = save_model_folder(model.cpu(), tokenizer, out / "model")
    facts, said = final_facts(state, cfg, resumed_step(resume), out)
    log(f"sao: {state.step} steps, policy version {state.version}, {state.consumed} samples; reward {said}")
    return model_meta("sao", folder, started, max_staleness=cfg.max_staleness, **facts)
