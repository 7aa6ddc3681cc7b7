"""Host memory, CPUs and open files one node of a training stage needs: what its launch asks for.

The GPU side of a stage is model/memory.py's; this is the host side, per node of `nproc_per_node`
ranks, computed from the same stage spec and layout, so that the Slurm script's `--mem`,
`--cpus-per-task` and `ulimit -n` (and a PyTorchJob's memory and CPU) follow the plan instead of
the cluster's defaults (`LaunchConfig.sized`; the pretrain step applies it, `smollm3 capacity
--recipe` prints it). Per rank:

- the process itself (`RANK_PROCESS_GB`): Python, torch, the CUDA context's host side and NCCL's
  host buffers. Assumed, not measured here (no GPU node): a CUDA torch rank's RSS is a few GB.
- the data loader (`LOADER_GB`): model/token_shards.py keeps no per-document state (its traced
  heap at 100 shards was 300-307 kB at 2x10^4, 2x10^5 and 2x10^6 documents, 2026-12-05; what
  varies is how many of the at most `open_shards` cached shards are open, a few kB each) and
  per shard two numbers and the plan's path; its heap at the 3B recipe's scale (4.5B documents
  in 41k shards) is at most 0.23 GB per rank, projected by `benchmarks/loader_scale.py`
  (docs/scale.md, "The trainer's data loader"; an upper bound: its fit reads the cache filling
  as a per-document slope), rounded up to 0.25.
  Its memory-mapped shards are clean page cache (reclaimable, not counted). Plus the prefetched
  micro-batches: `prefetch` x micro-batch x sequence x 3 int64 arrays (ids, labels, documents).
- checkpointing: with `async_checkpoint` DCP's `async_save` copies the rank's whole model state
  (fp32 parameters and AdamW's two moments of its slice, model/memory.py `state_bytes`) to host
  memory before training goes on; a synchronous save copies one tensor at a time (the largest:
  the embedding's slice).
- on CPU only, the training step itself (model/memory.py's prediction for the CPU).

Per node: the ranks' sum plus `NODE_OVERHEAD_GB` (torchrun, the Slurm step, file-system
clients), times `HEADROOM` (an allowance for what none of these terms model: allocator caches,
pinned-memory rounding, a checkpoint load), rounded up to whole GB.

CPUs: each rank's compute threads (a GPU rank: one, or `training.num_threads`; a CPU rank: its
`threads`) plus `RANK_EXTRA_CPUS` (the prefetch thread and the checkpoint
writer / NCCL proxy thread), plus one for torchrun. Open files per rank: 2 x
`training.loader.open_shards` (a shard's `.ds` and `.index`) plus `OPEN_FILES_BASE` (libraries,
NCCL's sockets and pipes to its peers, DCP's checkpoint files, an allowance, rounded to a power
of two).
"""

from __future__ import annotations

import math

from infra.launchers.base import HostNeeds
from model.memory import GB, model_config_of, stage_estimate, state_bytes

RANK_PROCESS_GB = 4.0  # assumed: a CUDA torch rank's resident memory (libraries, CUDA and NCCL host side)
RANK_PROCESS_CPU_GB = 1.0  # assumed: a CPU (gloo) rank's resident memory besides its training step
LOADER_GB = 0.25  # measured: benchmarks/loader_scale.py, 0.23 GB per rank at the 3B recipe's scale
NODE_OVERHEAD_GB = 4.0  # assumed: torchrun, the Slurm step or kubelet's share, file-system clients
HEADROOM = 1.25  # allowance for what the terms do not model
RANK_EXTRA_CPUS = 2  # the loader's prefetch thread, the checkpoint writer / NCCL proxy thread
OPEN_FILES_BASE = 4096  # libraries, sockets and pipes to peers, checkpoint files: an allowance


def host_needs(spec, layout, nproc_per_node: int, *, threads: int = 1, vocab_size: int | None = None) -> HostNeeds:
    """What one node of a stage (a TrainSpec on its `layout`) needs on the host (module docstring)."""
    cfg = model_config_of(spec, vocab_size)
    gpu = spec.gpu_memory_gb is not None or spec.device == "cuda"
    state, largest = state_bytes(cfg, layout.tp, layout.fsdp)  # FSDP shards over DP x CP
    seq = spec.seq_len or cfg.max_seq_len
    prefetch = spec.loader.prefetch * spec.micro_batch * seq * 3 * 8
    staging = state if spec.async_checkpoint else largest
    n = nproc_per_node
    parts = {
        "processes": n * (RANK_PROCESS_GB if gpu else RANK_PROCESS_CPU_GB),
        "loader": n * (LOADER_GB + prefetch / GB),
        "checkpoint staging": n * staging / GB,
    }
    if not gpu:  # on CPU the training step itself lives in host memory: its predicted peak
        parts["training step"] = n * stage_estimate(spec, layout, vocab_size, "cpu").peak_bytes / GB
    parts["node"] = NODE_OVERHEAD_GB
    mem = math.ceil(sum(parts.values()) * HEADROOM)
    need = 2 * spec.loader.open_shards + OPEN_FILES_BASE
    open_files = 1 << (need - 1).bit_length()
    # a GPU rank's step runs on its GPU, driven by one thread; a CPU rank computes on its threads
    compute = (spec.num_threads or 1) if gpu else threads
    return HostNeeds(mem_gb=mem, cpus=n * (compute + RANK_EXTRA_CPUS) + 1, open_files=open_files, parts=parts)
