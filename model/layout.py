"""The layout of one training launch as plain numbers: world = replicate x shard x cp x tp.

Torch-free on purpose: the recipe check (flows/recipe.py) and the memory plan (model/memory.py)
use it without importing torch; model/parallel.py builds the device mesh and wraps the model
from it. Ranks are laid out (replicate, shard, cp, tp) row-major (torchtitan's order), so a TP
group is consecutive ranks inside one node, a CP group is consecutive TP groups inside that node,
and the ranks of one CP x TP block share one data-parallel index (`dp_rank`): they read the same
rows, which CP splits along the sequence (model/context_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig


@dataclass(frozen=True)
class Layout:
    """The ranks of one launch: world = replicate x shard x cp x tp."""

    world: int  # ranks of the launch (nodes x processes per node)
    tp: int = 1  # tensor-parallel degree, inside a node
    replicate: int = 1  # HSDP: data-parallel replicas (nodes); 1 = FSDP over every DP rank
    cp: int = 1  # context-parallel degree: ranks one sequence is split over, inside a node

    @property
    def dp(self) -> int:
        """Data-parallel ranks: what the global batch is split over."""
        return self.world // (self.tp * self.cp)

    @property
    def shard(self) -> int:
        """The data-parallel ranks of one replica (the mesh's `dp_shard` dimension)."""
        return self.dp // self.replicate

    @property
    def fsdp(self) -> int:
        """Ranks the parameters, gradients and optimizer state are sharded over: the replica's DP
        ranks and their CP ranks, which hold the same weights (torchtitan's `dp_shard_cp`)."""
        return self.shard * self.cp

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.cp)

    def describe(self) -> str:
        parts = [f"DP {self.dp}"]
        if self.replicate > 1:
            parts = [f"HSDP {self.replicate} x {self.shard}"]
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        return " x ".join(parts) + f" ({self.world} rank{'s' if self.world > 1 else ''})"


def plan_layout(world: int, procs_per_node: int, tp: int = 1, hsdp: bool = False, cp: int = 1) -> Layout:
    """The layout of `world` ranks with `procs_per_node` per node; errors name the setting at fault."""
    if tp < 1 or world % tp:
        raise ValueError(f"tp {tp} must divide the world size {world} (nodes x processes per node)")
    if tp > 1 and procs_per_node % tp:
        raise ValueError(
            f"tp {tp} must divide the processes per node ({procs_per_node}): tensor parallelism stays inside a node"
        )
    if cp < 1 or world % (tp * cp):
        raise ValueError(f"cp {cp} x tp {tp} must divide the world size {world} (nodes x processes per node)")
    if cp > 1 and procs_per_node % (tp * cp):
        raise ValueError(
            f"cp {cp} x tp {tp} must divide the processes per node ({procs_per_node}): "
            "the key/value all-gather of context parallelism stays inside a node"
        )
    replicate = 1
    if hsdp:
        if world % procs_per_node:
            raise ValueError(f"hsdp needs whole nodes: world size {world} is not a multiple of {procs_per_node}")
        replicate = world // procs_per_node
    return Layout(world=world, tp=tp, replicate=replicate, cp=cp)


def check_tensor_parallel(cfg: ModelConfig, tp: int, seq_len: int) -> None:
    """Refuse a model or sequence length that `tp` ranks cannot split evenly, naming the field."""
    if tp == 1:
        return
    checks = {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "intermediate_size": cfg.intermediate_size,
        "seq_len": seq_len,
    }
    bad = [f"{name} {value}" for name, value in checks.items() if value % tp]
    if bad:
        raise ValueError(f"tp {tp} must divide {', '.join(bad)}: choose a tp that divides them")
    if cfg.qk_norm:
        raise ValueError("tp > 1 does not support qk_norm (its per-head gains would need a gradient all-reduce)")


def check_context_parallel(cp: int, tp: int, seq_len: int) -> None:
    """Refuse a sequence length the CP x TP ranks cannot split evenly, naming the setting."""
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ValueError(f"cp {cp} needs seq_len divisible by 2 x cp = {2 * cp} (load-balanced chunks), got {seq_len}")
    if (seq_len // cp) % tp:
        raise ValueError(f"cp {cp} x tp {tp}: seq_len / cp = {seq_len // cp} must be divisible by tp {tp}")
