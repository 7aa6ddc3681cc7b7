"""Capacity planner: how many GPUs, how much memory per GPU, and how long a recipe takes.

Formulas (reference/smollm3.md; Smol Training Playbook, Ultra-Scale Playbook):

- Training compute is ~6 N D FLOPs (N parameters, D tokens). GPUs = 6 N D / (per-GPU throughput
  x MFU x time). SmolLM3: 6 x 3e9 x 11e12 = 1.98e23 FLOPs at 720 TFLOP/s x 30% over 4 weeks is
  ~379 H100 (384 were used).
- Model state per GPU with mixed precision and Adam, Psi = parameters per model-parallel shard
  (N / (tp x pp)), ZeRO over the DP degree Nd: ZeRO-0 2Psi bf16 params + 2Psi bf16 grads + 12Psi fp32
  master and Adam = 16Psi; ZeRO-1 4Psi + 12Psi/Nd; ZeRO-2 2Psi + 14Psi/Nd; ZeRO-3 16Psi/Nd. fp32
  gradient accumulation adds 4Psi (sharded over Nd from ZeRO-2 on, like the grads it accumulates).
- Activations per layer (Korthikanti et al.), bf16, s = sequence, b = micro-batch, h = hidden, a =
  heads: s b h (34 + 5 a s / h) bytes without recompute; tensor parallelism with sequence
  parallelism divides it by tp; selective recompute drops the attention-score term (s b h 34 / tp);
  full recompute keeps only each layer's input (2 s b h / tp). FlashAttention never stores the
  s x s scores, so a flash/SDPA trainer sits at the `selective` figure without recomputing. With pipeline parallelism (1F1B) the
  first stage holds pp micro-batches of its layers/pp layers in flight, so activation memory on it
  does not shrink with pp: it stays ~layers x per-layer. Embedding/logit buffers, CUDA context and
  allocator fragmentation are not counted: keep 10-20% headroom.

These are the textbook figures for any trainer. What this project's trainer allocates, tensor by
tensor (its checkpointing modes, its chunked loss, FSDP2's gathered copies), is model/memory.py:
`smollm3 capacity --recipe NAME` prints it per stage, and the recipe check enforces it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Recompute = Literal["none", "selective", "full"]
SECONDS_PER_DAY = 86400.0
# SmolLM3-3B's run: what the plan assumes when a figure is not given (and says so)
DEFAULT_TOKENS = "11T"
DEFAULT_DAYS = 28.0
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_count(text: str | float | int) -> float:
    """'3B', '11.1T', '3.08e9', 2e12 -> a float count."""
    if isinstance(text, int | float):
        return float(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*([KMBGTP]?)\s*", text.upper())
    if not m:
        raise ValueError(f"count {text!r} must be a number with an optional K/M/B/T suffix (e.g. 3B)")
    return float(m.group(1)) * _SUFFIX.get(m.group(2), 1.0)


@dataclass(frozen=True)
class GpuPlan:
    """GPUs needed to train `params` on `tokens` in `days`."""

    params: float
    tokens: float
    days: float
    tflops_per_gpu: float  # measured dense bf16 matmul TFLOP/s (preflight gpu_matmul)
    mfu: float  # model FLOPs utilisation reached in training (SmolLM3: ~0.30)
    total_flops: float
    effective_tflops: float  # tflops_per_gpu x mfu
    gpus: float  # exact
    gpus_needed: int  # rounded up
    gpu_hours: float


def plan_gpus(params: float, tokens: float, days: float, tflops_per_gpu: float, mfu: float) -> GpuPlan:
    """GPUs = 6 N D / (per-GPU throughput x MFU x time)."""
    for name, v in (("params", params), ("tokens", tokens), ("days", days), ("tflops_per_gpu", tflops_per_gpu)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction in (0, 1], got {mfu}")
    flops = 6.0 * params * tokens
    effective = tflops_per_gpu * mfu * 1e12
    gpus = flops / (effective * days * SECONDS_PER_DAY)
    return GpuPlan(
        params,
        tokens,
        days,
        tflops_per_gpu,
        mfu,
        flops,
        tflops_per_gpu * mfu,
        gpus,
        math.ceil(gpus - 1e-9),
        flops / effective / 3600.0,
    )


@dataclass(frozen=True)
class TimePlan:
    """How long `gpus` GPUs take for a recipe, from throughput or measured tokens/s/GPU."""

    params: float
    tokens: float
    gpus: int
    tokens_per_second: float  # whole job
    days: float
    gpu_hours: float


def plan_time(
    params: float,
    tokens: float,
    gpus: int,
    tflops_per_gpu: float | None = None,
    mfu: float = 0.3,
    tokens_per_gpu_second: float | None = None,
) -> TimePlan:
    """Wall time and GPU-hours; pass a measured tokens/s/GPU, or TFLOP/s x MFU (6N FLOPs/token)."""
    if gpus <= 0:
        raise ValueError(f"gpus must be positive, got {gpus}")
    if tokens_per_gpu_second is None:
        if not tflops_per_gpu:
            raise ValueError("give tflops_per_gpu (e.g. preflight gpu_matmul) or tokens_per_gpu_second")
        tokens_per_gpu_second = tflops_per_gpu * 1e12 * mfu / (6.0 * params)
    rate = tokens_per_gpu_second * gpus
    seconds = tokens / rate
    return TimePlan(params, tokens, gpus, rate, seconds / SECONDS_PER_DAY, seconds * gpus / 3600.0)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU for one parallelism choice."""

    params: float
    dp: int
    zero: int
    tp: int
    pp: int
    recompute: Recompute
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float  # fp32 master weights + Adam moments (+ fp32 grad accumulation)
    activation_bytes: float
    activation_bytes_per_layer: float

    @property
    def model_state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes


def activation_bytes_per_layer(
    seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, recompute: Recompute = "none"
) -> float:
    """Activation bytes one transformer layer keeps for backward (bf16), per GPU."""
    sbh = seq * micro_batch * hidden
    if recompute == "none":
        return sbh * (34 + 5 * heads * seq / hidden) / tp
    if recompute == "selective":
        return sbh * 34 / tp
    if recompute == "full":
        return 2 * sbh / tp
    raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")


def memory_per_gpu(
    params: float,
    dp: int = 1,
    zero: int = 0,
    tp: int = 1,
    pp: int = 1,
    recompute: Recompute = "none",
    seq: int = 0,
    micro_batch: int = 1,
    layers: int = 0,
    hidden: int = 0,
    heads: int = 0,
    fp32_grad_accum: bool = False,
) -> MemoryPlan:
    """Model state and activation memory per GPU (see the module docstring for the formulas)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    psi = params / (tp * pp)  # parameters held by one model-parallel shard
    n = dp
    p_bytes = 2 * psi / (n if zero >= 3 else 1)
    g_bytes = 2 * psi / (n if zero >= 2 else 1)
    o_bytes = 12 * psi / (n if zero >= 1 else 1)
    if fp32_grad_accum:
        o_bytes += 4 * psi / (n if zero >= 2 else 1)
    per_layer = 0.0
    act = 0.0
    if seq and layers and hidden and heads:
        per_layer = activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp, recompute)
        in_flight = pp if pp > 1 else 1  # 1F1B: the first stage holds pp micro-batches
        act = per_layer * (layers / pp) * in_flight
    return MemoryPlan(params, dp, zero, tp, pp, recompute, p_bytes, g_bytes, o_bytes, act, per_layer)


def tflops_from_preflight(path: Path | str) -> float:
    """The slowest GPU's bf16 matmul TFLOP/s from a preflight.json (the pace of a sync step)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    for row in data.get("results", data if isinstance(data, list) else []):
        if row.get("name") == "gpu_matmul" and row.get("metric"):
            return float(row["metric"])
    raise ValueError(f"{path}: no measured gpu_matmul row (run preflight on a GPU node)")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB ({n / 2**30:.1f} GiB)"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def format_plan(gpus: GpuPlan | None = None, memory: MemoryPlan | None = None, time: TimePlan | None = None) -> str:
    """A plain-text report of whichever plans are given."""
    lines: list[str] = []
    if gpus is not None:
        lines += [
            "GPUs",
            f"  compute        6 x {_count(gpus.params)} params x {_count(gpus.tokens)} tokens = "
            f"{gpus.total_flops:.3g} FLOPs",
            f"  per GPU        {gpus.tflops_per_gpu:g} TFLOP/s x {gpus.mfu:.0%} MFU = "
            f"{gpus.effective_tflops:.1f} TFLOP/s",
            f"  GPUs needed    {gpus.gpus:.1f} -> {gpus.gpus_needed} for {gpus.days:g} days",
            f"  GPU-hours      {gpus.gpu_hours:,.0f}",
        ]
    if time is not None:
        lines += [
            "Time",
            f"  throughput     {time.tokens_per_second:,.0f} tokens/s on {time.gpus} GPUs "
            f"({time.tokens_per_second / time.gpus:,.0f} per GPU)",
            f"  wall time      {time.days:.1f} days for {_count(time.tokens)} tokens",
            f"  GPU-hours      {time.gpu_hours:,.0f}",
        ]
    if memory is not None:
        m = memory
        lines += [
            f"Memory per GPU (ZeRO-{m.zero}, dp {m.dp}, tp {m.tp}, pp {m.pp}, recompute {m.recompute})",
            f"  params         {_gb(m.param_bytes)}",
            f"  grads          {_gb(m.grad_bytes)}",
            f"  optimizer      {_gb(m.optimizer_bytes)}",
            f"  model state    {_gb(m.model_state_bytes)}",
            f"  activations    {_gb(m.activation_bytes)} ({_gb(m.activation_bytes_per_layer)} per layer)",
            f"  total          {_gb(m.total_bytes)} (+10-20% for buffers and fragmentation)",
        ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smollm3 capacity",
        description="GPUs, memory per GPU and time for a training run (6ND; Ultra-Scale memory).",
    )
    p.add_argument("--params", default="3B", help="model parameters (3B, 3.08e9)")
    p.add_argument(
        "--tokens",
        default=None,
        help=f"training tokens (default {DEFAULT_TOKENS}, SmolLM3-3B's; the GPU count needs yours)",
    )
    p.add_argument(
        "--days",
        type=float,
        default=None,
        help=f"wall-clock budget in days (default {DEFAULT_DAYS:g}, SmolLM3-3B's; the GPU count needs yours)",
    )
    p.add_argument(
        "--tflops", type=float, default=None, help="measured bf16 TFLOP/s per GPU (default 720, the playbook's H100)"
    )
    p.add_argument("--preflight", default=None, help="preflight.json to take the measured gpu_matmul TFLOP/s from")
    p.add_argument("--mfu", type=float, default=0.30, help="model FLOPs utilisation (0-1)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs you have: also report the wall time and the DP degree")
    p.add_argument(
        "--tokens-per-gpu-s",
        type=float,
        default=None,
        help="measured training tokens/s/GPU for the time estimate (overrides TFLOP/s x MFU)",
    )
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default gpus/(tp x pp))")
    p.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="activation recomputation: none keeps every activation, selective drops the "
        "attention scores, full keeps only each layer's input",
    )
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--layers", type=int, default=36, help="transformer layers (SmolLM3-3B: 36)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (SmolLM3-3B: 2048)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (SmolLM3-3B: 16)")
    p.add_argument("--fp32-grad-accum", action="store_true", help="add 4 Psi fp32 gradient buffers")
    p.add_argument(
        "--recipe",
        default=None,
        metavar="RECIPE [key=value ...]",
        help="instead: every stage of a recipe on its layout with this trainer's predicted peak memory "
        "per GPU (model/memory.py; `smollm3 capacity --recipe smollm3-3b`)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`smollm3 capacity`: print the GPU, time and memory plans; defaults are SmolLM3-3B's."""
    args = build_parser().parse_args(argv)
    if args.recipe:
        raise SystemExit("--recipe is answered by `smollm3 capacity --recipe NAME` (it loads the recipe)")
    params, tokens = parse_count(args.params), parse_count(args.tokens or DEFAULT_TOKENS)
    days = DEFAULT_DAYS if args.days is None else args.days
    tflops = args.tflops
    if args.preflight:
        tflops = tflops_from_preflight(args.preflight)
    if tflops is None:
        tflops = 720.0
    gpu_plan = plan_gpus(params, tokens, days, tflops, args.mfu)
    gpus = args.gpus or gpu_plan.gpus_needed
    time_plan = plan_time(params, tokens, gpus, tflops, args.mfu, args.tokens_per_gpu_s)
    dp = args.dp or max(1, gpus // (args.tp * args.pp))
    mem = memory_per_gpu(
        params,
        dp=dp,
        zero=args.zero,
        tp=args.tp,
        pp=args.pp,
        recompute=args.recompute,
        seq=args.seq,
        micro_batch=args.micro_batch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        fp32_grad_accum=args.fp32_grad_accum,
    )
    assumed = assumptions(args.tokens is None, args.days is None, args.tflops is None and not args.preflight)
    print("\n".join([*assumed, format_plan(gpu_plan, mem, time_plan)]))
    return 0


def assumptions(tokens: bool, days: bool, tflops: bool) -> list[str]:
    """Lines naming the figures the plan took from SmolLM3-3B's run because none were given: the
    GPU count and the time depend on them, the memory per GPU does not."""
    given = [
        *([f"--tokens (took {DEFAULT_TOKENS})"] if tokens else []),
        *([f"--days (took {DEFAULT_DAYS:g})"] if days else []),
        *(["--tflops or --preflight (took 720, the playbook's H100)"] if tflops else []),
    ]
    if not given:
        return []
    return [
        f"Assumed SmolLM3-3B's figures for what was not given: {', '.join(given)}.",
        "The GPU count and the time are for those: give your run's training tokens and deadline",
        "(e.g. `--tokens 1T --days 14`). Memory per GPU depends on neither.",
        "",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
