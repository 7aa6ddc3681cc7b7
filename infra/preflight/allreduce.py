"""All-reduce bandwidth worker, launched by torchrun (one process per rank).

    torchrun --standalone --nproc-per-node 8 -m infra.preflight.allreduce --backend nccl --mib 256
    # across nodes (Slurm): srun torchrun --nnodes $N --nproc-per-node 8 --rdzv-backend c10d \
    #   --rdzv-endpoint $HEAD:29500 -m infra.preflight.allreduce --backend nccl --mib 1024

First checks the sum is right (each rank contributes rank+1), then times `iters` all-reduces of
`mib` MiB fp32 after warmup. The slowest rank's time counts. Rank 0 prints one line:
`PREFLIGHT_ALLREDUCE {"busbw_gbps": ..., "algbw_gbps": ..., "world": ..., "correct": ...}`,
and with `--json PATH` writes the same record there, atomically (the preflight job's all-reduce
across its nodes: infra/preflight/cluster.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--mib", type=float, default=4.0, help="message size in MiB (fp32)")
    parser.add_argument("--iters", type=int, default=10, help="timed all-reduces")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="rank 0 also writes its record to this file")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from infra.preflight.collective import MARK, bus_bandwidth

    if args.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, device_id=device if args.backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        probe = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(probe)
        correct = bool(torch.all(probe == world * (world + 1) / 2).item())

        numel = max(1, int(args.mib * 2**20) // 4)
        x = torch.zeros(numel, dtype=torch.float32, device=device)  # zeros: sums never overflow
        for _ in range(args.warmup):
            dist.all_reduce(x)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        per_op = float(elapsed.item()) / args.iters
        algbw = numel * 4 / per_op / 1e9
        if rank == 0:
            result = {
                "backend": args.backend,
                "world": world,
                "mib": args.mib,
                "iters": args.iters,
                "seconds_per_op": per_op,
                "algbw_gbps": algbw,
                "busbw_gbps": bus_bandwidth(algbw, world),
                "correct": correct,
            }
            print(MARK + json.dumps(result), flush=True)
            if args.json:
                from infra.files import write_json_atomic

                write_json_atomic(args.json, result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from infra.exit import exit_process

    exit_process(main())  # sys.exit without the final collections over torch's objects
