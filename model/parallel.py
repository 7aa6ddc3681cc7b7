"""How one training launch spreads the model over its ranks: the layout, the device mesh, tensor
parallelism, FSDP2 (or HSDP) and its mixed precision, as torchtitan's `parallelize_llama` does.

Layout (model/layout.py `Layout`, torch-free so recipe checks can use it): world = data-parallel
size x `cp` x `tp`. Ranks are laid out (replicate, shard, cp, tp)
row-major, so the `tp` ranks of a group are consecutive: inside one node, where tensor
parallelism's per-layer collectives belong. Each CP x TP block reads the same batch, so the data
loader and the global batch's divisibility see the DP size only (`dp_rank`, `Layout.dp`).

- Context parallelism (`cp` > 1, model/context_parallel.py): each CP rank takes a load-balanced
  share of every sequence and all-gathers keys and values over the mesh's `cp` dimension; FSDP
  shards over `dp_shard` x `cp` flattened (`dp_shard_cp`), as torchtitan does. It composes with TP
  (the CP share of the sequence is what sequence parallelism splits further) and HSDP.

- Tensor parallelism (`tp` > 1), DTensor's Megatron plan with sequence parallelism: q, k, v, gate
  and up are column-parallel (each rank holds its heads and its slice of the SwiGLU width), o and
  down row-parallel with their output reduce-scattered along the sequence; the norms run on the
  sequence shard (`SequenceParallel`), so the residual stream between blocks is (B, T/tp, H) per
  rank; the embedding is row-parallel over the vocabulary (`RowwiseParallel`), which shards the
  tied (V, H) weight along the vocabulary, exactly how the vocab-parallel loss (model/loss.py)
  wants the output head. TP needs heads, KV heads, vocabulary, SwiGLU width and sequence length
  divisible by `tp` (`check_tensor_parallel`) and no QK-norm (its per-head gains would need an
  all-reduce of their gradient across the group, which nothing here does).
- FSDP2 over the DP ranks: one unit per block, then the root (embedding, final norm). With
  `hsdp` the DP ranks form a 2D mesh (replicate across nodes, shard inside a node): parameters,
  gradients and optimizer state are sharded over the node's GPUs only and gradients are
  all-reduced between nodes, so a block's all-gather never leaves the node (`fully_shard` with a
  2D mesh). Without it every DP rank holds 1/DP of the state and every all-gather crosses nodes.
- Mixed precision on GPU, the usual policy: `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`: sharded parameters, gradients and AdamW state stay fp32 (the master
  weights), FSDP all-gathers bf16 copies for compute and reduce-scatters gradients in fp32. Every
  GPU launch is sharded, one rank included, so the policy always applies. CPU keeps fp32 (or bf16
  autocast when a spec asks for "bf16": the only bf16 path there).
- One CPU rank without TP trains the plain module: FSDP2 on one rank only adds copies and DTensor
  dispatch (measured 30-50% slower on CPU). On CPU the gathered parameters stay until backward (no
  second all-gather): memory is cheap there, gloo collectives are not.

DCP checkpoints store the global tensors' shards, so a checkpoint saved at any layout loads at any
other (tests/trainers/test_parallel.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from model.layout import Layout


def build_mesh(layout: Layout, device_type: str, sharded: bool):
    """The (dp_replicate, dp_shard, cp, tp) device mesh, or None when nothing is distributed;
    with CP, `dp_shard` and `cp` are also flattened into `dp_shard_cp`, FSDP's shard dimension."""
    if not sharded:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        device_type,
        (layout.replicate, layout.shard, layout.cp, layout.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"),
    )
    if layout.cp > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def context_parallel(layout: Layout, mesh):
    """This rank's CP group (model/context_parallel.py), or None without context parallelism."""
    if mesh is None or layout.cp == 1:
        return None
    from model.context_parallel import ContextParallel

    return ContextParallel.of(mesh["cp"].get_group())


def is_sharded(layout: Layout, device: torch.device) -> bool:
    """Whether the model is wrapped at all: always on GPU (mixed precision), on CPU from 2 ranks."""
    return device.type == "cuda" or layout.world > 1


def mixed_precision(device: torch.device, precision: str):
    """FSDP2's policy: bf16 compute, fp32 reduction, for "auto" or "bf16" on GPU; else None (fp32)."""
    if device.type != "cuda" or precision == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """The Megatron plan with sequence parallelism over `tp_mesh` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "attn.q": ColwiseParallel(),
                "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                "mlp_norm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate": ColwiseParallel(),
                "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def apply_fsdp(model: nn.Module, dp_mesh, mp_policy, reshard_after_forward: bool) -> None:
    """FSDP2 (HSDP on a 2D `dp_mesh`): one unit per block, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy or MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def parallelize(model: nn.Module, layout: Layout, mesh, device: torch.device, precision: str, compile_fn=None) -> None:
    """Tensor parallelism, then (optionally) compilation, then FSDP2, in place, in torchtitan's order."""
    if mesh is not None and layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if compile_fn is not None:
        compile_fn(model)
    if mesh is None:
        return
    # The CP ranks of a replica hold the same weights: FSDP shards over them too, and its
    # reduce-scatter averages over DP x CP ranks. Each CP rank's gradient is cp x its share of the
    # sequence's (the loss's all-reduce backward, model/context_parallel.py), so that average is CP 1's.
    shard = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
    with warnings.catch_warnings():  # torch 2.13 says slicing a flattened dimension will change
        warnings.filterwarnings("ignore", "Slicing a flattened dim")
        dp_mesh = mesh["dp_replicate", shard] if layout.replicate > 1 else mesh[shard]
    apply_fsdp(model, dp_mesh, mixed_precision(device, precision), reshard_after_forward=device.type == "cuda")
