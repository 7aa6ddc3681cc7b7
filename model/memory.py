"""Predicted peak memory per GPU (or CPU rank) of one training step of this trainer.

The prediction counts what this code allocates, tensor by tensor, not a textbook formula: every
term below names the tensors it stands for, and each was checked against the tensors autograd
saves in model/model.py (a `saved_tensors_hooks` trace) and against measured peaks of real
training steps (benchmarks/memory_check.py; docs/model.md has the error table).

Notation: b micro-batch, s sequence, h hidden, kv = KV heads x head dim, i SwiGLU width, V
vocabulary, t tensor-parallel degree, a bytes per activation element (4 fp32 on CPU, 2 under bf16
mixed precision on GPU). Under context parallelism (cp > 1, model/context_parallel.py) s below is
the rank's share of the sequence, seq_len / cp, except for what the all-gather makes whole: the
gathered keys and values attention keeps for backward (2 a b seq_len kv / t per block, instead of
the local ones), their gradients before the reduce-scatter in backward (as much again, transient)
and the key dimension of the dense CPU mask (b, 1, s, seq_len); the model state is sharded over
DP x CP ranks (`Layout.fsdp`).

Per block, kept for backward (`activation_checkpointing: none`):
- each RMSNorm: its input in fp32 (the block's input itself when a = 4, a copy otherwise; b s/t h
  x 4), the normalised tensor before the gain (a), the rsqrt (b s/t x 4), and its output as the
  projections' input (a, b s h: under TP the all-gathered sequence, which is what the column-
  parallel matmuls keep);
- attention: q, k, v (a b s (h + 2 kv)/t; RoPE keeps nothing more: cos and sin need no gradient),
  the attention output (a b s h/t) and its log-sum-exp (fp32, b heads/t s); FlexAttention's
  output is (B, heads, T, hd)-contiguous, so its transpose to (B, T, H) is one more copy (SDPA's
  CPU and CUDA flash kernels return that layout already);
- SwiGLU: gate, SiLU(gate), up and their product (4 a b s i/t);
- with `fused_qkv` (model/attention.py), the q, k, v weights concatenated for the one matmul
  (a h (h + 2 kv)/t: at 3B and TP 2 in bf16, 6.3 MB per block, 226 MB for 36 blocks); in
  backward, the concatenated q, k, v gradient on top (`_backward_transient`).
`selective` keeps the block's input (a b s/t h) and the outputs of every matmul (q, k, v; gate
and up; o and down over the whole sequence, since under TP they are the partial sums before the
reduce-scatter, whose outputs it keeps too) and of the attention kernel; `full` keeps the input
only. Backward then rebuilds one block at a time: its `none` tensors (selective: minus the kept
ones), while the gradients flowing through it are alive.

Outside the blocks: the embedding's output feeds the first block; the final norm keeps what a
block's norm keeps; the loss (model/loss.py) holds one chunk of logits (c V/t, fp32, plus the bf16
matmul output and the bf16 gradient when a = 2), the hidden states' gradient (a b s h) and the
head's fp32 gradient (4 V h / t) until backward; the dense CPU document mask is one (b, 1, s, s)
additive tensor shared by every layer (CUDA's FlexAttention block mask is negligible once built).

Building that block mask is not: model/attention.py calls torch's `create_block_mask` outside any
compiled region, which evaluates the mask function on the dense (b, q, k) grid (a bool tensor, b x
queries x keys, each padded to 128), pads it (a bool copy) and sums it per 128 x 128 block, and
torch's sum of a bool tensor first makes an int64 copy of it: 10 bytes per element, freed before
the first block runs (measured on CPU with the same torch code: `MASK_BUILD_BYTES`,
tests/model/test_memory.py). It is the peak of a step (phase `mask`) when activations are small
and the key axis is long: CP's queries attend over the whole gathered sequence, so at 3B long64k
(16,384 queries x 65,536 keys per GPU) it is 10.7 GB, on top of the model state and, from the
second micro-batch of an accumulating step on, the accumulated fp32 gradients.

Model state per rank, P = parameters held per TP rank (matrices / t, norms whole), F = the FSDP
shard group (DP size, or the node's DP ranks under HSDP): fp32 parameters, gradients and both
AdamW moments, 16 P / F bytes; the optimizer step adds one fp32 temporary the size of its largest
parameter group (torch's foreach AdamW: `exp_avg_sq.sqrt()`). FSDP2 on GPU gathers bf16 copies of
the root (embedding) for the whole step and of two blocks at a time (the current and the
prefetched one), and in backward a block's bf16 gradient and its fp32 copy for the
reduce-scatter; on CPU the gathered fp32 parameters of every block stay from forward to backward
(model/parallel.py). Gradient accumulation (micro-batches > 1 per step) keeps every parameter's
unsharded fp32 gradient between micro-batches (no reduce-scatter until the last one).

Not counted, and why: the CUDA context, NCCL's buffers and the caching allocator's fragmentation
(nothing torch can measure allocates them on CPU): the recipe check adds `CONTEXT_GB` and
`FRAGMENTATION` x the prediction on top (`fits`). They are assumptions, not measurements, until the
GPU check (benchmarks/gpu_check.py) compares predicted and measured peaks on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.config import ModelConfig

MODES = ("none", "selective", "full")
CONTEXT_GB = 2.0  # CUDA context + NCCL communicators per GPU: assumed, not measured here
FRAGMENTATION = 0.10  # caching-allocator overhead over the allocated peak: assumed, not measured here
GB = 1e9
# create_block_mask (torch 2.11-2.13): its dense bool mask (1 byte per element), the padded copy (1)
# and the int64 copy its per-block sum makes (8); measured 10.00 bytes per element on CPU
MASK_BUILD_BYTES = 10
FLEX_BLOCK = 128  # model/attention.py pads queries and keys to whole blocks of this size


@dataclass(frozen=True)
class StepShape:
    """What one rank runs: the model, its micro-batch and how the launch splits it."""

    cfg: ModelConfig
    seq_len: int
    micro_batch: int
    accum: int = 1  # micro-batches per optimizer step on this rank
    tp: int = 1
    shard: int = 1  # ranks the model state is sharded over (FSDP group size); 1 = not sharded
    device: str = "cuda"  # "cuda" (bf16 mixed precision unless fp32) or "cpu" (fp32)
    precision: str = "auto"  # "auto" | "bf16" | "fp32": the trainer's spec.precision
    doc_masking: bool = True  # CPU: a dense (b, 1, s, s) mask; CUDA: FlexAttention
    loss_chunk_tokens: int = 1024
    wrapped: bool = True  # FSDP2 (always on GPU; on CPU from 2 ranks): gathered copies exist
    cp: int = 1  # context parallelism: this rank holds seq_len / cp tokens and gathers K/V of all
    fused_qkv: bool = False  # q, k, v as one matmul: each block keeps its concatenated weight

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence on this rank (all of them without context parallelism)."""
        return self.seq_len // self.cp

    @property
    def act_bytes(self) -> int:
        return 4 if self.device == "cpu" or self.precision == "fp32" else 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per rank: the peak, which phase it is in, and what it is made of."""

    mode: str  # activation checkpointing the prediction is for
    peak_bytes: float
    phase: str  # where the peak falls: mask (its build), loss, backward or optimizer
    parts: dict[str, float] = field(default_factory=dict)  # the terms of the peak phase
    phases: dict[str, float] = field(default_factory=dict)  # every phase's total

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB

    def budget_gb(self) -> float:
        """The prediction plus the assumed context and fragmentation: what must fit on the GPU."""
        return self.peak_gb * (1 + FRAGMENTATION) + CONTEXT_GB

    def fits(self, gpu_memory_gb: float) -> bool:
        return self.budget_gb() <= gpu_memory_gb

    def describe(self) -> str:
        """`52.3 GB at backward (model state 6.2, activations 31.8, ...)`; MB below 1 GB."""
        unit, scale = ("GB", GB) if self.peak_bytes >= GB else ("MB", 1e6)
        terms = ", ".join(f"{k} {v / scale:.1f}" for k, v in self.parts.items() if v >= 0.01 * self.peak_bytes)
        return f"{self.peak_bytes / scale:.1f} {unit} at {self.phase} ({terms})"


def _params_per_rank(cfg: ModelConfig, tp: int) -> dict[str, float]:
    """Parameters one TP rank holds, by group: blocks (per block), embedding, norms."""
    h, kv, i = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    matrices = (2 * h * h + 2 * h * kv + 3 * h * i) / tp
    norms = 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    embed = cfg.vocab_size * h / tp * (1 if cfg.tie_embeddings else 2)
    return {"block": matrices + norms, "block_matrices": matrices, "embed": embed, "final_norm": h}


def state_bytes(cfg: ModelConfig, tp: int, shard: int) -> tuple[float, float]:
    """(model state, its largest tensor) in bytes on one rank, both fp32: the parameters and
    AdamW's two moments (12 bytes per parameter) of its TP slice over the `shard` ranks of its
    FSDP group, and the largest single state tensor (the embedding's slice, 4 bytes per
    parameter): what a checkpoint save stages in host memory (model/host_memory.py)."""
    p = _params_per_rank(cfg, tp)
    per_rank = cfg.num_layers * p["block"] + p["embed"] + p["final_norm"]
    largest = cfg.vocab_size * cfg.hidden_size / tp
    return 12 * per_rank / shard, 4 * largest / shard


def layer_bytes(x: StepShape, mode: str) -> float:
    """Bytes one block keeps for backward in `mode` (module docstring)."""
    cfg, a, t = x.cfg, x.act_bytes, x.tp
    b, s, h = x.micro_batch, x.local_seq, cfg.hidden_size
    kv, i, heads = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.num_heads
    local = b * s / t * h  # elements of the residual stream on this rank
    flex = x.device == "cuda" and x.doc_masking
    lse = 4 * b * heads / t * s
    qkv = a * b * (s * h + 2 * x.seq_len * kv) / t  # under CP: local q, gathered k and v
    out = a * b * s * h / t
    if mode == "full":
        return a * local
    if mode == "selective":
        rs = 2 * a * local if t > 1 else 0.0  # the two reduce-scatter outputs
        return a * local + qkv + 2 * a * b * s * h + 2 * a * b * s * i / t + rs + out + lse
    norm = (4 + a) * local + 4 * b * s / t + a * b * s * h
    fused = a * h * (h + 2 * kv) / t if x.fused_qkv else 0.0  # the concatenated q, k, v weight
    return 2 * norm + qkv + out + lse + (out if flex else 0.0) + 4 * a * b * s * i / t + fused


def _recompute_bytes(x: StepShape, mode: str) -> float:
    """What backward rebuilds of one block in `mode` before its gradients are computed."""
    if mode == "none":
        return 0.0
    none = layer_bytes(x, "none")
    if mode == "full":
        return none
    cfg, a, t = x.cfg, x.act_bytes, x.tp
    b, s = x.micro_batch, x.local_seq
    kept = (
        a * b * (s * cfg.hidden_size + 2 * x.seq_len * cfg.num_kv_heads * cfg.head_dim) / t
        + a * b * s * cfg.hidden_size / t
        + 4 * b * cfg.num_heads / t * s
        + 2 * a * b * s * cfg.intermediate_size / t
    )
    return none - kept


def _backward_transient(x: StepShape) -> float:
    """Gradients alive while one block's backward runs: the residual stream's (two), and the SwiGLU
    backward's (the product's gradient, then SiLU's and up's, then gate's)."""
    cfg, a, t = x.cfg, x.act_bytes, x.tp
    b, s, h, i = x.micro_batch, x.local_seq, cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    gathered = 2 * a * b * x.seq_len * kv / t if x.cp > 1 else 0.0  # K/V gradients before the reduce-scatter
    # fused QKV: the q, k, v gradients concatenated for the one matmul's backward, and the
    # weight gradient's split (measured: about twice the output's size on top of three matmuls')
    fused = 2 * a * b * s * (h + 2 * kv) / t if x.fused_qkv else 0.0
    return 2 * a * b * s / t * h + a * b * s * h + 3 * a * b * s * i / t + gathered + fused


def _loss_bytes(x: StepShape) -> tuple[float, float]:
    """(held from the loss's forward to its backward, the chunk's transient peak)."""
    cfg, a, t = x.cfg, x.act_bytes, x.tp
    b, s, h, v = x.micro_batch, x.local_seq, cfg.hidden_size, cfg.vocab_size
    held = a * b * s * h + 4 * v * h / t  # hidden-state gradient, fp32 head gradient
    rows = min(x.loss_chunk_tokens, b * s)
    chunk = rows * v / t * (4 + (2 * a if a == 2 else 0))  # fp32 logits (+ bf16 output, bf16 gradient)
    if a == 2:
        chunk += a * v * h / t  # the chunk's bf16 head-gradient product before its fp32 accumulation
    return held, chunk


def mask_build_bytes(x: StepShape) -> float:
    """The transient peak of building the FlexAttention block mask on CUDA (module docstring):
    10 bytes per element of the dense (b, queries, keys) grid, each axis padded to whole blocks;
    0 where no block mask is built (CPU's dense mask is counted as a buffer; no document masking
    and no CP is plain causal attention)."""
    if x.device != "cuda" or not (x.doc_masking or x.cp > 1):
        return 0.0
    q, k = x.local_seq, x.seq_len
    return MASK_BUILD_BYTES * x.micro_batch * (q + -q % FLEX_BLOCK) * (k + -k % FLEX_BLOCK)


def estimate(x: StepShape, mode: str) -> MemoryEstimate:
    """Peak bytes per rank of one optimizer step of shape `x` with activation checkpointing `mode`."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
    cfg, a = x.cfg, x.act_bytes
    p = _params_per_rank(cfg, x.tp)
    per_rank = cfg.num_layers * p["block"] + p["embed"] + p["final_norm"]
    state = 12 * per_rank / x.shard  # fp32 parameters + AdamW moments
    grads = 4 * per_rank / x.shard
    decay = cfg.num_layers * p["block_matrices"] + (0 if cfg.tie_embeddings else p["embed"] / 2)
    optimizer_tmp = 4 * max(decay, per_rank - decay) / x.shard
    gpu = x.device == "cuda"
    mp = 2 if gpu and x.precision != "fp32" else 4  # bytes of a gathered parameter
    if not x.wrapped:
        gathered_fwd = gathered_bwd = 0.0
    elif gpu:
        gathered_fwd = mp * (p["embed"] + 2 * p["block"])
        gathered_bwd = gathered_fwd + 2 * mp * p["block"] + 4 * p["block"]  # block grads, fp32 copy
    else:  # CPU keeps every gathered block until backward
        gathered_fwd = gathered_bwd = 4 * per_rank
    accum_grads = 4 * per_rank if x.accum > 1 else 0.0
    b, s, h = x.micro_batch, x.local_seq, cfg.hidden_size
    layers = cfg.num_layers * layer_bytes(x, mode)
    final_norm = (4 + a) * b * s / x.tp * h + a * b * s * h
    mask = a * b * s * x.seq_len if ((x.doc_masking or x.cp > 1) and not gpu) else 0.0
    rope = 2 * a * (b if x.doc_masking else 1) * s * cfg.head_dim
    buffers = mask + rope
    held, chunk = _loss_bytes(x)
    base = state + accum_grads + buffers
    # at the mask's build: the root's gathered embedding (FSDP2's root forward) and its output
    root = mp * p["embed"] if x.wrapped and gpu else 0.0
    embedded = a * b * s / x.tp * h
    phases = {
        "mask": base + root + embedded + mask_build_bytes(x),
        "loss": base + gathered_fwd + layers + final_norm + held + chunk,
        "backward": base + gathered_bwd + layers + held + _recompute_bytes(x, mode) + _backward_transient(x),
        "optimizer": state + grads + optimizer_tmp,
    }
    phase = max(phases, key=phases.get)
    parts = {
        "mask": {
            "model state": state + accum_grads,
            "gathered params": root,
            "embedding output": embedded,
            "block mask build": mask_build_bytes(x),
            "buffers": buffers,
        },
        "loss": {
            "model state": state + accum_grads,
            "gathered params": gathered_fwd,
            "activations": layers + final_norm,
            "loss": held + chunk,
            "buffers": buffers,
        },
        "backward": {
            "model state": state + accum_grads,
            "gathered params+grads": gathered_bwd,
            "activations": layers,
            "recompute": _recompute_bytes(x, mode),
            "gradients in flight": _backward_transient(x),
            "loss gradients": held,
            "buffers": buffers,
        },
        "optimizer": {"model state": state, "gradients": grads, "optimizer temporaries": optimizer_tmp},
    }[phase]
    return MemoryEstimate(mode=mode, peak_bytes=phases[phase], phase=phase, parts=parts, phases=phases)


def choose(x: StepShape, gpu_memory_gb: float) -> MemoryEstimate:
    """The lightest checkpointing mode whose prediction fits `gpu_memory_gb` ("full" if none does:
    the caller refuses it, naming the figure)."""
    for mode in MODES:
        found = estimate(x, mode)
        if found.fits(gpu_memory_gb):
            return found
    return found


def step_shape(spec, cfg: ModelConfig, layout, device: str) -> StepShape:
    """The StepShape of a TrainSpec on a layout (model/parallel.py `Layout`) and device type: what
    the trainer runs, and what the recipe check predicts for it (the same function for both)."""
    seq = spec.seq_len or cfg.max_seq_len
    accum = max(1, spec.global_batch // (spec.micro_batch * layout.dp))
    wrapped = device == "cuda" or layout.world > 1
    return StepShape(
        cfg=cfg,
        seq_len=seq,
        micro_batch=spec.micro_batch,
        accum=accum,
        tp=layout.tp,
        shard=layout.fsdp if wrapped else 1,
        cp=layout.cp,
        device=device,
        precision=spec.precision,
        doc_masking=spec.doc_masking,
        loss_chunk_tokens=spec.loss_chunk_tokens,
        wrapped=wrapped,
        fused_qkv=spec.fused_qkv,
    )


def resolve_checkpointing(spec, shape: StepShape, device_memory_gb: float | None = None) -> MemoryEstimate:
    """The stage's checkpointing mode and its prediction: the spec's own, or for "auto" the lightest
    that fits the declared `gpu_memory_gb` (else `device_memory_gb`, the device's; "none" without
    either)."""
    mode = spec.activation_checkpointing
    if mode != "auto":
        return estimate(shape, mode)
    memory = spec.gpu_memory_gb or device_memory_gb
    return estimate(shape, "none") if memory is None else choose(shape, memory)


class DoesNotFit(ValueError):
    """A stage's predicted peak is over the GPU memory it must fit (the recipe check and the
    trainer's own start-up check raise it with the same message, `does_not_fit`)."""


def does_not_fit(where: str, est: MemoryEstimate, layout: str, limit_gb: float, of: str, options: list[str]) -> str:
    """Why a stage cannot run and what would: `where` names the stage (`stages[stage1]`), `of`
    the memory it was held to (`training.gpu_memory_gb`, or this GPU's)."""
    return (
        f"{where} does not fit {of} {limit_gb:g} GB: predicted peak {est.peak_gb:.1f} GB per GPU with "
        f"activation checkpointing {est.mode} on {layout} (+{FRAGMENTATION:.0%} fragmentation + {CONTEXT_GB:g} GB "
        f"context = {est.budget_gb():.1f} GB; {est.describe()}); "
        + (
            "settings that fit: " + ", ".join(options)
            if options
            else "no single change of checkpointing, micro-batch or tp fits: use more GPUs per stage "
            "(nodes), a shorter seq_len or a smaller model"
        )
    )


def model_config_of(spec, vocab_size: int | None = None) -> ModelConfig:
    """The ModelConfig a TrainSpec trains, as the trainer builds it (trainers/pretrain.py), at
    `vocab_size` when the spec does not set one (the trainer takes the mixture plan's)."""
    overrides = dict(spec.model_overrides)
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    cfg = ModelConfig.from_preset(spec.model_preset, **overrides)
    if spec.seq_len and cfg.max_seq_len < spec.seq_len:
        cfg = cfg.replace(max_seq_len=spec.seq_len)
    return cfg


def stage_estimate(spec, layout, vocab_size: int | None = None, device: str = "cuda") -> MemoryEstimate:
    """The prediction for one recipe stage on its layout: what `smollm3 plan` shows and the recipe
    check enforces (with "auto" resolved against the spec's declared GPU memory)."""
    from model.layout import check_context_parallel, check_tensor_parallel

    cfg = model_config_of(spec, vocab_size)
    seq = spec.seq_len or cfg.max_seq_len
    check_tensor_parallel(cfg, layout.tp, seq // layout.cp)
    check_context_parallel(layout.cp, layout.tp, seq)
    return resolve_checkpointing(spec, step_shape(spec, cfg, layout, device))


def fitting_alternatives(spec, layout_of, vocab_size: int | None, gpu_memory_gb: float) -> list[str]:
    """Settings that would make a stage fit, each with its predicted budget: other checkpointing
    modes, a smaller micro-batch (the global batch kept by accumulation), a larger TP degree.
    `layout_of(tp)` gives the stage's layout at another TP degree (or raises ValueError)."""
    found = []
    layout = layout_of(spec.tp)
    candidates = [({"activation_checkpointing": m}, layout) for m in MODES if m != spec.activation_checkpointing]
    candidates += [({"micro_batch": mb}, layout) for mb in range(spec.micro_batch - 1, 0, -1)]
    for tp in (2, 4, 8):
        if tp > spec.tp:
            try:
                candidates.append(({"tp": tp}, layout_of(tp)))
            except ValueError:
                continue
    for change, at in candidates:
        other = spec.model_copy(update=change)
        if other.global_batch % (other.micro_batch * at.dp):
            continue
        try:
            est = stage_estimate(other, at, vocab_size)
        except ValueError:
            continue
        if est.fits(gpu_memory_gb):
            key, value = next(iter(change.items()))
            found.append(f"{key}={value} ({est.budget_gb():.1f} GB)")
    return found


def measured_step_peak(model, optimizer, ids, labels, doc_ids) -> int:
    """Measured peak bytes of one training step as the trainer runs it (forward, chunked loss,
    backward, clipping, AdamW, zero_grad) after a first step has created the AdamW state: every
    tensor storage alive, seen by torch's MemTracker (a dispatch mode; works on CPU and on fake
    tensors). The check of `estimate` (benchmarks/memory_check.py, tests/model/test_memory.py)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    params = list(model.parameters())

    def step():
        model(ids, doc_ids, labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer, ids, labels, doc_ids)
    with tracker:
        step()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
