"""Activation checkpointing of the decoder blocks: what each block keeps for backward.

Three modes, chosen per stage (`TrainSpec.activation_checkpointing`, operational: it changes
memory and speed, never the math):
- "none": every block keeps what autograd saves (model/memory.py counts it per op);
- "selective": op-level selective checkpointing as torchtitan's `per_op_sac`, through
  `torch.utils.checkpoint.create_selective_checkpoint_contexts`: the outputs of the matmuls and of
  the attention kernel are kept (they cost FLOPs to redo), every other op of the block (norms,
  RoPE, SiLU, the products and the layout copies: cheap, memory-bound) is recomputed in backward.
  Unlike torchtitan we keep every matmul, not every other one: the point is to drop the cheap
  tensors, and the planner decides when that is not enough (then "full");
- "full": the block keeps only its input and reruns its whole forward in backward.

Both are non-reentrant `torch.utils.checkpoint` (they compose with FSDP2, DTensor tensor
parallelism and `torch.compile`), applied inside `Block.forward`, so parameter names, state dicts
and checkpoints are the same in every mode. Recomputation runs the same ops on the same inputs, so
on CPU fp32 the losses and weights of every mode are bit-identical (tests/model/test_recompute.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")


@functools.cache
def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention kernels (every
    backend this model can take), plus the reduce-scatter of sequence parallelism (recomputing a
    collective costs network time and must be issued identically on every rank)."""
    aten = torch.ops.aten
    names = (
        "mm.default",
        "addmm.default",
        "bmm.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default",
        "_scaled_dot_product_attention_math.default",
    )
    ops = set()
    for name in names:
        packet, overload = name.split(".")
        if hasattr(aten, packet):
            ops.add(getattr(getattr(aten, packet), overload))
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return frozenset(ops)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def run(fn: Callable[..., torch.Tensor], mode: str, *args: Any) -> torch.Tensor:
    """`fn(*args)` with the activations kept as `mode` says. Without grad (evaluation) there is
    nothing to keep, so every mode runs `fn` directly."""
    if mode == "none" or not torch.is_grad_enabled():
        return fn(*args)
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False)
    if mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective_contexts)
    raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
