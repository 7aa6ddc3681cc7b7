"""The trainer: `python -m trainers.pretrain SPEC.json`, under torchrun or alone (world size 1).

One launch trains one stage as described by a `TrainSpec`:
- ranks: NCCL on GPU, gloo on CPU; without torchrun a single-process gloo group, so
  collectives and DCP checkpointing run the same code at every world size;
- model: built and initialised identically on every rank from `spec.seed`, then laid out by
  model/parallel.py: tensor parallelism over `spec.tp` ranks of a node, context parallelism over
  `spec.cp` (each rank a load-balanced share of every sequence), FSDP2 (HSDP with
  `spec.hsdp`) over the data-parallel ranks, so the initial weights do not depend on the layout;
  `spec.precision` "auto" = FSDP2 mixed precision on GPU (bf16 compute, fp32 reduction and master
  weights), fp32 on CPU ("bf16" on CPU: bf16 autocast); `spec.compile_model` compiles each block in
  place (`Module.compile`, so parameter names and checkpoints do not change; "auto", the default:
  on CUDA only, `compiles_blocks`); `spec.fused_qkv` computes q, k and v as one matmul over the
  three weights (model/attention.py; the parameters and checkpoints stay three); each block keeps
  what `spec.activation_checkpointing` says (model/recompute.py; "auto" picks the lightest mode
  whose predicted peak fits the GPU, model/memory.py), and the loss is chunked
  (`spec.loss_chunk_tokens`, model/loss.py);
- data: `MixtureLoader` with global state, indexed by data-parallel rank (the ranks of one CP x TP
  block read the same rows), at most `spec.loader.open_shards` shards open and
  `spec.loader.prefetch` micro-batches drawn ahead by a background thread; gradient accumulation over global_batch / (micro_batch x DP)
  micro-batches; document ids mask attention inside each packed document unless `spec.doc_masking`
  is False (plain causal attention, positions 0..T-1);
- resume: from the newest complete checkpoint in `{out_dir}/checkpoints` (any world size and
  layout); otherwise from `init_from` (model, and optimizer unless reset_optimizer); otherwise
  fresh; `spec.async_checkpoint` writes checkpoints in the background (model/checkpoint.py);
- S3: with `spec.mirror`, rank 0 uploads each checkpoint once its marker is written, from a
  background thread behind a bounded queue, and applies the bucket's retention
  (`start_uploader`, infra/storage.py `CheckpointUploader`); the stage ends only when every
  checkpoint is verified on S3. With `spec.mirror.pull` (cluster launches) rank 0 first pulls
  the newest checkpoint from S3 when the checkpoints folder holds no complete one, the other
  ranks waiting at a barrier (`pull_mirror`);
- guard: a non-finite loss or gradient norm, or non-finite weights about to be saved, stops the
  run with `NonFiniteError` (exit code 3) before any checkpoint of that state is written, after
  recording in `monitor/nonfinite.json` what the pretrain step needs to roll back and skip the
  data that led there (trainers/callbacks.py `NonFiniteRollback`);
- watching itself: one callback per concern (trainers/callbacks.py; `pre_train`, `pre_step`,
  `post_step`, metrics and checkpoint hooks, `post_train`): the hang watchdog on every rank
  (trainers/watchdog.py: no completed step within its bound ends the rank with exit code 5,
  stacks in the log), straggler and throughput checks at every metrics line, the optional
  skip-step rule, planned data skips and the tracker (rules in trainers/monitor.py,
  trainers/tracker.py); checkpointing is `Checkpointing`. The loop itself (`_train`) builds the
  stage (`build_stage`), resumes it (`resume`), and runs `train_step` and the hooks;
- host synchronisation: none inside a step (the loss, gradient norm and first non-finite step
  stay on the device, `StepValues`); the loop reads them at a metrics line, before a save and at
  the end, where it also gathers the ranks' timings and answers stop signals (every step only
  when the skip-step rule, which judges each step, is on);
- outputs: `{out_dir}/metrics.jsonl` (rank 0) and its downsampled `metrics.curve.jsonl` with the
  per-source counts (`MetricsWriter`), checkpoints, and `{out_dir}/result.json`;
- logs: rank 0 writes one line every `log_interval` steps and at the end (step/total, loss, LR,
  gradient norm, tokens/s, MFU, ETA) to stderr, which the pretrain step streams into its task
  log; other ranks say only warnings and errors. MFU is against the peak of
  `model.flops.resolve_peak` (declared, datasheet, preflight calibration, else not reported);
  a figure above 100% is never printed: the line says the peak is wrong instead (what was achieved
  and against which peak), and the metrics record `mfu` null with `mfu_invalid` saying why;
- signals: SIGUSR1 (Slurm's time-limit warning) or SIGTERM (preemption, pod eviction, scancel)
  finish the steps up to the next metrics line or save (the current one at log_interval 1) on
  every rank, save a checkpoint of that step (synchronously: complete with its marker, even with
  async checkpoints) and exit with code 75, so the requeue resumes at that step
  (trainers/rank_signals.py);
- ownership: rank 0 leases `out_dir` (`infra.guard.StageLease`) before writing anything, so a
  second trainer in the same folder refuses to start (exit code 4) while the first lives; under
  torchrun every rank ends itself when torchrun dies (`protect_rank`), since torchrun puts ranks in
  sessions of their own where a kill of its process group does not reach them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.files import write_atomic
from infra.guard import LeaseHeld, StageLease, protect_rank
from infra.launchers.fabric import COLLECTIVE_TIMEOUT_ENV
from infra.progress import duration
from infra.storage import MIRROR_RECORD, PULLED, CheckpointUploader
from model.checkpoint import Checkpointer, read_trainer_state, resolve_checkpoint
from model.config import ModelConfig
from model.flops import resolve_peak, training_flops_per_token
from model.layout import check_context_parallel, check_tensor_parallel, plan_layout
from model.memory import DoesNotFit, does_not_fit, fitting_alternatives, resolve_checkpointing, step_shape
from model.model import SmolLM3
from model.optim import apply_hyperparameters, build_optimizer
from model.parallel import build_mesh, context_parallel, is_sharded, parallelize
from model.schedule import lr_at
from model.spec import TrainSpec, curve_path, curve_stride
from model.token_shards import MixtureLoader, MixturePlan
from trainers.callbacks import (
    Callbacks,
    NonFiniteRollback,
    RunInfo,
    SpeedMonitor,
    SpikeSkip,
    TrackerCallback,
    WatchdogCallback,
)
from trainers.rank_signals import (
    EXIT_STOPPED,
    EXIT_TRANSIENT,
    StopRequested,
    StopSignals,
    TransientFailure,
    pull_checkpoint,
)
from trainers.watchdog import Watchdog

log = logging.getLogger("trainers.pretrain")
EXIT_NON_FINITE = 3
EXIT_LEASE_HELD = 4


class NonFiniteError(RuntimeError):
    """Loss, gradient norm or weights became NaN or inf; the run must stop."""


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # we created the process group, so we destroy it
    closers: list[Callable[[], None]] = field(default_factory=list)  # run when training ends, however


def setup_runtime(spec: TrainSpec) -> Runtime:
    want_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("spec.device is 'cuda' but no CUDA device is visible")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if want_cuda:
        # Bind the GPU before NCCL starts, so its communicators land on the right device.
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        # Bit-reproducible CPU runs (resume after SIGKILL == uninterrupted run).
        torch.use_deterministic_algorithms(True)
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if want_cuda else "gloo"
        device_id = device if want_cuda else None
        if "RANK" in os.environ:  # under torchrun
            dist.init_process_group(backend, device_id=device_id, timeout=collective_timeout())
        else:  # plain `python -m trainers.pretrain`: a private one-process group
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
        owns = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    return Runtime(rank, world, device, owns)


def collective_timeout() -> timedelta | None:
    """The launch's collective timeout (launch.fabric.collective_timeout_s), else torch's default."""
    seconds = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    return timedelta(seconds=int(seconds)) if seconds else None


def build_model_config(spec: TrainSpec, plan: MixturePlan, seq_len: int) -> ModelConfig:
    overrides = dict(spec.model_overrides)
    overrides.setdefault("vocab_size", plan.vocab_size)
    if spec.rope_theta is not None:
        overrides["rope_theta"] = spec.rope_theta
    cfg = ModelConfig.from_preset(spec.model_preset, **overrides)
    if cfg.max_seq_len < seq_len:
        cfg = cfg.replace(max_seq_len=seq_len)
    if plan.vocab_size > cfg.vocab_size:
        raise ValueError(f"mixture plan vocab_size {plan.vocab_size} exceeds the model's {cfg.vocab_size}")
    return cfg


def autocast_for(spec: TrainSpec, device: torch.device):
    """The forward's autocast context: bf16 for precision "bf16" on CPU, else none (on GPU, bf16
    compute is FSDP2's mixed-precision policy: model/parallel.py `mixed_precision`)."""
    if spec.precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"spec.precision must be auto, bf16 or fp32, got {spec.precision!r}")
    bf16 = spec.precision == "bf16" and device.type != "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def computes_in_bf16(spec: TrainSpec, device: torch.device) -> bool:
    """Whether the matmuls run in bf16: CPU autocast, or GPU mixed precision."""
    if device.type == "cuda":
        return spec.precision != "fp32"
    return spec.precision == "bf16"


def compiles_blocks(setting: bool | str, device: torch.device) -> bool:
    """Whether `spec.compile_model` compiles the blocks on `device`: True and False force it;
    "auto" compiles on CUDA (inductor's Triton kernels: the speed-up torchtitan trains with) and
    runs eager elsewhere (on CPU compiling costs more than it saves at the sizes that train
    there, and the eager path is what every test compares against)."""
    if setting == "auto":
        return device.type == "cuda"
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"spec.compile_model must be true, false or 'auto', got {setting!r}")


def compile_blocks(model: SmolLM3) -> None:
    """torch.compile every block, as torchtitan does: the blocks share one graph per kind of block
    (RoPE and NoPE layers: two), and the embedding, the loss and the BlockMask construction stay
    eager. In place (`Module.compile`), so parameter names and checkpoints do not change. Under
    FSDP2 its hooks run inside the compiled call, left eager by dynamo (skip_fsdp_hooks)."""
    for block in model.layers:
        block.compile()


def peak_memory_gib(device: torch.device) -> float | None:
    """High-water mark of this rank's CUDA allocations since start; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def lay_out(spec: TrainSpec, rt: Runtime):
    """The launch's layout (model/parallel.py) and its device mesh (None when nothing is sharded)."""
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
    layout = plan_layout(rt.world_size, procs, spec.tp, spec.hsdp, spec.cp)
    return layout, build_mesh(layout, rt.device.type, is_sharded(layout, rt.device))


def memory_plan(spec: TrainSpec, cfg: ModelConfig, layout, device: torch.device, seq_len: int, world: int = 1):
    """The stage's checkpointing mode and predicted peak (model/memory.py): "auto" decides
    against the declared GPU memory, else this GPU's. Checked here, before anything is allocated,
    as the recipe check does: a launch that did not come through the recipe (a cluster job
    running `python -m trainers.pretrain spec.json`) is held to the same limit, and "auto" that
    finds no fitting mode refuses instead of running `full` over the limit."""
    sized = spec.model_copy(update={"seq_len": seq_len})
    shape = step_shape(sized, cfg, layout, device.type)
    total = torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None
    est = resolve_checkpointing(spec, shape, total)
    limit = spec.gpu_memory_gb or total
    if limit is not None and not est.fits(limit):
        procs = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        options = fitting_alternatives(
            sized, lambda tp: plan_layout(world, procs, tp, spec.hsdp, spec.cp), cfg.vocab_size, limit
        )
        of = "the spec's gpu_memory_gb" if spec.gpu_memory_gb else f"this GPU's ({torch.cuda.get_device_name(device)})"
        raise DoesNotFit(does_not_fit(f"stage {spec.stage}", est, layout.describe(), limit, of, options))
    return est


def precision_name(spec: TrainSpec, device: torch.device) -> str:
    if device.type == "cuda":
        return "fp32" if spec.precision == "fp32" else "bf16 mixed precision (fp32 master weights and reduction)"
    return "bf16 autocast" if spec.precision == "bf16" else "fp32"


def _all_finite(tensors) -> bool:
    """Collective: whether every rank's shards of `tensors` are finite. The flag lives on the
    tensors' device: NCCL (the training group on GPU) reduces no CPU tensor."""
    locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    bad = torch.zeros((), dtype=torch.float32, device=locals_[0].device if locals_ else "cpu")
    for local in locals_:
        if local.numel():
            bad += (~torch.isfinite(local)).any().float()
    if dist.is_initialized():
        dist.all_reduce(bad)
    return bad.item() == 0


PER_SOURCE = ("tokens_per_source", "epochs_per_source")  # in the curve's lines only


class MetricsWriter:
    """Rank 0 appends one JSON object per metrics line to the metrics file, and every `stride`-th
    line and the stage's last (model/spec.py `curve_stride`: about `CURVE_POINTS` lines whatever
    the stage's length) to its curve file, the one the flow process reads. The per-source token
    and epoch counts (a dict each, as many keys as the mixture has sources) go to the curve's
    lines only, so a metrics line's size does not grow with the mixture. Other ranks write nothing."""

    def __init__(self, path: Path, enabled: bool, resume_step: int, stride: int = 1, log_interval: int = 1) -> None:
        self.path, self.enabled, self.stride, self.log_interval = path, enabled, stride, log_interval
        self.curve = curve_path(path)
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        for file in (path, self.curve):
            _drop_lines_after(file, resume_step)

    def write(self, record: dict[str, Any], step: int, last: bool) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: v for k, v in record.items() if k not in PER_SOURCE}) + "\n")
        if last or (-(-step // self.log_interval) - 1) % self.stride == 0:
            with open(self.curve, "a") as f:
                f.write(json.dumps(record) + "\n")


def _drop_lines_after(path: Path, step: int) -> None:
    """Drop lines of steps lost with a killed run (they will be redone) and a last line cut by
    SIGKILL mid-write; read and rewritten a line at a time (a stage's file can be gigabytes)."""
    if not path.exists():
        return
    part = path.with_name(path.name + ".part")
    with open(path) as src, open(part, "w") as dst:
        for line in src:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                dst.write(line if line.endswith("\n") else line + "\n")
    os.replace(part, path)


class StepReport:
    """Rank 0's log lines: every `log_interval` steps and at the end, what a person watching the
    task log wants (step/total, loss, LR, gradient norm, tokens/s and MFU since the last line,
    ETA at the pace of this launch). An MFU above 100% is never shown as a figure: the peak it
    was computed against is below what this run achieved, so the peak is wrong (a calibration
    taken under load, a wrong declaration); the line says so, with both rates."""

    def __init__(
        self,
        stage: str,
        total: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak: float | None,
        peak_source: str,
        device_peak: float | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.stage, self.total = stage, total
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.peak_source = peak, peak_source  # peak over all ranks
        self.device_peak, self.device = device_peak, device  # one device's peak, for the metrics
        self.seconds = 0.0  # training time of this launch's steps (checkpoints excluded)
        self.steps = 0  # steps of this launch
        self.since = (0.0, 0)  # (seconds, steps) at the last line
        self.started = time.perf_counter()
        self.warned = False

    def stepped(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def invalid(self, tokens_per_s: float) -> str | None:
        """Why MFU at this rate cannot be reported (the achieved FLOP/s exceed the peak), or None."""
        if self.peak is None or not self.flops_per_token * tokens_per_s > self.peak:
            return None
        achieved = self.flops_per_token * tokens_per_s
        return (
            f"the peak is wrong: {achieved:.3g} FLOP/s achieved, above the peak of {self.peak:.3g} FLOP/s "
            f"({self.peak_source}); declare training.peak_flops or rerun preflight on a quiet machine"
        )

    def mfu(self, tokens_per_s: float) -> float | None:
        """MFU at this rate; None without a peak, or when the peak is wrong (warned once)."""
        if self.peak is None:
            return None
        why = self.invalid(tokens_per_s)
        if why is not None:
            if not self.warned:
                self.warned = True
                log.warning("%s: MFU not reported: %s", self.stage, why)
            return None
        return self.flops_per_token * tokens_per_s / self.peak

    def _mfu_text(self, rate: float, source: bool) -> str:
        if rate != rate:
            return ""
        mfu = self.mfu(rate)
        if mfu is not None:
            return f" | MFU {100 * mfu:.1f}%" + (f" ({self.peak_source})" if source else "")
        if self.peak is None:
            return " | MFU not reported (no peak)" if source else ""
        return " | MFU not reported (peak below the achieved rate)"

    def record(
        self, step: int, loss: float, grad_norm: float, lr: float, tokens_per_s: float, loader: MixtureLoader
    ) -> dict[str, Any]:
        """A metrics line's own fields (the callbacks add theirs)."""
        return {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "mfu": self.mfu(tokens_per_s),
            "mfu_invalid": self.invalid(tokens_per_s),  # why mfu is null with a peak known
            "mfu_peak_flops": self.device_peak,
            "mfu_peak_source": self.peak_source,
            "tokens_per_source": loader.tokens_per_source(),
            "epochs_per_source": loader.epochs_per_source(),
            "time": time.time(),
            "peak_memory_gib": peak_memory_gib(self.device) if self.device is not None else None,
        }

    def line_rate(self) -> float:
        """Tokens/s over the steps since the last log line (their training time, checkpoints
        excluded): the device's pace, not the host's, as the line is taken after the device is
        waited for (at log_interval 1: the logged step's own rate)."""
        seconds, steps = self.seconds - self.since[0], self.steps - self.since[1]
        return self.tokens_per_step * steps / seconds if seconds > 0 else float("nan")

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        seconds, steps = self.seconds - self.since[0], self.steps - self.since[1]
        self.since = (self.seconds, self.steps)
        rate = self.tokens_per_step * steps / seconds if seconds > 0 else float("nan")
        wall = time.perf_counter() - self.started  # checkpoints included: the real pace
        left = (self.total - step) * wall / self.steps if self.steps else None
        log.info(
            "%s step %d/%d | loss %.4f | lr %.2e | grad %.3f | %s tok/s%s | ETA %s",
            self.stage,
            step,
            self.total,
            loss,
            lr,
            grad_norm,
            f"{rate:,.0f}",
            self._mfu_text(rate, source=False),
            duration(left),
        )

    def log_end(self, loss: float) -> None:
        if not self.steps:
            log.info("%s: already finished at step %d (loss %.4f)", self.stage, self.total, loss)
            return
        rate = self.tokens_per_step * self.steps / self.seconds
        log.info(
            "%s done: %d steps in %s | loss %.4f | %s tok/s%s",
            self.stage,
            self.steps,
            duration(time.perf_counter() - self.started),
            loss,
            f"{rate:,.0f}",
            self._mfu_text(rate, source=True),
        )


def claim_stage(out_dir: Path, rt: Runtime) -> StageLease | None:
    """Rank 0 leases the stage folder; every rank raises `LeaseHeld` if another trainer has it."""
    lease, refused = None, None
    if rt.rank == 0:
        try:
            lease = StageLease(out_dir).acquire()
        except LeaseHeld as exc:
            refused = str(exc)
    verdict = [refused]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise LeaseHeld(verdict[0])
    return lease


def train(spec: TrainSpec, stop: StopSignals | None = None) -> dict[str, Any]:
    """Train the stage; with `stop`, a stop signal saves the current step and raises StopRequested."""
    rt = setup_runtime(spec)
    lease = None
    try:
        lease = claim_stage(Path(spec.out_dir), rt)
        return _train(spec, rt, stop)
    finally:
        for close in reversed(rt.closers):
            close()
        if lease is not None:
            lease.release()
        if rt.owns_group and dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Stage:
    """What one launch trains with (`build_stage`): the model laid out on the ranks, its optimizer,
    the data loader at this rank's place, the checkpointer."""

    spec: TrainSpec
    rt: Runtime
    plan: MixturePlan
    seq_len: int
    layout: Any  # model/layout.py Layout
    accum: int  # micro-batches per optimizer step on each data-parallel rank
    cfg: ModelConfig
    memory: Any  # model/memory.py MemoryPlan: the activation checkpointing mode and predicted peak
    model: SmolLM3
    optimizer: torch.optim.Optimizer
    loader: MixtureLoader
    ckpt: Checkpointer
    autocast: Any  # a context manager
    sharded: bool  # FSDP2 over a mesh

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())


def build_stage(spec: TrainSpec, rt: Runtime) -> Stage:
    """Lay the stage out on the ranks and build what it trains: the same initial weights on every
    rank and in every layout, then TP, compile, FSDP2."""
    plan = MixturePlan.load(spec.mixture_plan)
    seq_len = spec.seq_len or plan.seq_len
    layout, mesh = lay_out(spec, rt)
    per_step_rows = spec.micro_batch * layout.dp
    if spec.global_batch % per_step_rows:
        raise ValueError(
            f"spec.global_batch={spec.global_batch} is not a multiple of micro_batch "
            f"{spec.micro_batch} x data-parallel size {layout.dp} (world {rt.world_size} / tp {layout.tp} / cp {layout.cp})"
        )
    cfg = build_model_config(spec, plan, seq_len)
    check_tensor_parallel(cfg, layout.tp, seq_len // layout.cp)
    check_context_parallel(layout.cp, layout.tp, seq_len)
    memory = memory_plan(spec, cfg, layout, rt.device, seq_len, rt.world_size)

    model = SmolLM3(cfg, attention_backend=spec.attention_backend).to(rt.device)
    model.init_weights(seed=spec.seed)
    model.set_activation_checkpointing(memory.mode)
    model.set_fused_qkv(spec.fused_qkv)
    model.loss_chunk_tokens = spec.loss_chunk_tokens
    model.context_parallel = context_parallel(layout, mesh)  # None without CP
    autocast = autocast_for(spec, rt.device)
    compiled = compiles_blocks(spec.compile_model, rt.device)
    parallelize(model, layout, mesh, rt.device, spec.precision, compile_blocks if compiled else None)
    optimizer = build_optimizer(model, spec.optimizer)
    dp_rank = layout.dp_rank(rt.rank)
    loader = MixtureLoader(
        plan, seq_len=seq_len, rank=dp_rank, world_size=layout.dp, vocab_size=cfg.vocab_size,
        open_shards=spec.loader.open_shards, prefetch=spec.loader.prefetch, pin_memory=rt.device.type == "cuda",
    )  # fmt: skip
    rt.closers.append(loader.close)
    ckpt = Checkpointer(Path(spec.out_dir) / "checkpoints", spec.keep_last, async_save=spec.async_checkpoint)
    return Stage(
        spec, rt, plan, seq_len, layout, spec.global_batch // per_step_rows, cfg, memory, model, optimizer, loader,
        ckpt, autocast, mesh is not None,
    )  # fmt: skip


@dataclass
class Start:
    """Where this launch starts (`resume`)."""

    step: int  # steps of the stage done already
    schedule_start: int  # the schedule position of the stage's step 0
    resumed_from: str | None  # the checkpoint it resumed or was initialised from
    state: dict[str, Any] | None  # the resumed checkpoint's trainer state
    latest: Path | None  # the resumed checkpoint


def resume(st: Stage) -> Start:
    """From the newest checkpoint of the stage whose files match their digests (rank 0's listing,
    hashing shared out; a corrupt newer one is skipped with a warning naming what failed), else
    from `init_from`, else fresh; the spec's optimizer settings then apply either way."""
    spec = st.spec
    step, schedule_start, resumed_from, state = 0, spec.schedule.start_step or 0, None, None
    latest = st.ckpt.latest_verified(collective=True)
    if latest is not None:
        state = st.ckpt.load(latest, st.model, st.optimizer, verified=True)
        st.loader.load_state_dict(state["loader"])
        step, schedule_start, resumed_from = state["step"], state["schedule_start"], str(latest)
        log.info("resumed from %s at step %d (saved by %d ranks)", latest, step, state["world_size"])
    elif spec.init_from is not None:
        source = resolve_checkpoint(spec.init_from, collective=True)
        init_state = read_trainer_state(source)
        st.ckpt.load(source, st.model, None if spec.reset_optimizer else st.optimizer, verified=True)
        if spec.schedule.start_step is None and not spec.reset_schedule:
            schedule_start = init_state["schedule_start"] + init_state["step"]
        resumed_from = str(source)
        log.info("initialised from %s (schedule continues at %d)", source, schedule_start)
    apply_hyperparameters(st.optimizer, spec.optimizer)
    return Start(step, schedule_start, resumed_from, state, latest)


class Checkpointing:
    """The stage's saves: every `checkpoint_interval` steps and at its last step (and when a stop
    signal asks); weights that are not finite are never saved. The callbacks' state travels with
    each save, and they hear of it (the watchdog's checkpoint bound, the rollback point)."""

    def __init__(self, st: Stage, callbacks: Callbacks, schedule_start: int, last: Path | None) -> None:
        self.st, self.callbacks, self.schedule_start = st, callbacks, schedule_start
        self.last = last  # the newest complete checkpoint: where a failure rolls back to

    def due(self, step: int) -> bool:
        return step == self.st.spec.steps or step % self.st.spec.checkpoint_interval == 0

    def save(self, step: int, stage_end: bool, loss: float) -> Path:
        """Save this step (every rank); NonFiniteError when the weights are not finite."""
        st = self.st
        if not _all_finite(st.params):
            self.callbacks.nonfinite(step, "weights", float("nan"), self.last)
            raise NonFiniteError(
                f"weights are not finite after step {step}; not saving them (last good checkpoint: {self.last})"
            )
        self.callbacks.pre_checkpoint()
        path = st.ckpt.save(
            step,
            st.model,
            st.optimizer,
            {
                "stage": st.plan.stage,
                "global_step": self.schedule_start + step,
                "schedule_start": self.schedule_start,
                "loss": loss,
                "world_size": st.rt.world_size,
                "loader": st.loader.state_dict(),
                "tokens_per_source": st.loader.tokens_per_source(),
                "epochs_per_source": st.loader.epochs_per_source(),
                "monitor": self.callbacks.state_dict(),
            },
            stage_end=stage_end,
        )
        self.callbacks.post_checkpoint(step)
        self.last = path
        return path


class StepValues:
    """A step's global loss and gradient norm, kept on the device until a host needs them (a
    metrics line, a checkpoint, the stage's end, or a callback that judges every step): reading
    a device value is a host synchronisation, and the loop makes none elsewhere. The first step
    whose loss or gradient norm was not finite is remembered on the device too (`note`), so a
    failure read a few steps late still names its own step, what failed and its value."""

    LOSS, GRAD = 1.0, 2.0  # what failed first, as the fault's second number

    def __init__(self, device: torch.device) -> None:
        self.fault = torch.zeros(3, dtype=torch.float64, device=device)  # [step, what, value]; step 0: none
        self.loss_sum = torch.zeros((), device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.scale = 1

    def note(self, step: int, loss_sum: torch.Tensor, scale: int, grad_norm: torch.Tensor) -> None:
        """The step's summed loss (divided by `scale` on the host, as the loss always was) and
        gradient norm; no synchronisation."""
        self.loss_sum, self.scale, self.grad_norm = loss_sum, scale, grad_norm
        loss_bad, grad_bad = ~torch.isfinite(loss_sum), ~torch.isfinite(grad_norm)
        what = torch.where(loss_bad, self.LOSS, self.GRAD).double()
        value = torch.where(loss_bad, loss_sum.double(), grad_norm.double())
        first = (self.fault[0] == 0) & (loss_bad | grad_bad)
        candidate = torch.stack([torch.full_like(value, float(step)), what, value])
        self.fault = torch.where(first, candidate, self.fault)

    def read(self) -> tuple[float, float, tuple[int, str, float] | None]:
        """(loss, gradient norm, first fault or None): one transfer to the host."""
        loss_sum, grad_norm, step, what, value = torch.cat(
            [torch.stack([self.loss_sum.double(), self.grad_norm.double()]), self.fault]
        ).tolist()
        fault = None if step == 0 else (int(step), "loss" if what == self.LOSS else "gradient norm", value)
        return loss_sum / self.scale, grad_norm, fault


def check_finite(values: StepValues, callbacks: Callbacks, last: Path | None) -> tuple[float, float]:
    """Read the step values; NonFiniteError (after the callbacks heard of it) when a step since the
    last check had a non-finite loss or gradient norm."""
    loss_value, grad_norm, fault = values.read()
    if fault is None:
        return loss_value, grad_norm
    step, what, value = fault
    callbacks.nonfinite(step, what, value, last)
    if what == "loss":
        raise NonFiniteError(
            f"loss is {value} at step {step}; stopping before any checkpoint of "
            f"this state (last good checkpoint: {last})"
        )
    raise NonFiniteError(f"gradient norm is {value} at step {step}; stopping (last good checkpoint: {last})")


def train_step(
    st: Stage, step: int, speed: SpeedMonitor, callbacks: Callbacks, last: Path | None, values: StepValues
) -> bool:
    """One optimizer step (`step`, 1-based) at the LR already set: forward and backward over the
    micro-batches, the global loss, clipping, the update unless a callback withholds it. The loss
    and gradient norm stay on the device in `values` (read at metrics lines and checkpoints);
    only when a callback judges every step (the skip-step rule) are they read here, and a
    non-finite one raises NonFiniteError before the update. Returns whether the update was skipped."""
    spec, rt, accum = st.spec, st.rt, st.accum
    loss_sum = torch.zeros((), device=rt.device)
    copy = {"non_blocking": rt.device.type == "cuda"}  # the loader pins batches on CUDA: no stream sync
    for micro in range(accum):
        with speed.local():
            batch = st.loader.next_batch(spec.micro_batch)
        if st.sharded:
            st.model.set_requires_gradient_sync(micro == accum - 1)  # reduce once per step
        with st.autocast:
            out = st.model(
                batch.input_ids.to(rt.device, **copy),
                batch.doc_ids.to(rt.device, **copy) if spec.doc_masking else None,  # None: causal only
                batch.labels.to(rt.device, **copy),
            )
        loss = out.loss
        if spec.debug_nan_token is not None and bool((batch.input_ids == spec.debug_nan_token).any()):
            loss = loss * float("nan")  # testing only: a planted token poisons its batch
        (loss / accum).backward()
        loss_sum += loss.detach().float()
    dist.all_reduce(loss_sum)  # on the device: no host synchronisation
    params = st.params
    if spec.optimizer.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, spec.optimizer.grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    values.note(step, loss_sum, accum * rt.world_size, grad_norm)
    skipped = False
    if callbacks.per_step_values:
        loss_value, grad_value = check_finite(values, callbacks, last)
        skipped = callbacks.skip_update(step, loss_value, grad_value)  # the skip-step rule
    with speed.local(device=True):
        if not skipped:
            st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
    return skipped


def _train(spec: TrainSpec, rt: Runtime, stop: StopSignals | None = None) -> dict[str, Any]:
    out_dir = Path(spec.out_dir)
    is_main = rt.rank == 0
    # From here on a rank that completes no step within its bound ends the launch (trainers/watchdog.py).
    watchdog = Watchdog(spec.watchdog, out_dir, rt.rank, spec.stage).start()
    rt.closers.append(watchdog.stop)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        spec.save(out_dir / "spec.resolved.json")
    pull_mirror(spec, rt, watchdog)  # a cluster launch: rank 0 brings the newest checkpoint from S3, the others wait
    st = build_stage(spec, rt)
    start = resume(st)
    step, schedule_start = start.step, start.schedule_start
    uploader = start_uploader(st, schedule_start)
    total = spec.schedule.total_steps or schedule_start + spec.steps
    stride = curve_stride(spec.steps, spec.log_interval)
    metrics = MetricsWriter(spec.metrics_file, is_main, step, stride, spec.log_interval)
    report = announce(st, step)
    # One object per concern (trainers/callbacks.py); the order is the order each hook runs in.
    speed, spikes, rollback = SpeedMonitor(spec.monitor), SpikeSkip(spec.skip_spikes), NonFiniteRollback()
    callbacks = Callbacks([WatchdogCallback(watchdog), spikes, speed, rollback, TrackerCallback(spec.tracker)])
    rt.closers.append(callbacks.post_train)
    tokens_per_step = spec.global_batch * st.seq_len
    callbacks.pre_train(
        RunInfo(spec, rt.rank, rt.world_size, rt.device, st.plan.stage, st.seq_len, tokens_per_step, st.loader, step, start.state)
    )  # fmt: skip
    saves = Checkpointing(st, callbacks, schedule_start, start.latest)
    values = StepValues(rt.device)
    loss_value = float("nan")

    while step < spec.steps:
        t0 = time.perf_counter()
        callbacks.pre_step(step + 1)
        lr = lr_at(schedule_start + step, spec.optimizer.lr, spec.schedule, total)
        for group in st.optimizer.param_groups:
            group["lr"] = lr
        skipped = train_step(st, step + 1, speed, callbacks, saves.last, values)
        step += 1
        stage_end = step == spec.steps
        logged, saved = step % spec.log_interval == 0 or stage_end, saves.due(step)
        if logged or saved:  # the host waits for the device here only (and before a save)
            loss_value, grad_norm = check_finite(values, callbacks, saves.last)
        elapsed = time.perf_counter() - t0
        report.stepped(elapsed)
        callbacks.post_step(step, elapsed)
        if logged:
            fields, scalars = callbacks.metrics(step)  # collective: the ranks' times (stragglers, throughput)
            if is_main:
                record = report.record(step, loss_value, grad_norm, lr, report.line_rate(), st.loader)
                record = {**record, "skipped": skipped, **fields}
                metrics.write(record, step, stage_end)
                callbacks.log_metrics(step, record, scalars)  # TensorBoard / W&B / MLflow, live
                report.log_step(step, loss_value, lr, grad_norm)
        st.ckpt.poll()  # a background save whose every shard is written gets its marker
        if saved:
            saves.save(step, stage_end, loss_value)
        if spec.debug_step_sleep_s:
            time.sleep(spec.debug_step_sleep_s)
        # A stop signal is answered at the steps the host waits for the device anyway (all ranks agree).
        if stop is not None and not stage_end and (logged or saved) and stop.requested(rt.device):
            if not saved:
                saves.save(step, False, loss_value)
            st.ckpt.wait()  # an async save is complete (marker written) before the rank exits
            if is_main and stop.received_at is not None:
                log.info(
                    "%s: %.1f s from the signal to a saved checkpoint",
                    st.plan.stage,
                    time.monotonic() - stop.received_at,
                )
            raise StopRequested(stop.received or "a signal", step, str(saves.last))
    watchdog.begin_phase("ending")  # the last save's background writes and the result: the checkpoint bound
    st.ckpt.wait()
    if uploader is not None:  # the stage ends with every checkpoint verified on S3, or fails
        uploader.close()
    return finish(st, start, step, loss_value, saves.last, report, spikes.skipped, rollback.skips.windows)


def pull_mirror(spec: TrainSpec, rt: Runtime, watchdog: Watchdog | None = None) -> None:
    """With `spec.mirror.pull` (a cluster launch): rank 0 pulls the newest checkpoint that verifies
    from the mirror into the shared `{out_dir}/checkpoints` when that holds no complete one
    (infra/storage.py `pull_for_resume`: downloaded into a `.partial` folder renamed into place
    with its marker last, checked against the trainer's digests), then writes `{out_dir}/.pulled`,
    which the step removed before the launch. The other ranks wait for that file, not at a
    collective, so the pull may outlast the collective timeout: every rank's watchdog is in its
    `pull` phase, whose clock restarts whenever bytes arrive (`wait_for_pull`), so only a pull
    that stalls for the startup bound ends the launch. Then a barrier. A pull that fails on S3
    or the network raises `TransientFailure` (exit 6, retried by the step); any other failure ends
    rank 0 as an error, and with it the launch. Nothing without it: the step pulled before the
    launch (the local launcher), or there is no mirror."""
    if spec.mirror is None or not spec.mirror.pull:
        return
    from infra.storage import pull_progress, wait_for_pull

    out_dir, checkpoints = Path(spec.out_dir), Path(spec.out_dir) / "checkpoints"
    advanced = watchdog.advanced if watchdog is not None else None
    if watchdog is not None:
        watchdog.begin_phase("pull")
    if rt.rank == 0:
        done = threading.Event()

        def watch() -> None:  # rank 0's own watchdog sees its pull's bytes arrive
            last = pull_progress(checkpoints)
            while not done.wait(1.0):
                now = pull_progress(checkpoints)
                if now != last and advanced is not None:
                    advanced()
                last = now

        watcher = threading.Thread(target=watch, name="pull-progress", daemon=True)
        watcher.start()
        try:
            pull_checkpoint(spec.mirror, checkpoints, out_dir / MIRROR_RECORD, log.info)
        finally:
            done.set()
            watcher.join()
        write_atomic(out_dir / PULLED, str(os.getpid()))
    else:
        # the watchdog ends a stalled wait first (a hang, named); without one, the collective timeout
        collective = float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "1800"))
        stall = 2 * spec.watchdog.startup_s if spec.watchdog.enabled else collective
        try:
            wait_for_pull(out_dir / PULLED, checkpoints, stall_s=stall, on_progress=advanced)
        except TimeoutError as exc:
            raise TransientFailure(str(exc)) from exc
    if dist.is_initialized():
        dist.barrier()
    if watchdog is not None:
        watchdog.end_phase()


def start_uploader(st: Stage, schedule_start: int) -> CheckpointUploader | None:
    """Rank 0's S3 uploader of the stage's checkpoints (`spec.mirror`), handed every checkpoint as
    its marker is written; None on the other ranks and without a mirror. Rank 0 writes the marker,
    so it is the first to know a checkpoint is complete, and reads every rank's shards from the
    shared file system they were written to: one uploader per stage, no collective, nothing on
    the training thread but a bounded queue (infra/storage.py `CheckpointUploader`)."""
    spec = st.spec
    if spec.mirror is None or st.rt.rank != 0:
        return None
    from model.base_checkpoint import decay_start

    decay = decay_start(spec)
    uploader = CheckpointUploader(
        spec.mirror.uri,
        spec.mirror.storage,
        st.ckpt.root,
        stable_until=None if decay is None else decay - schedule_start,
        record=Path(spec.out_dir) / MIRROR_RECORD,
        log=log.info,
    ).start()
    st.rt.closers.append(uploader.abandon)  # a failing or stopping rank does not wait for S3
    st.ckpt.on_complete, st.ckpt.protect = uploader.submit, uploader.pending
    return uploader


def announce(st: Stage, step: int) -> StepReport:
    """Rank 0's first line (what trains, where, how, against which MFU peak); the step reporter."""
    spec, rt, cfg = st.spec, st.rt, st.cfg
    peak, peak_source = resolve_peak(
        spec.peak_flops,
        spec.peak_calibration,
        device=rt.device.type,
        bf16=computes_in_bf16(spec, rt.device),
        host=socket.gethostname(),
        threads=torch.get_num_threads(),
        device_name=torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "",
    )
    if rt.rank == 0:
        log.info(
            "%s: %s params, world %d (%s), accum %d, steps %d..%d, %s, %s, %s, %s, MFU peak %s (%s)",
            st.plan.stage,
            f"{cfg.num_parameters():,}",
            rt.world_size,
            st.layout.describe(),
            st.accum,
            step,
            spec.steps,
            precision_name(spec, rt.device),
            ("compiled blocks" if compiles_blocks(spec.compile_model, rt.device) else "eager")
            + (", fused QKV" if spec.fused_qkv else ", unfused QKV"),
            "intra-document masking" if spec.doc_masking else "causal attention across documents",
            f"activation checkpointing {st.memory.mode} (predicted peak {st.memory.describe()})",
            f"{peak:.3g} FLOP/s" if peak else "unknown",
            peak_source,
        )
    return StepReport(
        st.plan.stage,
        spec.steps,
        spec.global_batch * st.seq_len,
        training_flops_per_token(cfg, st.seq_len),
        peak * rt.world_size if peak else None,
        peak_source,
        peak,
        rt.device,
    )


def finish(
    st: Stage,
    start: Start,
    step: int,
    loss_value: float,
    last: Path | None,
    report: StepReport,
    skipped_steps: int,
    skipped_data: list[dict[str, Any]],
) -> dict[str, Any]:
    """The stage's result (rank 0 writes `result.json`, and its last log line)."""
    spec, rt = st.spec, st.rt
    if last is not None and math.isnan(loss_value):  # already finished before this launch
        loss_value = read_trainer_state(last)["loss"]
    result = {
        "stage": st.plan.stage,
        "final_step": step,
        "final_loss": loss_value,
        "tokens_per_source": st.loader.tokens_per_source(),
        "epochs_per_source": st.loader.epochs_per_source(),
        "checkpoint": str(last) if last is not None else None,
        "metrics": str(spec.metrics_file),
        "world_size": rt.world_size,
        "layout": st.layout.describe(),
        "activation_checkpointing": st.memory.mode,
        "predicted_peak_gb": round(st.memory.peak_gb, 3),  # model/memory.py, per rank
        "resumed_from": start.resumed_from,
        "resumed": start.latest is not None,  # from a checkpoint of this stage (not init_from)
        "skipped_steps": skipped_steps,  # the skip-step rule's
        "skipped_data": skipped_data,  # data windows skipped after non-finite values
    }
    if rt.rank == 0:
        report.log_end(loss_value)
        write_atomic(Path(spec.out_dir) / "result.json", json.dumps(result, indent=2) + "\n")
        if compiles_blocks(spec.compile_model, rt.device):
            from torch._dynamo.utils import counters

            # Evidence that compilation happened (and how often: recompiles show up here).
            log.info("torch.compile: %d graphs compiled", counters["stats"]["unique_graphs"])
    return result


class _Concise(logging.Formatter):
    """The message alone for INFO; `WARNING: message` otherwise."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        return text if record.levelno == logging.INFO else f"{record.levelname}: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainers.pretrain SPEC.json  (or under torchrun)", file=sys.stderr)
        return 2
    protect_rank()  # first: a rank must not outlive torchrun, even during startup
    stop = StopSignals().install()  # SIGUSR1/SIGTERM: save the step being trained, exit 75
    # Rank 0 speaks for the stage; the others only warn. No timestamps: the task log has them.
    handler = logging.StreamHandler()
    handler.setFormatter(_Concise())
    rank0 = int(os.environ.get("RANK", 0)) == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, handlers=[handler])
    # DTensor warns on every rank that the 2D gradient norm (FSDP x TP) takes two sequential
    # all-reduces, which "may" differ between ranks: each collective hands all its members the
    # same bits and every TP group reduces the same values in the same order, so they do not.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    spec = TrainSpec.load(argv[0])
    try:
        result = train(spec, stop)
    except StopRequested as err:
        if rank0:
            print(f"error: {err}", file=sys.stderr)
        return EXIT_STOPPED
    except NonFiniteError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NON_FINITE
    except LeaseHeld as err:
        print(f"error: LeaseHeld: {err}", file=sys.stderr)
        return EXIT_LEASE_HELD
    except TransientFailure as err:  # S3 or the network: the step's retry runs the launch again
        print(f"error: TransientFailure: {err}", file=sys.stderr)
        return EXIT_TRANSIENT
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from infra.exit import exit_process

    exit_process(main())  # sys.exit without the final collections over torch's objects
